"""Paged attention over a mixed batch of prefill chunks and decodes.

KV cache layout, per layer (the layout `vllm-flash-attn` reads, so both backends share it)::

    kv_cache[layer] : [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V)

The layer tensors are views of one block-first buffer (``kv_transfer.blocks.
allocate_kv_caches``): a block's rows are contiguous, but one block of a layer is a whole
block of every layer away from the next (``stride(1)``), so nothing here flattens the block
and position dimensions together; new K/V go in by (block, offset) pairs.

    token at position p of a request with block table [b0, b1, b2, ...]
      -> block  = table[p // block_size]
      -> slot   = block * block_size + p % block_size      (the "slot mapping")

The batch is flattened (no padding to the longest): requests are laid out one after another,
decodes first (one query token each), then prefill chunks. Every layer first writes the K/V of
all the batch's tokens through the slot mapping, then attends. Writing first matters: a request
may hit prefix blocks that another request of the same step is computing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from actors.model.cpu_kernels import FusedOps, PagedDecodeKernel, fused_ops, paged_decode_kernel

logger = logging.getLogger(__name__)

# Prefill chunks of up to this many tokens that continue a cached prefix run on the paged decode
# kernel, one row per query. Against gathering the prefix for SDPA (bf16, SmolLM2's heads, 256
# to 2k tokens of context): 1.8-2.3x faster at 4 tokens, 1.2-1.5x at 16, even at 64.
PAGED_PREFILL_MAX_QUERY = 32


@dataclass
class PrefillSpan:
    """One prefill chunk: ``num_query`` tokens at positions [ctx_len - num_query, ctx_len)."""

    token_start: int  # index of the chunk's first token in the flattened batch
    num_query: int
    ctx_len: int  # keys attended (cached prefix + this chunk)
    block_table: torch.Tensor  # [ceil(ctx_len / block_size)] block ids (CPU backend)
    mask: torch.Tensor | None  # [num_query, ctx_len] bool, None when the chunk starts at 0
    # A short chunk continuing a cached prefix, as decode rows for the paged kernel: each
    # query's block table [num_query, blocks] and keys attended [num_query] (else None).
    paged: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer. Built once by the worker (see ``build``)."""

    slot_mapping: torch.Tensor  # [num_tokens] long
    slot_blocks: torch.Tensor  # [num_tokens] long: slot_mapping // block_size
    slot_offsets: torch.Tensor  # [num_tokens] long: slot_mapping % block_size
    num_decodes: int  # tokens [0, num_decodes) are single-token decodes
    decode_block_table: torch.Tensor  # [num_decodes, max_blocks] long (padded with block 0)
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] bool
    decode_seq_lens: torch.Tensor  # [num_decodes] long: keys each decode attends
    prefills: list[PrefillSpan] = field(default_factory=list)
    # Flash-attention (CUDA) view of the same batch: all requests, decodes included.
    query_start_loc: torch.Tensor | None = None  # [num_reqs + 1] int32
    seq_lens: torch.Tensor | None = None  # [num_reqs] int32
    block_table: torch.Tensor | None = None  # [num_reqs, max_blocks] int32
    max_query_len: int = 0
    max_seq_len: int = 0

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        ctx_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
        with_flash: bool = False,
    ) -> AttentionMetadata:
        """From per-request query lengths, context lengths (keys attended, this step's tokens
        included) and block tables. Requests with ``query_len == 1`` must come first."""
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
        # Slot mapping for every new token.
        slots: list[int] = []
        for q_len, ctx, table in zip(query_lens, ctx_lens, block_tables, strict=True):
            for pos in range(ctx - q_len, ctx):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        slot_blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
        slot_offsets = slot_mapping - slot_blocks * block_size

        max_blocks = max((len(t) for t in block_tables[:num_decodes]), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables[:num_decodes]]
        decode_table = torch.tensor(padded, dtype=torch.long, device=device).view(
            num_decodes, max_blocks
        )
        lens = torch.tensor(ctx_lens[:num_decodes], dtype=torch.long, device=device)
        key_pos = torch.arange(max_blocks * block_size, device=device)
        decode_mask = (key_pos[None, :] < lens[:, None]).view(num_decodes, 1, 1, key_pos.numel())

        prefills = []
        start = num_decodes
        for i in range(num_decodes, len(query_lens)):
            q_len, ctx = query_lens[i], ctx_lens[i]
            num_ctx_blocks = -(-ctx // block_size)
            ids = block_tables[i][:num_ctx_blocks]
            ctx_table = torch.tensor(ids, dtype=torch.long, device=device)
            mask = paged = None
            if ctx != q_len:  # a prefix is already cached: causal with an offset
                q_pos = torch.arange(ctx - q_len, ctx, device=device)
                mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]
                if q_len <= PAGED_PREFILL_MAX_QUERY and device.type == "cpu":
                    paged = (ctx_table.expand(q_len, -1).contiguous(), q_pos + 1)
            prefills.append(PrefillSpan(start, q_len, ctx, ctx_table, mask, paged))
            start += q_len

        meta = cls(
            slot_mapping,
            slot_blocks,
            slot_offsets,
            num_decodes,
            decode_table,
            decode_mask,
            lens,
            prefills,
        )
        if with_flash:
            cum = [0]
            for q_len in query_lens:
                cum.append(cum[-1] + q_len)
            width = max((len(t) for t in block_tables), default=0)
            meta.query_start_loc = torch.tensor(cum, dtype=torch.int32, device=device)
            meta.seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
            meta.block_table = torch.tensor(
                [t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32, device=device
            )
            meta.max_query_len = max(query_lens, default=0)
            meta.max_seq_len = max(ctx_lens, default=0)
        return meta


class TorchAttention:
    """CPU (and fallback) backend: one SDPA per prefill chunk; decodes go to our C kernel
    reading the paged cache in place (``cpu_kernels``) when it is available, else to one
    batched SDPA over gathered blocks."""

    name = "torch-sdpa"
    needs_flash_metadata = False

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        use_cpu_kernel: bool = True,
    ) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        self.scale = head_dim**-0.5
        self.kernel: PagedDecodeKernel | None = None
        self.ops: FusedOps | None = None
        if use_cpu_kernel:
            self.kernel = paged_decode_kernel()
            self.ops = fused_ops()
            if self.kernel is not None:
                self.name = "torch-sdpa+cpu-paged-decode"

    def decode_fused(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 KV) * D], not yet rotated
        positions: torch.Tensor,  # [T] int64
        rotary_tables: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor | None:
        """A step of decodes only, on CPU with our kernels: rotary, the cache write and the
        attention in one C call (``FusedOps.decode_attention``). None when it does not apply
        (prefill rows, no kernels, an unsupported head shape): the caller takes the separate
        steps (``rotary_`` and ``forward``)."""
        ops, kernel = self.ops, self.kernel
        if (
            ops is None
            or kernel is None
            or meta.num_decodes != qkv.shape[0]
            or not qkv.is_cpu
            or qkv.dtype not in FusedOps.dtypes
            or not kernel.supports(qkv.dtype, self.num_heads, self.num_kv_heads, self.head_dim)
        ):
            return None
        return ops.decode_attention(
            qkv,
            positions,
            rotary_tables,
            kv_cache[0],
            kv_cache[1],
            (meta.slot_blocks, meta.slot_offsets),
            meta.decode_block_table,
            meta.decode_seq_lens,
            self.num_heads,
            self.scale,
        )

    def forward(
        self,
        q: torch.Tensor,  # [T, H * D]
        k: torch.Tensor,  # [T, KV * D]: rows may be strided (slices of the fused qkv)
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KV, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = q.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        # 1. Write every new token's K/V first (same-step prefix sharing reads them).
        written = self.ops is not None and q.device.type == "cpu" and k.dtype in FusedOps.dtypes
        if written:
            assert self.ops is not None
            self.ops.kv_write(k, v, k_cache, v_cache, meta.slot_blocks, meta.slot_offsets)
        k = k.view(t, kvh, d)
        v = v.view(t, kvh, d)
        if not written:
            slots = (meta.slot_blocks, meta.slot_offsets)
            k_cache.index_put_(slots, k)
            v_cache.index_put_(slots, v)
        out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
        q3 = q.view(t, h, d)
        # 2. Decodes: our kernel reads the paged cache in place; without it, gather each
        # request's blocks (index_select is several times faster than advanced indexing) and
        # attend with a padding mask.
        n = meta.num_decodes
        kernel = self.kernel
        use_kernel = (
            kernel is not None and q.device.type == "cpu" and kernel.supports(q.dtype, h, kvh, d)
        )
        if n and use_kernel:
            assert kernel is not None
            kernel(
                q3[:n],  # (rows of the fused qkv: the kernel takes their stride)
                k_cache,
                v_cache,
                meta.decode_block_table,
                meta.decode_seq_lens,
                out[:n],
                self.scale,
            )
        elif n:
            width = meta.decode_block_table.shape[1]
            flat_ids = meta.decode_block_table.view(-1)
            kd = k_cache.flatten(1).index_select(0, flat_ids)
            vd = v_cache.flatten(1).index_select(0, flat_ids)
            kd = kd.view(n, width * self.block_size, kvh, d).transpose(1, 2)
            vd = vd.view(n, width * self.block_size, kvh, d).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q3[:n].unsqueeze(2),
                kd,
                vd,
                attn_mask=meta.decode_mask,
                scale=self.scale,
                enable_gqa=kvh != h,
            )
            out[:n] = o.squeeze(2)
        # 3. Prefill chunks, one at a time (few per step; no padding between them).
        for span in meta.prefills:
            s, e = span.token_start, span.token_start + span.num_query
            if span.paged is not None and use_kernel:
                # A short continuation of a cached prefix: each query is a decode row reading
                # the paged cache in place (no gather copy of the prefix).
                assert kernel is not None
                kernel(q3[s:e], k_cache, v_cache, *span.paged, out[s:e], self.scale)
                continue
            qs = q3[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            if span.mask is None:  # the chunk is the whole context: use this step's K/V
                ks, vs = k[s:e], v[s:e]
            else:
                ks = k_cache.index_select(0, span.block_table).view(-1, kvh, d)[: span.ctx_len]
                vs = v_cache.index_select(0, span.block_table).view(-1, kvh, d)[: span.ctx_len]
            o = F.scaled_dot_product_attention(
                qs,
                ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0),
                attn_mask=span.mask,
                is_causal=span.mask is None,
                scale=self.scale,
                enable_gqa=kvh != h,
            )
            out[s:e] = o.squeeze(0).transpose(0, 1)
        return out.view(t, h * d)


class FlashAttention:
    """CUDA backend: `vllm-flash-attn`'s varlen kernel reading the paged cache directly."""

    name = "vllm-flash-attn"
    needs_flash_metadata = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        from vllm_flash_attn import flash_attn_varlen_func  # CUDA-only; imported lazily

        self._fn = flash_attn_varlen_func
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        t = q.shape[0]
        kvh, d = self.num_kv_heads, self.head_dim
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        slots = (meta.slot_blocks, meta.slot_offsets)
        k_cache.index_put_(slots, k.view(t, kvh, d))
        v_cache.index_put_(slots, v.view(t, kvh, d))
        out = self._fn(
            q=q.view(t, self.num_heads, d),
            k=k_cache,
            v=v_cache,
            max_seqlen_q=meta.max_query_len,
            cu_seqlens_q=meta.query_start_loc,
            max_seqlen_k=meta.max_seq_len,
            seqused_k=meta.seq_lens,
            softmax_scale=self.scale,
            causal=True,
            block_table=meta.block_table,
        )
        result: torch.Tensor = out.reshape(t, self.num_heads * d)
        return result


AttentionBackend = TorchAttention | FlashAttention


def select_backend(
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    requested: str | None = None,
) -> AttentionBackend:
    """``vllm-flash-attn`` on CUDA when installed (fp16/bf16, block_size % 16 == 0), else torch.
    ``requested`` ("torch" / "flash") overrides; asking for flash where it cannot run raises."""
    args = (num_heads, num_kv_heads, head_dim, block_size)
    want_flash = requested == "flash" or (
        requested in (None, "auto")
        and device.type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and block_size % 16 == 0
    )
    if requested not in (None, "auto", "torch", "flash"):
        raise ValueError(f"attention_backend must be auto, torch or flash, not {requested!r}")
    backend: AttentionBackend
    if want_flash:
        try:
            backend = FlashAttention(*args)
        except Exception as exc:  # ImportError, missing libcudart, ABI mismatch...
            if requested == "flash":
                raise RuntimeError(f"vllm-flash-attn requested but unusable: {exc}") from exc
            logger.warning("vllm-flash-attn unusable (%s); falling back to torch SDPA", exc)
            backend = TorchAttention(*args, use_cpu_kernel=device.type == "cpu")
    else:
        backend = TorchAttention(*args, use_cpu_kernel=device.type == "cpu")
    logger.info("attention backend: %s on %s (%s)", backend.name, device, dtype)
    return backend
