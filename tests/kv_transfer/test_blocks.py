"""Moving KV blocks between paged caches: the data lands where the decode side's table says,
layer ranges compose, and a mismatch is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from kv_transfer.blocks import extract_blocks, insert_blocks


def caches(num_layers: int, num_blocks: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, 4, 2, 8, generator=gen).to(dtype) for _ in range(num_layers)]


def _assert_moved(
    src: list[torch.Tensor],
    dst: list[torch.Tensor],
    before: list[torch.Tensor],
    src_ids: list[int],
    dst_ids: list[int],
) -> None:
    """Every layer's block ``src_ids[i]`` landed in ``dst_ids[i]``; no other block of ``dst``
    changed from ``before``."""
    for layer, (got, want, old) in enumerate(zip(dst, src, before, strict=True)):
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(got[:, d], want[:, s]), f"layer {layer}: block {s} -> {d}"
        untouched = [b for b in range(got.shape[1]) if b not in dst_ids]
        assert torch.equal(got[:, untouched], old[:, untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_into_other_block_ids(dtype: torch.dtype) -> None:
    src, dst = caches(3, 10, dtype, 0), caches(3, 12, dtype, 1)
    before = [c.clone() for c in dst]
    src_ids, dst_ids = [7, 2, 5], [0, 11, 3]
    insert_blocks(dst, dst_ids, extract_blocks(src, src_ids))
    _assert_moved(src, dst, before, src_ids, dst_ids)


def test_layer_ranges_compose_like_pipeline_stages() -> None:
    src, dst = caches(4, 6, torch.float32, 2), caches(4, 6, torch.float32, 3)
    ids = [1, 4]
    for stage in (range(0, 2), range(2, 4)):  # two stages, each with its own layers
        insert_blocks(dst, [0, 5], extract_blocks(src, ids, stage), stage)
    for layer in range(4):
        assert torch.equal(dst[layer][:, [0, 5]], src[layer][:, ids])


def test_mismatches_are_refused_before_writing() -> None:
    src, dst = caches(2, 6, torch.float32, 4), caches(2, 6, torch.float32, 5)
    before = [c.clone() for c in dst]
    data = extract_blocks(src, [1, 2])
    with pytest.raises(ValueError, match="expected"):
        insert_blocks(dst, [1, 2, 3], data)
    with pytest.raises(ValueError, match=r"is torch\.float32, the cache is torch\.float16"):
        insert_blocks(caches(2, 6, torch.float16, 6), [1, 2], data)
    with pytest.raises(ValueError, match="not within"):
        extract_blocks(src, [1], range(1, 3))
    assert all(torch.equal(a, b) for a, b in zip(dst, before, strict=True))


# -- KVPayload: pieces per run of consecutive blocks, gathered as views ------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("src_ids", "first", "dst_ids"),
    [
        ([3, 4, 5, 6], 0, [0, 1, 2, 3]),  # one run to one run
        ([7, 8, 9, 2, 5, 6], 0, [11, 0, 1, 2, 9, 4]),  # runs [3, 1, 2] to runs [1, 3, 1, 1]
        ([7, 8, 9, 2, 5, 6], 2, [10, 11, 3, 4]),  # a tail that starts inside the first run
        ([7, 8, 9, 2, 5, 6], 3, [0, 1]),  # a tail that starts on a run boundary
        ([9, 8, 7, 6], 0, [5, 4, 3, 2]),  # descending to descending: one slice each
        ([9, 8, 7, 6], 1, [0, 1, 2]),  # descending to ascending (reversed copies)
        ([1, 2, 3, 11, 10, 9, 0], 2, [8, 7, 6, 5, 4]),  # mixed runs, a tail, mixed directions
        ([4, 3, 5, 6], 0, [11, 10, 0, 1]),  # a descending pair then an ascending pair
    ],
)
def test_gather_scatter_round_trip(
    dtype: torch.dtype, src_ids: list[int], first: int, dst_ids: list[int]
) -> None:
    from kv_transfer.blocks import gather_blocks, scatter_blocks

    src, dst = caches(3, 12, dtype, 7), caches(3, 12, dtype, 8)
    before = [c.clone() for c in dst]
    payload = gather_blocks(src, src_ids).copy()
    assert payload.num_blocks == len(src_ids)
    written = scatter_blocks(dst, dst_ids, payload, first)
    moved = src_ids[first : first + len(dst_ids)]
    assert written == 3 * 2 * len(dst_ids) * src[0][0, 0].numel() * src[0].element_size()
    _assert_moved(src, dst, before, moved, dst_ids)


def test_gathered_pieces_are_views_until_copied() -> None:
    from kv_transfer.blocks import gather_blocks

    src = caches(2, 6, torch.float32, 9)
    views = gather_blocks(src, [1, 2, 4])
    assert views.runs == [2, 1] and len(views.pieces) == 2 * 2 * 2
    backwards = gather_blocks(src, [5, 4, 3, 1, 0])
    assert backwards.runs == [3, 2] and backwards.descending == [True, True]
    assert len(backwards.pieces) == 2 * 2 * 2  # one piece per run, not per block
    owned = views.copy()
    src[0][0, 1].fill_(123.0)  # the cache changes after the gather
    assert (views.piece(0, 0, 0)[0] == 123.0).all()
    assert not (owned.piece(0, 0, 0)[0] == 123.0).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_first_caches_gather_one_contiguous_span_per_run(dtype: torch.dtype) -> None:
    """From the workers' block-first cache a run of blocks is one span of every layer: the
    payload pickles (protocol 5, as ``ray.put``) as one out-of-band buffer per run, not as
    copies of strided pieces, and lands bit for bit."""
    import pickle

    from kv_transfer.blocks import allocate_kv_caches, gather_blocks, scatter_blocks

    gen = torch.Generator().manual_seed(4)
    src = allocate_kv_caches(3, 8, 4, 2, 8, dtype)
    dst = allocate_kv_caches(3, 10, 4, 2, 8, dtype)
    for cache in src:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    src_ids, dst_ids = [2, 3, 4, 7, 6], [9, 0, 1, 5, 4]
    payload = gather_blocks(src, src_ids)
    assert payload.spans is not None and [s.shape[0] for s in payload.spans] == [3, 2]
    assert all(s.flags["C_CONTIGUOUS"] for s in payload.spans)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(payload, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 2 and len(data) < 2048  # the bytes travel out of band
    arrived = pickle.loads(data, buffers=buffers)
    assert len(arrived.pieces) == 3 * 2 * 2
    before = [c.clone() for c in dst]
    scatter_blocks(dst, dst_ids, arrived)
    _assert_moved(src, dst, before, src_ids, dst_ids)
    # A pipeline stage's layer range (not the whole pool) gathers per-layer pieces.
    assert gather_blocks(src, src_ids, range(1, 3)).spans is None


def test_scatter_refuses_mismatches_before_writing() -> None:
    from kv_transfer.blocks import gather_blocks, scatter_blocks

    src, dst = caches(2, 6, torch.float32, 10), caches(2, 6, torch.float32, 11)
    before = [c.clone() for c in dst]
    payload = gather_blocks(src, [1, 2]).copy()
    with pytest.raises(ValueError, match="holds 2 blocks"):
        scatter_blocks(dst, [0, 3], payload, first_block=1)
    with pytest.raises(ValueError, match="layers"):
        scatter_blocks(dst, [0], payload, layers=range(0, 1))
    with pytest.raises(ValueError, match="bfloat16"):
        scatter_blocks(caches(2, 6, torch.bfloat16, 12), [0, 1], payload)
    with pytest.raises(ValueError, match="float16"):
        scatter_blocks(caches(2, 6, torch.float16, 12), [0, 1], payload)
    wider = [torch.zeros(2, 6, 4, 3, 8) for _ in range(2)]
    with pytest.raises(ValueError, match="block shape"):
        scatter_blocks(wider, [0, 1], payload)
    for layer in range(2):
        assert torch.equal(dst[layer], before[layer])
