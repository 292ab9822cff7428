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

With bfloat16 activations on a CPU with AVX-512 BF16, both forms are held instead in the blocked
layout of our own kernels (``csrc/quant_gemm.c``: the same codes, scales and zeros, rows in
blocks of 16), which read them 1.3-2x faster than torch's at one to eight rows; torch's kernels
and layout serve float32 activations, other CPUs, int4 groups other than 32 and inputs that
are not a multiple of 32.

These kernels are vector-matrix kernels: they beat oneDNN's packed bf16 GEMM at a few rows (a
decode of a few requests: fewer bytes to read) and lose from about 8 rows on with torch's
kernels, 16 with ours (int4; our int8 from about 8). A ``QuantizedLinear`` can therefore keep a
dense packed copy for the larger batches (``dense_min_rows``); with ``dense_min_rows=0`` only
the quantized bytes are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from actors.model.quant_gemm import QuantGemm

Method = Literal["int8", "int4"]
METHODS: tuple[str, ...] = ("auto", "none", "int8", "int4")
INT4_GROUP = 32
BLOCK_ROWS = 16  # the blocked layout's rows per block (csrc/quant_gemm.c)


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
    """A ``[N, K]`` weight quantized for ``x @ w.T`` (``x``: float32 or bfloat16 rows).

    ``blocked``: ``q`` and ``scales`` are in the blocked layout of ``csrc/quant_gemm.c``
    (``pack_blocked_int4`` / ``pack_blocked_int8``) and ``kernel`` multiplies them; else they
    are in torch's layout for torch's kernels. A blocked weight copied into a process without
    the kernel (``TANDEM_QUANT_GEMM=0``, another CPU) is re-laid for torch's kernels there."""

    method: Method
    kernel: QuantGemm | None = None
    blocked = False

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
        self._gemm: Callable[[torch.Tensor], torch.Tensor] | None = None  # ``kernel`` bound

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_gemm"] = None  # a closure over this copy's pointers: bound again on first use
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        if self.blocked and self.kernel is None:  # no kernel here: torch's layout instead
            self._relay_for_torch()

    def _relay_for_torch(self) -> None:
        n, k = self.shape
        blocks = -(-n // BLOCK_ROWS)
        if self.method == "int8":
            u = self.q.view(blocks, k // 2, BLOCK_ROWS, 2).permute(0, 2, 1, 3).reshape(-1, k)
            self.q = (u[:n].to(torch.int16) - 128).to(torch.int8).contiguous()
            self.scales = self.scales[:n].contiguous()
        else:
            if n % 16:  # torch's int4 layout packs rows in sixteens
                raise RuntimeError(
                    f"an int4 weight of {n} rows needs the quantized kernel "
                    "(csrc/quant_gemm.c), which this process does not have"
                )
            groups = k // INT4_GROUP
            c = self.q.view(blocks, groups, 8, BLOCK_ROWS, 2).permute(0, 3, 1, 2, 4)
            codes = torch.cat([c & 15, c >> 4], dim=-1).reshape(blocks * BLOCK_ROWS, k)[:n]
            sz = self.scales.view(blocks, groups, 2, BLOCK_ROWS).permute(0, 3, 1, 2)
            sz = sz.reshape(blocks * BLOCK_ROWS, groups, 2)[:n].transpose(0, 1).contiguous()
            self.q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
            self.scales = sz  # [K // g, N, 2] (scale, zero), as torch's kernel wants them
        self.blocked = False

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
        gemm = self._gemm
        if gemm is not None:
            return gemm(x if x.stride(1) == 1 else x.contiguous())
        if self.blocked:  # first use, or a copy: bind this copy's bytes
            assert self.kernel is not None
            bits = 8 if self.method == "int8" else 4
            self._gemm = self.kernel.bind(bits, self.q, self.scales, self.shape)
            return self.matmul(x)
        if self.method == "int8":
            return torch._weight_int8pack_mm(x, self.q, self.scales)
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.q, self.group_size, self.scales
        )
        return out

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these bytes stand for (tests, the dense copy)."""
        k = self.shape[1]
        if self.blocked:
            return unpack_blocked(self)
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
            kernel = _blocked_kernel(dtype, k)
            if kernel is not None:
                weight = cls("int8", *pack_blocked_int8(q, scale, dtype), 0, (n, k), dtype)
                weight.kernel, weight.blocked = kernel, True
                return weight
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
        kernel = _blocked_kernel(dtype, k) if group_size == INT4_GROUP else None
        if kernel is not None:
            codes, blocked_sz = pack_blocked_int4(q, scale, zero, dtype)
            weight = cls("int4", codes, blocked_sz, group_size, (n, k), dtype)
            weight.kernel, weight.blocked = kernel, True
        else:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            # The kernel wants [K // g, N, 2] (scale, zero) in the activations' dtype.
            scales_and_zeros = torch.stack([scale.float(), zero.float()], dim=-1)
            scales_and_zeros = scales_and_zeros.transpose(0, 1).contiguous().to(dtype)
            weight = cls("int4", packed, scales_and_zeros, group_size, (n, k), dtype)
        # What the kernel computes with: scale and zero as rounded to ``dtype``.
        sz = torch.stack([scale.float(), zero.float()], dim=-1).to(dtype).float()  # [N, G, 2]
        codes = (q - 8).float().view(n, k // group_size, group_size)
        weight._dense = (codes * sz[..., :1] + sz[..., 1:]).view(n, k)
        return weight


def dense_crossover(weight: QuantizedWeight) -> int:
    """The step size (rows) from which the dense GEMM beats this weight's kernel, measured on
    the built-in model's shapes (``bench.model_kernels shapes``, 2 threads): 16 for int4 on our
    kernel (it stays ahead of oneDNN's bf16 GEMM to 16 rows), 8 for int8 (ours loses from
    there) and for torch's kernels."""
    return 16 if weight.blocked and weight.method == "int4" else 8


def _blocked_kernel(dtype: torch.dtype, k: int) -> QuantGemm | None:
    """Our kernels, where they run: bfloat16 activations, inputs a multiple of 32, AVX-512
    BF16 (``TANDEM_CPU_KERNELS=0`` turns them off with the others)."""
    if dtype != torch.bfloat16 or k % INT4_GROUP:
        return None
    from actors.model.quant_gemm import quant_gemm

    return quant_gemm()


def _padded_rows(t: torch.Tensor, blocks: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``blocks`` whole blocks."""
    missing = blocks * BLOCK_ROWS - t.shape[0]
    return F.pad(t, (0, 0, 0, missing) if t.dim() == 2 else (0, missing))


def pack_blocked_int4(
    q: torch.Tensor,  # [N, K] in 0..15
    scale: torch.Tensor,  # [N, K // 32]
    zero: torch.Tensor,  # [N, K // 32]
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and (scale, zero) pairs in ``csrc/quant_gemm.c``'s layout: per block of 16
    rows and group of 32 inputs, eight 32-byte chunks of four inputs (byte j: row j // 2, low
    nibble input j % 2, high nibble input 2 + j % 2), then 16 scales and 16 zeros."""
    n, k = q.shape
    groups, blocks = k // INT4_GROUP, -(-n // BLOCK_ROWS)
    codes = _padded_rows(q.to(torch.uint8), blocks).view(blocks, BLOCK_ROWS, groups, 8, 4)
    codes = codes[..., 0:2] | (codes[..., 2:4] << 4)  # [blocks, 16, groups, 8, 2]
    codes = codes.permute(0, 2, 3, 1, 4).contiguous().view(-1)

    def per_block(t: torch.Tensor) -> torch.Tensor:
        return _padded_rows(t.float(), blocks).view(blocks, BLOCK_ROWS, groups).transpose(1, 2)

    sz = torch.stack([per_block(scale), per_block(zero)], dim=2).to(dtype).contiguous()
    return codes, sz.view(-1)


def pack_blocked_int8(
    q: torch.Tensor,  # [N, K] int8
    scale: torch.Tensor,  # [N]
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit codes as ``q + 128`` in 32-byte chunks of two inputs (byte j: row j // 2, input
    j % 2) per block of 16 rows; one scale per row."""
    n, k = q.shape
    blocks = -(-n // BLOCK_ROWS)
    u = (_padded_rows(q.to(torch.int16), blocks) + 128).to(torch.uint8)
    codes = u.view(blocks, BLOCK_ROWS, k // 2, 2).permute(0, 2, 1, 3).contiguous().view(-1)
    return codes, _padded_rows(scale.float(), blocks).to(dtype).contiguous()


def unpack_blocked(weight: QuantizedWeight) -> torch.Tensor:
    """The float32 ``[N, K]`` weight that a blocked ``QuantizedWeight`` stands for."""
    n, k = weight.shape
    blocks = -(-n // BLOCK_ROWS)
    if weight.method == "int8":
        u = weight.q.view(blocks, k // 2, BLOCK_ROWS, 2).permute(0, 2, 1, 3).reshape(-1, k)
        codes = u[:n].to(torch.int16) - 128
        return codes.float() * weight.scales[:n].float()[:, None]
    groups = k // INT4_GROUP
    c = weight.q.view(blocks, groups, 8, BLOCK_ROWS, 2).permute(0, 3, 1, 2, 4)
    q = torch.cat([c & 15, c >> 4], dim=-1).reshape(blocks * BLOCK_ROWS, k)[:n]
    sz = weight.scales.view(blocks, groups, 2, BLOCK_ROWS).float()
    scale = sz[:, :, 0].transpose(1, 2).reshape(-1, groups)[:n]
    zero = sz[:, :, 1].transpose(1, 2).reshape(-1, groups)[:n]
    w = (q.float() - 8).view(n, groups, INT4_GROUP) * scale[..., None] + zero[..., None]
    return w.view(n, k)


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
