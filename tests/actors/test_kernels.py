"""The CPU fast paths against the plain torch ones: our paged decode kernel (C, built on first
use) against batched SDPA over gathered blocks, and oneDNN-packed GEMMs against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.model.attention import AttentionMetadata, TorchAttention
from actors.model.cpu_kernels import paged_decode_kernel
from actors.model.llama import pack_linear
from kv_transfer.blocks import allocate_kv_caches

needs_kernel = pytest.mark.skipif(paged_decode_kernel() is None, reason="no C compiler here")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (8, 2, 32), (16, 1, 64)]
)
def test_paged_decode_kernel_matches_sdpa(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    block_size, num_seqs = 16, 11
    lens = [1, 2, 15, 16, 17, 33, 64, 100, 129, 250, 7]
    num_blocks = sum(-(-n // block_size) for n in lens) + 5
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in lens]
    meta = AttentionMetadata.build([1] * num_seqs, lens, tables, block_size, torch.device("cpu"))
    q = torch.randn(num_seqs, heads * head_dim, generator=gen).to(dtype)
    k = torch.randn(num_seqs, kv_heads * head_dim, generator=gen).to(dtype)
    v = torch.randn(num_seqs, kv_heads * head_dim, generator=gen).to(dtype)
    fast = TorchAttention(heads, kv_heads, head_dim, block_size, use_cpu_kernel=True)
    slow = TorchAttention(heads, kv_heads, head_dim, block_size, use_cpu_kernel=False)
    assert fast.kernel is not None and slow.kernel is None
    kv_fast, kv_slow = kv.clone(), kv.clone()
    got = fast.forward(q, k, v, kv_fast, meta).float()
    ref = slow.forward(q, k, v, kv_slow, meta).float()
    assert torch.equal(kv_fast, kv_slow)  # both wrote this step's K/V to the same slots
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got - ref).abs().max().item() <= tol


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_first_cache_gives_the_same_attention(dtype: torch.dtype) -> None:
    """A layer's view of the block-first pool (a block stride of every layer's block) reads
    and writes exactly what a contiguous per-layer cache does, in the C kernel and the torch
    path, for decodes and a prefill chunk continuing a cached prefix."""
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 40
    contiguous = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    contiguous = contiguous.to(dtype)
    views = allocate_kv_caches(3, num_blocks, block_size, kv_heads, head_dim, dtype)
    views[1].copy_(contiguous)
    assert views[1].stride(1) == 3 * 2 * block_size * kv_heads * head_dim
    lens, query = [5, 40, 17, 70], [1, 1, 1, 22]  # three decodes, then a 22-token chunk
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in lens]
    meta = AttentionMetadata.build(query, lens, tables, block_size, torch.device("cpu"))
    t = sum(query)
    q = torch.randn(t, heads * head_dim, generator=gen).to(dtype)
    k = torch.randn(t, kv_heads * head_dim, generator=gen).to(dtype)
    v = torch.randn(t, kv_heads * head_dim, generator=gen).to(dtype)
    for use_kernel in (True, False):
        attn = TorchAttention(heads, kv_heads, head_dim, block_size, use_cpu_kernel=use_kernel)
        plain, snapshot = contiguous.clone(), views[1].clone()
        got = attn.forward(q, k, v, views[1], meta)  # the view: writes must land in the pool
        ref = attn.forward(q, k, v, plain, meta)
        assert torch.equal(got, ref)
        assert torch.equal(views[1], plain)  # this step's K/V went to the same slots
        assert torch.equal(views[0], torch.zeros_like(views[0]))  # other layers untouched
        views[1].copy_(snapshot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 64, 300])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(320, 96, generator=gen) * 0.1).to(dtype)
    b = torch.randn(320, generator=gen).to(dtype)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    packed = pack_linear(w, b, batch_hint=64)
    if packed is None:
        pytest.skip("oneDNN not available in this torch build")
    got, ref = packed(x).float(), F.linear(x, w, b).float()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= tol
