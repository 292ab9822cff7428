"""The quantized projections' kernels (``csrc/quant_gemm.c``, built with the other CPU kernels
by ``actors.model.cpu_kernels``): int4 and int8 weight-only products for bfloat16 activations
on CPUs with AVX-512 BF16, on the blocked layout that ``actors.model.quant`` packs."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from actors.model.cpu_kernels import bind_library

_P, _I, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class QuantGemm:
    """Weight-only quantized projections for bfloat16 activations (``csrc/quant_gemm.c``):
    4-bit codes in groups of 32 and 8-bit codes per row, in the blocked layout that
    ``actors.model.quant`` packs. Needs AVX-512 BF16 (``quant_gemm`` is None without it). The
    callers check dtypes and strides (``QuantizedWeight.matmul``)."""

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # ctypes handles do not pickle: a copy (deepcopy, pickle) is this process's kernels.
        return (quant_gemm, ())

    def __init__(self, lib: ctypes.CDLL) -> None:
        args: list[Any] = [_P, _I64, _I64, _I64, _P, _P, _I64, _P, _I64, _I]
        self._fns = {4: lib.int4_gemm_bf16, 8: lib.int8_gemm_bf16}
        for fn in self._fns.values():
            fn.argtypes, fn.restype = args, ctypes.c_int
        available = lib.quant_gemm_available
        available.restype = ctypes.c_int
        self.available = bool(available())

    def bind(
        self, bits: int, codes: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int]
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``x @ w.T`` for the packed weight of ``shape`` [N, K] (the closure holds ``codes``
        and ``scales``), ``x`` [M, K] bfloat16 on the CPU with unit stride inside a row. What
        does not change between calls is read once here: a decode step makes about 120 of
        these calls, and their Python side cost as much as a small projection's arithmetic."""
        fn, codes_ptr, scales_ptr = self._fns[bits], codes.data_ptr(), scales.data_ptr()
        empty, bf16, threads = torch.empty, torch.bfloat16, torch.get_num_threads
        n, width = shape

        # (``_owners``: the pointers' tensors live as long as the closure)
        def gemm(
            x: torch.Tensor, _owners: tuple[torch.Tensor, ...] = (codes, scales)
        ) -> torch.Tensor:
            m, k = x.shape  # (a ValueError for anything but a matrix)
            if k != width or x.device.type != "cpu":
                raise ValueError(f"int{bits} gemm: rows of {k} on {x.device} for {shape}")
            out = empty((m, n), dtype=bf16)
            rc = fn(
                x.data_ptr(), x.stride(0), m, k, codes_ptr, scales_ptr, n, out.data_ptr(), n,
                threads(),
            )  # fmt: skip
            if rc != 0:
                raise RuntimeError(f"int{bits} gemm failed (code {rc})")
            return out

        return gemm


@cache
def quant_gemm() -> QuantGemm | None:
    """The quantized projections' kernels, or None when the kernels cannot be built here or
    this CPU lacks AVX-512 BF16 (or ``TANDEM_QUANT_GEMM=0``: torch's kernels, for comparing)."""
    if os.environ.get("TANDEM_QUANT_GEMM", "1") == "0":
        return None
    kernels = bind_library(QuantGemm)
    return kernels if kernels is not None and kernels.available else None
