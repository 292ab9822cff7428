"""Weight-only quantized projections: int8 per output channel, int4 in groups along the input.

A ``QuantizedWeight`` holds a projection's weight ``[N, K]`` quantized and multiplies with
torch's CPU weight-only kernels, which read the quantized bytes directly (no float copy of the
weight is made per call):

- **int8**: ``w[n, k] = scale[n] * q[n, k]``, ``q`` int8, multiplied by
  ``torch._weight_int8pack_mm``;
- **int4**: ``w[n, k] = scale[n, g] * (q[n, k] - 8) + zero[n, g]`` for ``k`` in group ``g`` of
  ``group_size`` (32..256) inputs, ``q`` in 0..15 packed two per byte by
  ``_convert_weight_to_int4pack_for_cpu`` and multiplied by ``_weight_int4pack_mm_for_cpu``.

GGUF files hold weights in these shapes already, so a quantized file loads without a round trip
through floats: Q4_0 (``d * (q - 8)``) and Q4_1 (``d * q + m``, i.e. zero ``m + 8 d``) map onto
the int4 form exactly, group 32 (their scales rounded to the activations' dtype, as the kernel
reads them). Q8_0's scales are per block of 32, and torch's int8 kernel has one scale per row,
so Q8_0 is re-quantized to a row scale (the one lossy step; measured in ``docs/model.md``).
Float checkpoints are quantized by rounding to nearest (int8 symmetric per row, int4 asymmetric
per group of 32).

These kernels are vector-matrix kernels: they beat oneDNN's packed bf16 GEMM at a few rows (a
decode of a few requests: fewer bytes to read) and lose from about 8 rows on (they do not block
over rows). A ``QuantizedLinear`` can therefore keep a dense packed copy for the larger batches
(``dense_min_rows``); with ``dense_min_rows=0`` only the quantized bytes are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Method = Literal["int8", "int4"]
METHODS: tuple[str, ...] = ("auto", "none", "int8", "int4")
INT4_GROUP = 32


@dataclass
class GroupQuant:
    """A quantized block of rows as a checkpoint stores it: ``w = scale * codes + offset``, one
    ``scale`` / ``offset`` per row and group of ``group_size`` inputs (``offset`` None: 0).
    ``bits`` 4: codes in -8..7; 8: codes in -128..127."""

    codes: torch.Tensor  # [N, K] int8
    scale: torch.Tensor  # [N, K // group_size] float32
    offset: torch.Tensor | None  # [N, K // group_size] float32
    group_size: int
    bits: int

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        g = self.codes.view(n, k // self.group_size, self.group_size).float()
        w = g * self.scale[..., None]
        if self.offset is not None:
            w = w + self.offset[..., None]
        return w.view(n, k)


def concat_rows(parts: list[GroupQuant]) -> GroupQuant:
    """Stack row blocks (the q/k/v or gate/up matrices of one fused projection)."""
    first = parts[0]
    if any(p.group_size != first.group_size or p.bits != first.bits for p in parts):
        raise ValueError("the row blocks of one projection are quantized differently")
    offsets = [p.offset for p in parts]
    if all(o is None for o in offsets):
        offset = None
    else:
        offset = torch.cat(
            [
                o if o is not None else torch.zeros_like(p.scale)
                for o, p in zip(offsets, parts, strict=True)
            ]
        )
    return GroupQuant(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scale for p in parts]),
        offset,
        first.group_size,
        first.bits,
    )


class QuantizedWeight:
    """A ``[N, K]`` weight quantized for ``x @ w.T`` (``x``: float32 or bfloat16 rows)."""

    method: Method

    def __init__(
        self,
        method: Method,
        q: torch.Tensor,
        scales: torch.Tensor,
        group_size: int,
        shape: tuple[int, int],
        dtype: torch.dtype,
    ) -> None:
        self.method, self.q, self.scales = method, q, scales
        self.group_size, self.shape, self.dtype = group_size, shape, dtype
        # The float32 weight, kept from construction until ``take_dense`` (int4: reading it
        # back from torch's packed layout is slow).
        self._dense: torch.Tensor | None = None

    def take_dense(self) -> torch.Tensor:
        """The float32 weight these bytes stand for, once, cheaply after construction."""
        dense, self._dense = self._dense, None
        return dense if dense is not None else self.dequantize()

    @property
    def nbytes(self) -> int:
        return self.q.numel() * self.q.element_size() + self.scales.numel() * (
            self.scales.element_size()
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"activations are {x.dtype}, the weight was packed for {self.dtype}")
        if self.method == "int8":
            return torch._weight_int8pack_mm(x, self.q, self.scales)
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.q, self.group_size, self.scales
        )
        return out

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these bytes stand for (tests, the dense copy)."""
        k = self.shape[1]
        if self.method == "int8":
            return self.q.float() * self.scales.float()[:, None]
        # The packed layout is private to torch: multiply by the identity instead.
        eye = torch.eye(k, dtype=self.dtype)
        w: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.q, self.group_size, self.scales
        )
        return w.float().t().contiguous()

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_group_quant(
        cls, src: GroupQuant, method: Method, dtype: torch.dtype
    ) -> QuantizedWeight:
        """From a checkpoint's quantized rows: exact when the forms match (4-bit into int4),
        re-quantized otherwise (8-bit groups into int8 rows, or anything into a coarser form)."""
        if method == "int4" and src.bits == 4 and src.group_size in (32, 64, 128, 256):
            scale = src.scale
            zero = src.offset if src.offset is not None else torch.zeros_like(scale)
            # codes are q - 8 already: w = scale * (q - 8) + zero.
            q = (src.codes.to(torch.int32) + 8).contiguous()
            return cls._pack_int4(q, scale, zero, src.group_size, dtype)
        return cls.from_float(src.dequantize(), method, dtype)

    @classmethod
    def from_float(cls, w: torch.Tensor, method: Method, dtype: torch.dtype) -> QuantizedWeight:
        """Round to nearest: int8 symmetric per row; int4 asymmetric per group of 32 inputs."""
        w = w.detach().float()
        n, k = w.shape
        if method == "int8":
            scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
            q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            return cls("int8", q.contiguous(), scale.to(dtype), 0, (n, k), dtype)
        if method != "int4":
            raise ValueError(f"unknown quantization method {method!r}")
        g = INT4_GROUP
        if k % g:
            raise ValueError(f"int4 needs the input size ({k}) to be a multiple of {g}")
        groups = w.view(n, k // g, g)
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
        scale = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15)
        zero = lo + 8.0 * scale
        return cls._pack_int4(q.view(n, k).to(torch.int32), scale, zero, g, dtype)

    @classmethod
    def _pack_int4(
        cls,
        q: torch.Tensor,  # [N, K] int32 in 0..15
        scale: torch.Tensor,  # [N, K // g]
        zero: torch.Tensor,  # [N, K // g]
        group_size: int,
        dtype: torch.dtype,
    ) -> QuantizedWeight:
        n, k = q.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # The kernel wants [K // g, N, 2] (scale, zero) in the activations' dtype.
        scales_and_zeros = torch.stack([scale.float(), zero.float()], dim=-1)
        scales_and_zeros = scales_and_zeros.transpose(0, 1).contiguous().to(dtype)
        weight = cls("int4", packed, scales_and_zeros, group_size, (n, k), dtype)
        # What the kernel computes with: scale and zero as rounded to ``dtype``.
        sz = scales_and_zeros.float().transpose(0, 1)  # [N, K // g, 2]
        codes = (q - 8).float().view(n, k // group_size, group_size)
        weight._dense = (codes * sz[..., :1] + sz[..., 1:]).view(n, k)
        return weight


def quantized_matmul_supported(device: torch.device, dtype: torch.dtype) -> str | None:
    """None when weight-only kernels run here, else why not."""
    if device.type != "cpu":
        return f"weight-only quantized kernels are wired for CPU only, not {device.type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"quantized projections need float32 or bfloat16 activations, not {dtype}"
    ops = (
        "_weight_int8pack_mm",
        "_weight_int4pack_mm_for_cpu",
        "_convert_weight_to_int4pack_for_cpu",
    )
    missing = [op for op in ops if not hasattr(torch.ops.aten, op)]
    if missing:
        return f"this torch build lacks {', '.join(missing)}"
    return None


def quantized_matmul_fast(dtype: torch.dtype) -> str | None:
    """None when the weight-only kernels beat the dense GEMM at small batches, else why not:
    with float32 activations torch's kernels have no vector path and ran 20-40x slower than
    the dense GEMM here (they are for correctness checks then, not speed)."""
    if dtype != torch.bfloat16:
        return f"torch's weight-only kernels are slow with {dtype} activations (no vector path)"
    return None
