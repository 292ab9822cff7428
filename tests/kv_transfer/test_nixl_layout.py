"""How the ``nixl`` transport's reads become descriptors (``kv_transfer.nixl_layout``: plain
numpy and Python, no NIXL): a pool's layout, slabs merged into runs, and the block-first
pool's one span per block."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_transfer.blocks import allocate_kv_caches
from kv_transfer.nixl_layout import PoolLayout, merge_descriptors, merge_spans

BLOCK, KV_HEADS, HEAD_DIM = 4, 2, 8


def test_merge_descriptors_joins_runs_contiguous_on_both_sides() -> None:
    slab = 100
    src = np.array([1000, 1100, 1200, 5000, 700, 600], dtype=np.uint64)
    dst = np.array([0, 100, 900, 1000, 2000, 1900], dtype=np.uint64)
    local, remote = merge_descriptors(src, dst, slab)
    columns = (remote[:, 0].tolist(), local[:, 0].tolist(), local[:, 1].tolist())
    pairs = sorted(zip(*columns, strict=True))
    # 600->1900, 700->2000: both count up: one; 1000->0, 1100->100: one; 1200->900 breaks
    # the destination; 5000 stands alone.
    assert pairs == [(600, 1900, 200), (1000, 0, 200), (1200, 900, 100), (5000, 1000, 100)]
    assert (local[:, 1] == remote[:, 1]).all()


@pytest.mark.parametrize("seed", range(6))
def test_merge_spans_matches_merge_descriptors(seed: int) -> None:
    """The plain-Python merge of a read's block spans gives numpy's descriptors (as sets:
    runs, bytes, devices), on random tables with adjacent runs on one side, both or neither."""
    rng = np.random.default_rng(seed)
    n, span = int(rng.integers(1, 40)), 96
    src = rng.permutation(64)[:n] if seed % 2 else np.sort(rng.permutation(64)[:n])
    dst = np.arange(n) + 3 if seed % 3 else rng.permutation(64)[:n]
    src_addr, dst_addr = (1 << 20) + src * span, (1 << 30) + dst * span
    expected = merge_descriptors(src_addr.astype(np.uint64), dst_addr.astype(np.uint64), span, 1, 2)
    got = merge_spans(src_addr.tolist(), dst_addr.tolist(), span, 1, 2)

    def rows(local: np.ndarray, remote: np.ndarray) -> set[tuple[int, ...]]:
        return {(*a, *b) for a, b in zip(local.tolist(), remote.tolist(), strict=True)}

    assert rows(*got) == rows(*expected)
    assert int(got[0][:, 1].sum()) == n * span  # every byte once


def test_block_first_pools_read_one_span_per_block() -> None:
    caches = allocate_kv_caches(3, 5, BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
    layout = PoolLayout.of(caches, range(3))
    slab = BLOCK * KV_HEADS * HEAD_DIM * 4
    assert layout.span(range(3)) == layout.block_stride == 6 * slab
    assert layout.span(range(1, 3)) == 4 * slab  # a pipeline stage's range: part of a block
    base = caches[0].data_ptr()
    assert layout.block_addresses([4, 0], range(1, 3)) == [
        base + 24 * slab + 2 * slab,
        base + 2 * slab,
    ]
    per_layer = [torch.zeros(2, 5, BLOCK, KV_HEADS, HEAD_DIM) for _ in range(3)]
    assert PoolLayout.of(per_layer, range(3)).span(range(3)) is None  # K and V 5 slabs apart


def test_the_layout_reads_the_block_first_strides() -> None:
    caches = allocate_kv_caches(3, 5, BLOCK, KV_HEADS, HEAD_DIM, torch.float32)
    layout = PoolLayout.of(caches, range(2, 5))
    slab = BLOCK * KV_HEADS * HEAD_DIM * 4
    assert layout.slab == slab and layout.block_stride == 3 * 2 * slab
    base = caches[0].data_ptr()
    assert layout.bases[1] == (base + 2 * slab, base + 3 * slab)
    addrs = layout.addresses(np.array([4]), range(3, 5))
    assert addrs.tolist() == [base + 4 * 6 * slab + k * slab for k in (2, 3, 4, 5)]
