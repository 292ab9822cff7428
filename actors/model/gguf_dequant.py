"""Dequantize GGML tensor data with our own vectorized numpy kernels, bit-exact against
``gguf.quants`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; other types fall back to it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeAlias

import gguf.quants
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from actors.model.quant import GroupQuant

__all__ = ["dequantize", "group_quant"]

QT = GGMLQuantizationType

# ---------------------------------------------------------------------------------------------
# Dequantization. Each kernel maps (n_blocks, type_size) uint8 -> (n_blocks, block_size) f32.
# Block layouts (bytes): d/m are f16, qs packs two 4-bit values per byte: element j < 16 is the
# low nibble of qs[j], element j >= 16 the high nibble of qs[j - 16]; qh bit j is element j's 5th
# bit. Arithmetic order (d * q, then + m) mirrors gguf.quants so results are bit-identical.
#   Q8_0 [d | 32 x i8]   Q4_0 [d | qs16]   Q4_1 [d | m | qs16]
#   Q5_0 [d | qh4 | qs16]   Q5_1 [d | m | qh4 | qs16]
# The kernels are numpy (single-threaded, ~0.7 s for SmolLM2's 134.5 M weights): torch's
# 2-thread ops were ~2x faster on an idle machine but ~10x slower when other processes compete
# for the cores (its workers spin at barriers), and loading must not depend on a quiet machine.
# ---------------------------------------------------------------------------------------------

F32Array: TypeAlias = "np.ndarray[Any, np.dtype[np.float32]]"


def _f16_col(blocks: np.ndarray, start: int) -> F32Array:
    """The f16 scalar at byte ``start`` of each block, as an (n_blocks, 1) float32 array."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view(np.float16).astype(np.float32)


def _nibbles(blocks: np.ndarray, start: int) -> np.ndarray:
    """The 32 4-bit values packed in bytes ``start:start+16``, as (n_blocks, 32) uint8."""
    qs = blocks[:, start : start + 16]
    return np.concatenate((qs & np.uint8(0x0F), qs >> np.uint8(4)), axis=1)


def _with_high_bits(blocks: np.ndarray, qh_start: int, qs_start: int) -> np.ndarray:
    """The 32 5-bit values: nibbles plus the fifth bits from the u32 at ``qh_start``."""
    bits = np.unpackbits(blocks[:, qh_start : qh_start + 4], axis=1, bitorder="little")
    q: np.ndarray = _nibbles(blocks, qs_start) | (bits << np.uint8(4))
    return q


def _scaled(q: np.ndarray, blocks: np.ndarray, offset: float, has_min: bool) -> F32Array:
    """(q - offset) * d (+ m), in place on a fresh float32 copy of ``q``."""
    out = q.astype(np.float32)
    if offset:
        out -= np.float32(offset)
    out *= _f16_col(blocks, 0)
    if has_min:
        out += _f16_col(blocks, 2)
    return out


def _q8_0(b: np.ndarray) -> F32Array:
    return _scaled(b[:, 2:].view(np.int8), b, 0.0, False)


def _q4_0(b: np.ndarray) -> F32Array:
    return _scaled(_nibbles(b, 2), b, 8.0, False)


def _q4_1(b: np.ndarray) -> F32Array:
    return _scaled(_nibbles(b, 4), b, 0.0, True)


def _q5_0(b: np.ndarray) -> F32Array:
    return _scaled(_with_high_bits(b, 2, 6), b, 16.0, False)


def _q5_1(b: np.ndarray) -> F32Array:
    return _scaled(_with_high_bits(b, 4, 8), b, 0.0, True)


def _f16(b: np.ndarray) -> F32Array:
    return b.view(np.float16).astype(np.float32)


def _bf16(b: np.ndarray) -> F32Array:
    # A bf16 is the high half of an f32: widening is a 16-bit shift, exact for every value.
    out: F32Array = (b.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
    return out


def _f32(b: np.ndarray) -> F32Array:
    out: F32Array = b.view(np.float32).copy()  # copy: the source map is read-only
    return out


_KERNELS: dict[GGMLQuantizationType, Callable[[np.ndarray], F32Array]] = {
    QT.F32: _f32,
    QT.F16: _f16,
    QT.BF16: _bf16,
    QT.Q8_0: _q8_0,
    QT.Q4_0: _q4_0,
    QT.Q4_1: _q4_1,
    QT.Q5_0: _q5_0,
    QT.Q5_1: _q5_1,
}


def dequantize(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Decode a tensor's raw bytes into a new float32 tensor of ``shape`` (torch order).

    ``raw`` may be any contiguous array over the tensor's bytes (e.g. :meth:`GGUFFile.raw` or
    ``GGUFReader``'s ``tensor.data``); it is not modified. F32, F16, BF16, Q8_0, Q4_0, Q4_1,
    Q5_0 and Q5_1 use our vectorized kernels; other types (k-quants, i-quants, ...) fall back to
    the slower ``gguf.quants.dequantize``. Raises ValueError when the bytes do not fit ``shape``.
    """
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n = math.prod(shape)
    # ggml stores whole blocks per row: a row length that is no multiple of the block size is
    # no valid tensor, however many bytes (a block would straddle two rows).
    row_splits_block = bool(shape) and shape[-1] % block_size != 0
    if n % block_size or row_splits_block or data.size != n // block_size * type_size:
        raise ValueError(
            f"{ggml_type.name}: {data.size} bytes do not hold a tensor of shape {shape}"
        )
    blocks = data.reshape(-1, type_size)
    kernel = _KERNELS.get(ggml_type)
    if kernel is None:
        out = np.array(gguf.quants.dequantize(blocks, ggml_type), dtype=np.float32)
    else:
        out = kernel(blocks)
    return torch.from_numpy(out).reshape(shape)


def group_quant(
    raw: np.ndarray, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]
) -> GroupQuant | None:
    """The tensor's codes and per-block scales as stored (no float weights made), for the
    types a weight-only kernel runs as they are: Q4_0 and Q4_1 (4-bit codes ``q - 8``), Q8_0
    (8-bit codes); None for any other type. ``shape`` is ``(rows, inputs)`` in torch order."""
    if ggml_type not in (QT.Q4_0, QT.Q4_1, QT.Q8_0) or len(shape) != 2:
        return None
    data = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    rows, cols = shape
    if cols % block_size or data.size != rows * cols // block_size * type_size:
        raise ValueError(
            f"{ggml_type.name}: {data.size} bytes do not hold a tensor of shape {shape}"
        )
    blocks = data.reshape(-1, type_size)
    d = _f16_col(blocks, 0)
    offset: F32Array | None = None
    if ggml_type == QT.Q8_0:
        codes = blocks[:, 2:].view(np.int8)
        bits = 8
    elif ggml_type == QT.Q4_0:
        codes = (_nibbles(blocks, 2).astype(np.int16) - 8).astype(np.int8)
        bits = 4
    else:  # Q4_1: d * q + m = d * (q - 8) + (m + 8 d)
        codes = (_nibbles(blocks, 4).astype(np.int16) - 8).astype(np.int8)
        offset = _f16_col(blocks, 2) + np.float32(8.0) * d
        bits = 4
    groups = cols // block_size
    return GroupQuant(
        torch.from_numpy(np.ascontiguousarray(codes)).reshape(rows, cols),
        torch.from_numpy(d).reshape(rows, groups),
        None if offset is None else torch.from_numpy(offset).reshape(rows, groups),
        block_size,
        bits,
    )
