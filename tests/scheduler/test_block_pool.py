"""BlockPool: free-queue order (head reuse, LRU tail), ref counts, the hash map with
duplicates, prefix-cache reset, usage, and ``check_integrity`` on good and corrupted pools."""

from __future__ import annotations

import pytest

from scheduler import BlockPool, KVCacheBlock


def h(n: int) -> bytes:
    return n.to_bytes(32, "big")


def free_ids(pool: BlockPool) -> list[int]:
    """Free queue from head (reused first) to tail (evicted last)."""
    return [b.block_id for b in pool.free_queue]


def take(pool: BlockPool, n: int, hashes: list[int] | None = None) -> list[KVCacheBlock]:
    """Allocate ``n`` blocks and hash the first ``len(hashes)`` of them."""
    blocks = pool.get_new_blocks(n)
    keys = hashes or []
    for block, key in zip(blocks[: len(keys)], keys, strict=True):
        pool.cache_block(block, h(key))
    return blocks


def assert_all_free(pool: BlockPool) -> None:
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_new_pool_is_all_free_in_id_order() -> None:
    pool = BlockPool(6, enable_caching=True)
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]
    assert pool.usage == 0.0
    assert not pool.cached
    assert_all_free(pool)


@pytest.mark.parametrize("n", [0, -1])
def test_pool_needs_a_block(n: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(n, enable_caching=True)


def test_get_new_blocks_pops_head_with_ref_one() -> None:
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [0, 1]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert all(b.prev_free is None and b.next_free is None for b in blocks)
    assert free_ids(pool) == [2, 3, 4, 5]
    assert pool.get_new_blocks(0) == []
    pool.check_integrity()
    pool.free_blocks(reversed(blocks))
    assert_all_free(pool)


def test_get_new_blocks_too_many_changes_nothing() -> None:
    pool = BlockPool(4, enable_caching=True)
    held = take(pool, 3)
    with pytest.raises(ValueError, match="2 blocks with 1 free"):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [3]
    pool.check_integrity()
    pool.free_blocks(held)
    assert_all_free(pool)


def test_get_new_blocks_evicts_hash_of_reused_block() -> None:
    pool = BlockPool(3, enable_caching=True)
    blocks = take(pool, 3, hashes=[10, 11, 12])
    pool.free_blocks(reversed(blocks))
    assert pool.get_cached_block(h(12)) is blocks[2]
    # Freed tail-first: [2, 1, 0]; the head (block 2) is reused and loses its hash.
    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[2]
    assert reused.block_hash is None
    assert pool.get_cached_block(h(12)) is None
    assert pool.get_cached_block(h(11)) is blocks[1]
    assert set(pool.cached) == {h(10), h(11)}
    pool.check_integrity()
    pool.free_blocks([reused])
    assert_all_free(pool)


def test_free_hashed_to_tail_unhashed_to_head() -> None:
    pool = BlockPool(8, enable_caching=True)
    blocks = take(pool, 4)
    pool.cache_block(blocks[1], h(1))
    pool.cache_block(blocks[2], h(2))
    pool.free_blocks(reversed(blocks))  # 3 (head), 2 (tail), 1 (tail), 0 (head)
    assert free_ids(pool) == [0, 3, 4, 5, 6, 7, 2, 1]
    assert_all_free(pool)
    # Unhashed blocks are reused before any cached block is evicted.
    reused = pool.get_new_blocks(6)
    assert [b.block_id for b in reused] == [0, 3, 4, 5, 6, 7]
    assert pool.get_cached_block(h(1)) is blocks[1]
    assert pool.get_cached_block(h(2)) is blocks[2]
    pool.free_blocks(reused)
    assert_all_free(pool)


def test_tail_first_free_evicts_last_block_before_prefix() -> None:
    pool = BlockPool(6, enable_caching=True)
    prefix = take(pool, 3, hashes=[1, 2, 3])  # one request's chain
    other = take(pool, 3)
    pool.free_blocks(reversed(prefix))
    # Free queue: [3rd block, 2nd block, 1st block] -- the last block is next in line.
    assert free_ids(pool) == [2, 1, 0]
    (victim,) = pool.get_new_blocks(1)
    assert victim is prefix[2]
    assert pool.get_cached_block(h(3)) is None
    assert pool.get_cached_block(h(1)) is prefix[0]
    assert pool.get_cached_block(h(2)) is prefix[1]
    pool.free_blocks([victim, *other])
    assert_all_free(pool)


def test_free_lru_order_across_frees() -> None:
    pool = BlockPool(4, enable_caching=True)
    a = take(pool, 2, hashes=[1, 2])
    b = take(pool, 2, hashes=[3, 4])
    pool.free_blocks(reversed(b))  # freed first: evicted first
    pool.free_blocks(reversed(a))
    assert free_ids(pool) == [3, 2, 1, 0]
    assert_all_free(pool)


def test_shared_block_returns_to_queue_only_at_last_reference() -> None:
    pool = BlockPool(4, enable_caching=True)
    (block,) = take(pool, 1, hashes=[7])
    pool.touch([block])  # a second request hits it
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert 0 not in free_ids(pool)
    pool.check_integrity()
    pool.free_blocks([block])
    assert free_ids(pool)[-1] == 0
    assert_all_free(pool)


def test_touch_revives_free_block() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = take(pool, 2, hashes=[1, 2])
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 4
    hit = pool.get_cached_block(h(1))
    assert hit is blocks[0]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert hit.prev_free is None and hit.next_free is None
    assert free_ids(pool) == [2, 3, 1]
    assert pool.num_free_blocks == 3
    assert hit.block_hash == h(1)  # reviving keeps the hash
    pool.check_integrity()
    pool.touch([hit])
    assert hit.ref_cnt == 2
    assert pool.num_free_blocks == 3
    pool.free_blocks([hit, hit])
    assert_all_free(pool)


def test_cache_block_keeps_first_hash() -> None:
    pool = BlockPool(2, enable_caching=True)
    (block,) = take(pool, 1, hashes=[1])
    pool.cache_block(block, h(2))
    assert block.block_hash == h(1)
    assert pool.get_cached_block(h(2)) is None
    pool.free_blocks([block])
    assert_all_free(pool)


def test_duplicates_under_one_hash() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b = take(pool, 2, hashes=[5, 5])
    assert set(pool.cached[h(5)]) == {0, 1}
    assert pool.get_cached_block(h(5)) in (a, b)
    pool.check_integrity()
    pool.free_blocks([a])  # tail
    pool.free_blocks([b])  # tail, behind a
    # Evict a: b still holds the content and is still findable.
    rest = pool.get_new_blocks(3)
    assert [x.block_id for x in rest] == [2, 3, 0]
    assert a.block_hash is None
    assert pool.get_cached_block(h(5)) is b
    assert set(pool.cached[h(5)]) == {1}
    pool.check_integrity()
    # Evicting the last copy drops the entry.
    pool.uncache_block(b)
    assert h(5) not in pool.cached
    assert pool.get_cached_block(h(5)) is None
    pool.free_blocks(rest)
    assert_all_free(pool)


def test_uncache_block_without_hash_is_noop() -> None:
    pool = BlockPool(2, enable_caching=True)
    (block,) = take(pool, 1)
    pool.uncache_block(block)
    assert block.block_hash is None
    pool.free_blocks([block])
    assert_all_free(pool)


def test_reset_prefix_cache() -> None:
    pool = BlockPool(4, enable_caching=True)
    blocks = take(pool, 3, hashes=[1, 2, 3])
    pool.free_blocks(reversed(blocks[1:]))
    assert pool.reset_prefix_cache() is False  # block 0 still in use
    assert set(pool.cached) == {h(1), h(2), h(3)}
    assert blocks[1].block_hash == h(2)
    pool.free_blocks([blocks[0]])
    assert pool.reset_prefix_cache() is True
    assert not pool.cached
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.get_cached_block(h(1)) is None
    assert_all_free(pool)


def test_usage() -> None:
    pool = BlockPool(8, enable_caching=False)
    a = pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(0.25)
    b = pool.get_new_blocks(6)
    assert pool.usage == pytest.approx(1.0)
    pool.free_blocks(b)
    assert pool.usage == pytest.approx(0.25)
    pool.free_blocks(a)
    assert pool.usage == 0.0
    assert_all_free(pool)


# -- check_integrity on corrupted pools ----------------------------------------------------------


def test_check_integrity_catches_negative_ref_count() -> None:
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt = -1
    with pytest.raises(AssertionError, match="negative ref count"):
        pool.check_integrity()


def test_check_integrity_catches_double_free() -> None:
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    pool.free_blocks([block])  # no guard in free_blocks: the check must catch it
    with pytest.raises(AssertionError):
        pool.check_integrity()


def test_check_integrity_catches_referenced_block_in_free_queue() -> None:
    pool = BlockPool(4, enable_caching=True)
    pool.blocks[2].ref_cnt = 1
    with pytest.raises(AssertionError, match="in the free queue with references"):
        pool.check_integrity()


def test_check_integrity_catches_free_count_drift() -> None:
    pool = BlockPool(4, enable_caching=True)
    pool.free_queue.num_free_blocks -= 1
    with pytest.raises(AssertionError, match="free queue holds 4 blocks but counts 3"):
        pool.check_integrity()


def test_check_integrity_catches_leaked_block() -> None:
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt = 0  # neither in use nor in the free queue
    with pytest.raises(AssertionError, match="0 in use"):
        pool.check_integrity()


def test_check_integrity_catches_in_use_block_still_linked() -> None:
    pool = BlockPool(4, enable_caching=True)
    (block,) = pool.get_new_blocks(1)
    block.next_free = pool.blocks[1]
    with pytest.raises(AssertionError, match="linked into the free queue"):
        pool.check_integrity()


def test_check_integrity_catches_hash_missing_from_map() -> None:
    pool = BlockPool(4, enable_caching=True)
    (block,) = take(pool, 1)
    block.block_hash = h(9)
    with pytest.raises(AssertionError, match="hash missing from the map"):
        pool.check_integrity()


def test_check_integrity_catches_map_under_wrong_hash() -> None:
    pool = BlockPool(4, enable_caching=True)
    (block,) = take(pool, 1, hashes=[1])
    pool.cached[h(2)] = {block.block_id: block}
    with pytest.raises(AssertionError, match="mapped under another hash"):
        pool.check_integrity()


def test_check_integrity_catches_empty_map_entry() -> None:
    pool = BlockPool(4, enable_caching=True)
    pool.cached[h(3)] = {}
    with pytest.raises(AssertionError, match="empty entry"):
        pool.check_integrity()


def test_check_integrity_catches_cached_block_with_caching_off() -> None:
    pool = BlockPool(4, enable_caching=False)
    take(pool, 1, hashes=[1])
    with pytest.raises(AssertionError, match="prefix caching is off"):
        pool.check_integrity()
