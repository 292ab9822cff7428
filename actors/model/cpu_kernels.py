"""Our C kernels for CPU inference, compiled on first use with the system C compiler and loaded
with ctypes (no torch headers, so building takes about a second, not a minute).

The shared object is cached under ``$TANDEM_CACHE_DIR`` (default ``~/.cache/tandem``), keyed by
the source, the flags and the CPU (its feature flags), because it is built with
``-march=native``. Anything going wrong (no compiler, a sandbox without a writable cache)
disables the kernels with one warning; callers then use the torch path.
``TANDEM_CPU_KERNELS=0`` turns them off (``TANDEM_QUANT_GEMM=0`` only the quantized
projections').
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
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = tuple(
    _CSRC / name for name in ("paged_attention.c", "fused_ops.c", "quant_gemm.c", "decode_layers.c")
)
_HEADERS = (_CSRC / "common.h", _CSRC / "kernels.h")
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


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), part of the cache key: ``-march=native`` builds for
    them, and torch's capability names ("AVX512") do not tell a CPU with AVX-512 BF16 from one
    without (the kernels check at run time as well)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):  # x86, arm
                    return line
    except OSError:
        pass
    return ""


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    source = b"".join(path.read_bytes() for path in (*_SOURCES, *_HEADERS))
    key = hashlib.sha256(
        source
        + " ".join([compiler, *_FLAGS]).encode()
        + platform.machine().encode()
        + torch.backends.cpu.get_cpu_capability().encode()
        + _cpu_flags().encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"tandem_cpu-{key}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run(
            [compiler, *_FLAGS, *map(str, _SOURCES), "-o", str(out), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the CPU kernels failed: {proc.stderr.strip()[:500]}")
        os.replace(out, target)  # atomic: concurrent builders each publish a whole file
    logger.info("built %s", target)
    return target


_ARGTYPES: list[Any] = [
    ctypes.c_void_p,  # q
    ctypes.c_int64,  # q_stride (elements from one sequence's q to the next)
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

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # ctypes handles do not pickle: a copy (deepcopy, pickle) is this process's kernel.
        return (paged_decode_kernel, ())

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
        q: torch.Tensor,  # [S, H, D]: heads packed, sequences any stride apart
        k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D], each block contiguous
        v_cache: torch.Tensor,  # the same shape and strides
        tables: torch.Tensor,  # [S, max_blocks] int64 contiguous
        seq_lens: torch.Tensor,  # [S] int64
        out: torch.Tensor,  # [S, H, D] contiguous, written
        scale: float,
    ) -> None:
        s, h, d = q.shape
        kvh = k_cache.shape[2]
        if q.stride()[1:] != (d, 1) or not q.dtype == k_cache.dtype == out.dtype:
            raise ValueError(f"paged_decode_attention: q strides {q.stride()}, dtypes differ?")
        if not out.is_contiguous() or tables.dtype != torch.int64:
            raise ValueError("paged_decode_attention: out contiguous, int64 tables")
        if k_cache.stride()[1:] != (kvh * d, d, 1) or v_cache.stride() != k_cache.stride():
            raise ValueError(
                f"paged_decode_attention needs contiguous blocks, not strides {k_cache.stride()} "
                f"/ {v_cache.stride()}"
            )
        rc = self._fns[q.dtype](
            q.data_ptr(),
            q.stride(0),
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
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged once) when they cannot be built here."""
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    try:
        return ctypes.CDLL(str(_build()))
    except Exception as exc:  # no compiler, read-only home, unsupported platform...
        logger.warning("CPU kernels unavailable (%s); using the torch ops", exc)
        return None


_Kernels = TypeVar("_Kernels")


def bind_library(kind: Callable[[ctypes.CDLL], _Kernels]) -> _Kernels | None:
    """``kind`` made from the compiled library, or None (logged) when it cannot be."""
    lib = _library()
    if lib is None:
        return None
    try:
        return kind(lib)
    except AttributeError as exc:  # a library without the symbol (a stale or foreign build)
        logger.warning("CPU kernels unusable (%s); using the torch ops", exc)
        return None


@cache
def paged_decode_kernel() -> PagedDecodeKernel | None:
    """The paged decode attention kernel, or None when the kernels cannot be built here."""
    return bind_library(PagedDecodeKernel)


_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class FusedOps:
    """The decoder layer's element-wise steps as single C calls (``csrc/fused_ops.c``), for
    contiguous float32 / bfloat16 CPU tensors. Each equals the torch expression it replaces
    (``actors.model.llama``), with the same roundings."""

    dtypes = (torch.float32, torch.bfloat16)

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        # ctypes handles do not pickle: a copy (deepcopy, pickle) is this process's kernels.
        return (fused_ops, ())

    def __init__(self, lib: ctypes.CDLL) -> None:
        def bind(name: str, argtypes: list[Any]) -> Any:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            return fn

        norm_args = [_P, _P, _P, _P, _P, _I64, _I64, _I64, _F, _I]
        rotary_args = [_P, _P, _P, _P, _I64, _I64, _I, _I, _I]
        silu_args = [_P, _P, _I64, _I64, _I]
        self._norm = {
            torch.float32: bind("add_rms_norm_f32", norm_args),
            torch.bfloat16: bind("add_rms_norm_bf16", norm_args),
        }
        self._rotary = {
            torch.float32: bind("rotary_f32", rotary_args),
            torch.bfloat16: bind("rotary_bf16", rotary_args),
        }
        self._silu_mul = {
            torch.float32: bind("silu_mul_f32", silu_args),
            torch.bfloat16: bind("silu_mul_bf16", silu_args),
        }
        self._kv_write = bind("kv_write", [_P, _P, _I64, _I64, _P, _P, _P, _P, _I64, _I64, _I64])
        decode_args = [_P, _I64, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P]
        decode_args += [_I, _I, _I, _I, _I, _I, _I64, _F, _I]
        self._decode = {
            torch.float32: bind("decode_attention_f32", decode_args),
            torch.bfloat16: bind("decode_attention_bf16", decode_args),
        }

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual = x + residual`` (when given), then ``rms_norm(residual) * weight``;
        returns (normed, residual). ``x`` [T, H] may have a row stride (a slice of rows)."""
        rows, hidden = x.shape
        if x.stride(1) != 1:
            raise ValueError(f"add_rms_norm needs unit-stride rows, not strides {x.stride()}")
        if weight.dtype != x.dtype:
            raise TypeError(f"add_rms_norm: weight {weight.dtype} for activations {x.dtype}")
        out = torch.empty((rows, hidden), dtype=x.dtype)
        if residual is None:
            # The returned residual is read packed by the next call: no row stride.
            x = x if x.is_contiguous() else x.contiguous()
            self._norm[x.dtype](
                x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), None, rows, hidden,
                hidden, eps, torch.get_num_threads(),
            )  # fmt: skip
            return out, x
        if not residual.is_contiguous() or residual.dtype != x.dtype:
            raise ValueError("add_rms_norm: the residual must be contiguous, in x's dtype")
        summed = torch.empty((rows, hidden), dtype=x.dtype)
        self._norm[x.dtype](
            x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
            summed.data_ptr(), rows, hidden, x.stride(0), eps, torch.get_num_threads(),
        )  # fmt: skip
        return out, summed

    def rotary_(
        self,
        qk: torch.Tensor,  # [T, >= num_heads * head_dim], unit stride within a row
        positions: torch.Tensor,  # [T] int64
        cos_table: torch.Tensor,  # [max_position, head_dim]
        signed_sin_table: torch.Tensor,
        num_heads: int,
    ) -> None:
        """Rotates the first ``num_heads`` heads of every row in place."""
        head_dim = cos_table.shape[1]
        if qk.stride(1) != 1 or cos_table.dtype != qk.dtype or positions.dtype != torch.int64:
            raise ValueError("rotary_: unit-stride rows, tables in their dtype, int64 positions")
        rc = self._rotary[qk.dtype](
            qk.data_ptr(), positions.data_ptr(), cos_table.data_ptr(),
            signed_sin_table.data_ptr(), qk.shape[0], qk.stride(0), num_heads, head_dim,
            torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"rotary: unsupported head_dim {head_dim}")

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up`` = [T, 2 * inter] (contiguous)."""
        rows, width = gate_up.shape
        if not gate_up.is_contiguous():
            raise ValueError("silu_mul: gate_up must be contiguous")
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype)
        self._silu_mul[gate_up.dtype](
            gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads()
        )
        return out

    def kv_write(
        self,
        k: torch.Tensor,  # [T, KV * D]: rows with unit stride inside
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D], each block contiguous
        v_cache: torch.Tensor,
        slot_blocks: torch.Tensor,  # [T] int64
        slot_offsets: torch.Tensor,  # [T] int64
    ) -> None:
        """Copies each token's K and V row into its cache slot."""
        elem = k.element_size()
        row = k_cache.shape[2] * k_cache.shape[3]
        if k.shape[1] != row or k_cache.stride()[1:] != (row, k_cache.shape[3], 1):
            raise ValueError(f"kv_write: rows of {k.shape[1]} into a cache of {k_cache.shape}")
        if v_cache.stride() != k_cache.stride() or not k.dtype == v.dtype == k_cache.dtype:
            raise ValueError("kv_write: the K and V caches differ in layout or dtype")
        if v.shape != k.shape or k.stride(1) != 1 or v.stride(1) != 1:
            raise ValueError(f"kv_write: K {tuple(k.shape)} and V {tuple(v.shape)} rows differ")
        if slot_blocks.dtype != torch.int64 or slot_offsets.dtype != torch.int64:
            raise ValueError("kv_write: slots must be int64")
        if slot_blocks.numel() != k.shape[0] or slot_offsets.numel() != k.shape[0]:
            raise ValueError("kv_write: one slot per row")
        self._kv_write(
            k.data_ptr(), v.data_ptr(), k.stride(0) * elem, v.stride(0) * elem,
            k_cache.data_ptr(), v_cache.data_ptr(), slot_blocks.data_ptr(),
            slot_offsets.data_ptr(), k.shape[0], row * elem, k_cache.stride(0) * elem,
        )  # fmt: skip

    def decode_attention(
        self,
        qkv: torch.Tensor,  # [S, (H + 2 KV) * D]: one decode per row, unit stride inside
        positions: torch.Tensor,  # [S] int64
        tables: tuple[torch.Tensor, torch.Tensor],  # rotary cos, sign-folded sin [P, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D], each block contiguous
        v_cache: torch.Tensor,
        slots: tuple[torch.Tensor, torch.Tensor],  # [S] int64 blocks, offsets
        block_table: torch.Tensor,  # [S, max_blocks] int64
        seq_lens: torch.Tensor,  # [S] int64
        num_heads: int,
        scale: float,
    ) -> torch.Tensor:
        """A batch of decodes' attention in one call: ``rotary_`` of q and k in place,
        ``kv_write`` of k and v, the paged decode kernel reading q from the rows. The same
        kernels in the same order as the three calls: the same bits. Returns [S, H * D]."""
        s, width = qkv.shape
        _, block_size, kvh, d = k_cache.shape
        if qkv.stride(1) != 1 or width != (num_heads + 2 * kvh) * d:
            raise ValueError(f"decode_attention: rows of {width} for {num_heads}+2x{kvh} heads")
        if k_cache.stride()[1:] != (kvh * d, d, 1) or v_cache.stride() != k_cache.stride():
            raise ValueError(f"decode_attention: the cache's blocks are strided {k_cache.stride()}")
        if not qkv.dtype == k_cache.dtype == tables[0].dtype:
            raise ValueError("decode_attention: rows, cache and rotary tables differ in dtype")
        if not (positions.numel() == seq_lens.numel() == block_table.shape[0] == s):
            raise ValueError("decode_attention: one position, length and table per row")
        out = torch.empty((s, num_heads * d), dtype=qkv.dtype)
        rc = self._decode[qkv.dtype](
            qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), tables[0].data_ptr(),
            tables[1].data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            slots[0].data_ptr(), slots[1].data_ptr(), block_table.data_ptr(),
            seq_lens.data_ptr(), out.data_ptr(), s, num_heads, kvh, d, block_size,
            block_table.shape[1], k_cache.stride(0), scale, torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"decode_attention failed (code {rc})")
        return out


@cache
def fused_ops() -> FusedOps | None:
    """The fused element-wise kernels, or None when the kernels cannot be built here."""
    return bind_library(FusedOps)
