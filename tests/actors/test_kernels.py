"""The CPU fast paths against the plain torch ones: our paged decode kernel (C, built on first
use) against batched SDPA over gathered blocks, our fused element-wise kernels against the torch
ops they replace, and oneDNN-packed GEMMs against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.model.attention import PAGED_PREFILL_MAX_QUERY, AttentionMetadata, TorchAttention
from actors.model.cpu_kernels import fused_ops, paged_decode_kernel
from actors.model.linear import pack_linear
from actors.model.llama import RMSNorm
from actors.model.rope import RotaryEmbedding
from kv_transfer.blocks import allocate_kv_caches

needs_kernel = pytest.mark.skipif(paged_decode_kernel() is None, reason="no C compiler here")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 128), (8, 2, 32), (16, 1, 64)]
)
@pytest.mark.parametrize("block_size", [16, 5, 32])  # bf16: 16-key chunks cross blocks
def test_paged_decode_kernel_matches_sdpa(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    num_seqs = 11
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


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_chunks_continuing_a_prefix_read_the_paged_cache(dtype: torch.dtype) -> None:
    """Chunks of up to PAGED_PREFILL_MAX_QUERY tokens after a cached prefix run on the paged
    kernel, one decode row per query (causal within the chunk); longer ones and chunks from
    position 0 on SDPA. Every row equals the gather + SDPA path's."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    query = [1, 1, 3, PAGED_PREFILL_MAX_QUERY, PAGED_PREFILL_MAX_QUERY + 1, 20, 12]
    lens = [9, 70, 50, 100, 90, 20, 200]  # the 20-token chunk starts at 0
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in lens]
    meta = AttentionMetadata.build(query, lens, tables, block_size, torch.device("cpu"))
    paged = [span.paged is not None for span in meta.prefills]
    assert paged == [True, True, False, False, True]
    first, last = meta.prefills[0].paged, meta.prefills[-1].paged
    assert first is not None and first[1].tolist() == [48, 49, 50]  # causal: keys per query
    assert last is not None and last[0].shape == (12, -(-200 // block_size))
    t = sum(query)
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(t, heads * head_dim, generator=gen).to(dtype)
    k = torch.randn(t, kv_heads * head_dim, generator=gen).to(dtype)
    v = torch.randn(t, kv_heads * head_dim, generator=gen).to(dtype)
    fast = TorchAttention(heads, kv_heads, head_dim, block_size, use_cpu_kernel=True)
    slow = TorchAttention(heads, kv_heads, head_dim, block_size, use_cpu_kernel=False)
    got = fast.forward(q, k, v, kv.clone(), meta).float()
    ref = slow.forward(q, k, v, kv.clone(), meta).float()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got - ref).abs().max().item() <= tol


def _ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bfloat16 steps between two bf16 tensors of the same sign pattern."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    return (ia - ib).abs()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 200])  # 200 x 576 takes the threaded path
def test_fused_ops_equal_the_torch_ops(dtype: torch.dtype, rows: int) -> None:
    """Each fused kernel against the torch expression it replaces in the layer: bf16 results
    equal bit for bit but for rare steps (the norm's float32 sum order, our exp), and float32
    to rounding."""
    ops = fused_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(rows)
    hidden, inter, head_dim, heads = 576, 1536, 64, 12  # 9 q + 3 k heads rotate
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    r = torch.randn(rows, hidden, generator=gen).to(dtype)
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    got, got_sum = norm(x, r, ops)
    ref, ref_sum = norm(x, r, None)
    assert torch.equal(got_sum, ref_sum)  # the residual add rounds as torch's
    alone, _ = norm(x, None, ops)
    alone_ref, _ = norm(x, None, None)
    for a, b in ((got, ref), (alone, alone_ref)):
        if dtype == torch.bfloat16:  # a step in the normalised value can double on scaling
            ulps = _ulps_bf16(a, b)
            assert ulps.max().item() <= 2 and (ulps > 0).float().mean().item() < 0.01
        else:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)

    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype)
    qkv = torch.randn(rows, heads * head_dim + 3 * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 4096, (rows,), generator=gen)
    rotated = heads * head_dim
    expected = rope.rotate(qkv[:, :rotated], *rope.lookup(positions))
    tail = qkv[:, rotated:].clone()
    ops.rotary_(qkv, positions, rope.cos_table, rope.signed_sin_table, heads)
    assert torch.equal(qkv[:, :rotated], expected)  # the same roundings, in place
    assert torch.equal(qkv[:, rotated:], tail)  # v untouched

    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamped range
    gate, up = gate_up.split(inter, dim=-1)
    m, m_ref = ops.silu_mul(gate_up), F.silu(gate) * up
    # silu(-100) is about 4e-42: both sides are (next to) zero, not close in steps.
    tiny = m_ref.abs() < 1e-30
    assert m[tiny].abs().max().item() < 1e-30
    m, m_ref = m[~tiny], m_ref[~tiny]
    if dtype == torch.bfloat16:  # our exp is within 2 ulp of float32: rarely a bf16 step
        ulps = _ulps_bf16(m, m_ref)
        assert ulps.max().item() <= 1 and (ulps > 0).float().mean().item() < 0.01
    else:
        torch.testing.assert_close(m, m_ref, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_of_strided_rows_equals_index_put(dtype: torch.dtype) -> None:
    """K and V as slices of the fused qkv rows (a row stride) land in the same cache slots as
    through index_put_, in a layer's view of the block-first pool; nothing else changes."""
    ops = fused_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(3)
    kv_heads, head_dim, block_size, num_blocks, t = 3, 64, 16, 12, 21
    views = allocate_kv_caches(2, num_blocks, block_size, kv_heads, head_dim, dtype)
    qkv = torch.randn(t, (9 + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q_size, kv_size = 9 * head_dim, kv_heads * head_dim
    k, v = qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size :]
    assert k.stride(0) == qkv.shape[1]  # strided rows, as the layer hands them over
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t]
    blocks, offsets = slots // block_size, slots % block_size
    ref = views[1].clone()
    ref[0].index_put_((blocks, offsets), k.reshape(t, kv_heads, head_dim))
    ref[1].index_put_((blocks, offsets), v.reshape(t, kv_heads, head_dim))
    ops.kv_write(k, v, views[1][0], views[1][1], blocks, offsets)
    assert torch.equal(views[1], ref)
    assert torch.equal(views[0], torch.zeros_like(views[0]))  # the other layer untouched
    with pytest.raises(ValueError, match="int64"):
        ops.kv_write(k, v, views[1][0], views[1][1], blocks.int(), offsets.int())


@needs_kernel
def test_a_strided_input_hands_back_a_packed_residual() -> None:
    """A pipeline stage's first norm may get rows with a stride: the residual it returns is
    read packed by the next norm, so it is a contiguous copy (the bug: the next layer read the
    wrong rows)."""
    ops = fused_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(6, 128, generator=gen)
    x, w = big[:, :64], torch.rand(64, generator=gen) + 0.5
    normed, residual = ops.add_rms_norm(x, None, w, 1e-5)
    assert residual.is_contiguous() and torch.equal(residual, x)
    torch.testing.assert_close(normed, F.rms_norm(x, (64,), w, 1e-5))
    o = torch.randn(6, 64, generator=gen)
    normed2, summed = ops.add_rms_norm(o, residual, w, 1e-5)
    torch.testing.assert_close(summed, o + x.contiguous())
    torch.testing.assert_close(normed2, F.rms_norm(o + x, (64,), w, 1e-5))


def test_the_kernels_copy_as_this_process_s_own() -> None:
    """A model holding the ctypes kernels deep-copies and pickles (as the kernels themselves)."""
    import copy
    import pickle

    ops = fused_ops()
    kernel = paged_decode_kernel()
    assert copy.deepcopy(ops) is ops and pickle.loads(pickle.dumps(ops)) is ops
    assert copy.deepcopy(kernel) is kernel


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_in_one_call_equals_the_separate_kernels(dtype: torch.dtype) -> None:
    """``decode_fused`` (rotary + cache write + paged attention in one C call) gives the same
    bits as ``rotary_`` then ``forward``: the attention output, the rotated rows, the cache. It
    declines a step with a prefill row."""
    ops = fused_ops()
    assert ops is not None
    gen = torch.Generator().manual_seed(13)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    lens = [1, 5, 16, 17, 40, 130, 250]
    num_blocks = sum(-(-n // block_size) for n in lens) + 4
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in lens]
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size, torch.device("cpu"))
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([n - 1 for n in lens])
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype)
    attn = TorchAttention(heads, kv_heads, head_dim, block_size, use_cpu_kernel=True)
    tables_ = (rope.cos_table, rope.signed_sin_table)

    rows_a, kv_a = qkv.clone(), kv.clone()
    got = attn.decode_fused(rows_a, positions, tables_, kv_a, meta)
    assert got is not None
    rows_b, kv_b = qkv.clone(), kv.clone()
    ops.rotary_(rows_b, positions, *tables_, heads + kv_heads)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    ref = attn.forward(
        rows_b[:, :q_size],
        rows_b[:, q_size : q_size + kv_size],
        rows_b[:, q_size + kv_size :],
        kv_b,
        meta,
    )
    assert torch.equal(got, ref) and torch.equal(rows_a, rows_b) and torch.equal(kv_a, kv_b)

    mixed = AttentionMetadata.build([1, 3], lens[:2], tables[:2], block_size, torch.device("cpu"))
    assert attn.decode_fused(qkv[:4].clone(), positions[:4], tables_, kv.clone(), mixed) is None
