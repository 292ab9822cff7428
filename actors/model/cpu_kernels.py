"""Our C kernels for CPU inference, compiled on first use with the system C compiler and loaded
with ctypes (no torch headers, so building takes about a second, not a minute).

The shared object is cached under ``$TANDEM_CACHE_DIR`` (default ``~/.cache/tandem``), keyed by
the source, the flags and the CPU, because it is built with ``-march=native``. Anything going
wrong (no compiler, a sandbox without a writable cache) disables the kernels with one warning;
callers then use the torch path. ``TANDEM_CPU_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
# The parts of -ffast-math the reductions need to vectorize, not -ffast-math itself: with it,
# gcc links crtfastmath.o into the library, whose constructor turns on flush-to-zero for the
# whole process when the kernel loads (subnormals vanish everywhere: numpy, torch, hypothesis).
_FLAGS = [
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
    "-freciprocal-math",
    "-ffinite-math-only",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c11",
]


def _cache_dir() -> Path:
    root = os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem"
    return Path(root) / "kernels"


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        source
        + " ".join([compiler, *_FLAGS]).encode()
        + platform.machine().encode()
        + torch.backends.cpu.get_cpu_capability().encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"paged_attention-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", str(out), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {_SOURCE.name} failed: {proc.stderr.strip()[:500]}")
        os.replace(out, target)  # atomic: concurrent builders each publish a whole file
    logger.info("built %s", target)
    return target


_ARGTYPES: list[Any] = [
    ctypes.c_void_p,  # q
    ctypes.c_void_p,  # k_cache
    ctypes.c_void_p,  # v_cache
    ctypes.c_void_p,  # tables (int64)
    ctypes.c_void_p,  # seq_lens (int64)
    ctypes.c_void_p,  # out
    ctypes.c_int,  # num_seqs
    ctypes.c_int,  # num_heads
    ctypes.c_int,  # num_kv_heads
    ctypes.c_int,  # head_dim
    ctypes.c_int,  # block_size
    ctypes.c_int,  # max_blocks
    ctypes.c_int64,  # block_stride (elements from one block to the next)
    ctypes.c_float,  # scale
    ctypes.c_int,  # num_threads
]


class PagedDecodeKernel:
    """``paged_decode_attention`` for float32 and bfloat16 caches."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fns = {
            torch.float32: lib.paged_decode_attention_f32,
            torch.bfloat16: lib.paged_decode_attention_bf16,
        }
        for fn in self._fns.values():
            fn.argtypes = _ARGTYPES
            fn.restype = ctypes.c_int

    def supports(
        self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> bool:
        return dtype in self._fns and num_heads // num_kv_heads <= 16 and head_dim <= 256

    def __call__(
        self,
        q: torch.Tensor,  # [S, H, D] contiguous
        k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D], each block contiguous
        v_cache: torch.Tensor,  # the same shape and strides
        tables: torch.Tensor,  # [S, max_blocks] int64 contiguous
        seq_lens: torch.Tensor,  # [S] int64
        out: torch.Tensor,  # [S, H, D] contiguous, written
        scale: float,
    ) -> None:
        s, h, d = q.shape
        kvh = k_cache.shape[2]
        if k_cache.stride()[1:] != (kvh * d, d, 1) or v_cache.stride() != k_cache.stride():
            raise ValueError(
                f"paged_decode_attention needs contiguous blocks, not strides {k_cache.stride()} "
                f"/ {v_cache.stride()}"
            )
        rc = self._fns[q.dtype](
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tables.data_ptr(),
            seq_lens.data_ptr(),
            out.data_ptr(),
            s,
            h,
            k_cache.shape[2],
            d,
            k_cache.shape[1],
            tables.shape[1],
            k_cache.stride(0),
            scale,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"paged_decode_attention failed (code {rc})")


@cache
def paged_decode_kernel() -> PagedDecodeKernel | None:
    """The compiled kernel, or None (logged once) when it cannot be built here."""
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    try:
        return PagedDecodeKernel(ctypes.CDLL(str(_build())))
    except Exception as exc:  # no compiler, read-only home, unsupported platform...
        logger.warning("CPU paged-attention kernel unavailable (%s); using torch SDPA", exc)
        return None
