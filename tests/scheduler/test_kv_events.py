"""KV cache events: a ``PrefixIndex`` fed with a pool's events holds exactly the hashes the
pool can find, step after step, through prefix hits, duplicate copies, preemption, eviction
and a reset."""

from __future__ import annotations

import random

from scheduler.block_pool import BlockPool
from scheduler.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvents, PrefixIndex
from tests.scheduler.helpers import make_request, make_scheduler, run_to_completion, step


def test_runs_of_the_same_kind_share_one_event() -> None:
    events = KVEvents()
    for h in (b"a", b"b"):
        events.stored(h)
    events.removed(b"a")
    events.stored(b"c")
    assert events.take() == [
        BlockStored((b"a", b"b")),
        BlockRemoved((b"a",)),
        BlockStored((b"c",)),
    ]
    assert events.take() == []
    events.stored(b"x")
    events.cleared()
    events.stored(b"y")
    assert events.take() == [AllBlocksCleared(), BlockStored((b"y",))]


def test_second_copy_of_a_hash_is_no_event() -> None:
    pool = BlockPool(4, enable_caching=True)
    events = pool.record_events()
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"h")
    pool.cache_block(b, b"h")  # the same content computed twice
    assert events.take() == [BlockStored((b"h",))]
    pool.free_blocks([a])
    pool.get_new_blocks(4 - 1)  # evicts a's copy (b still holds h)
    assert events.take() == []
    pool.uncache_block(b)
    assert events.take() == [BlockRemoved((b"h",))]


def test_recording_starts_with_what_is_cached() -> None:
    pool = BlockPool(2, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, b"h")
    index = PrefixIndex()
    index.apply(pool.record_events().take())
    assert index.hashes == {b"h"}


def test_index_mirrors_the_pool_through_a_random_workload() -> None:
    rng = random.Random(0)
    # Few blocks: requests preempt each other and evict each other's prefixes.
    scheduler = make_scheduler(block_size=4, num_blocks=24, max_model_len=64)
    pool = scheduler.kv_cache_manager.block_pool
    events = pool.record_events()
    index = PrefixIndex()
    prefixes = [[rng.randrange(1000) for _ in range(8)] for _ in range(3)]
    for k in range(40):
        for _ in range(rng.randrange(3)):
            tail = [rng.randrange(1000) for _ in range(rng.randrange(1, 14))]
            scheduler.add_request(make_request([*rng.choice(prefixes), *tail], max_tokens=6))
        for _ in range(rng.randrange(1, 4)):
            step(scheduler)
        index.apply(events.take())
        assert index.hashes == set(pool.cached), f"round {k}"
        hashes = list(pool.cached)
        assert index.num_cached_blocks(hashes, len(hashes)) == len(hashes)
    run_to_completion(scheduler)
    assert scheduler.reset_prefix_cache()
    index.apply(events.take())
    assert not index.hashes and not pool.cached
