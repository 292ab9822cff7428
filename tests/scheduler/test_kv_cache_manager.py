"""KVCacheManager: the block-hash chain, prefix hits, slot allocation (all-or-nothing),
hashing at allocation, prefix-cache stats, uncaching, the watermark and integrity checks.

Every scenario ends with ``free_all``: every block back in the free queue, no table left,
``check_integrity()`` clean."""

from __future__ import annotations

import random
from typing import Any

import pytest

from scheduler import (
    KVCacheBlocks,
    KVCacheManager,
    LoRARequest,
    PrefixCacheStats,
    Request,
    RequestStatus,
)
from scheduler.kv_cache_utils import hash_block_tokens, request_extra_keys, update_block_hashes
from tests.scheduler.helpers import lora, make_request

BS = 4


def make_kv(
    num_blocks: int = 32, block_size: int = BS, max_model_len: int = 128, **kw: Any
) -> KVCacheManager:
    return KVCacheManager(block_size, num_blocks, max_model_len, **kw)


def mk(
    prompt: list[int] | int, *, adapter: LoRARequest | None = None, cache_salt: str | None = None
) -> Request:
    return make_request(prompt, lora=adapter, cache_salt=cache_salt)


def hashes(request: Request) -> list[bytes]:
    return list(update_block_hashes(request, BS))


def admit(kv: KVCacheManager, request: Request) -> int:
    """Admit the whole remaining prompt as the scheduler does (look-up, then allocate) and mark
    it computed and running. Returns the prefix-hit tokens."""
    hits, num_hit = kv.get_computed_blocks(request)
    new = kv.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    request.status = RequestStatus.RUNNING
    return num_hit


def free_all(kv: KVCacheManager, *requests: Request) -> None:
    for request in requests:
        kv.free(request)
    kv.check_integrity()
    pool = kv.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not kv.req_to_blocks
    assert not kv.num_cached_block


def snapshot(kv: KVCacheManager) -> tuple[object, ...]:
    pool = kv.block_pool
    return (
        pool.num_free_blocks,
        [b.block_id for b in pool.free_queue],
        {rid: [b.block_id for b in bl] for rid, bl in kv.req_to_blocks.items()},
        dict(kv.num_cached_block),
        {k: sorted(v) for k, v in pool.cached.items()},
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
    )


def test_hash_chain() -> None:
    assert hashes(mk(10)) == hashes(mk(10))
    assert len(set(hashes(mk(10)))) == 2  # the partial third block is not hashed
    base = list(range(100, 116))
    a, b = mk(base), mk([99, *base[1:]])
    assert all(x != y for x, y in zip(hashes(a), hashes(b), strict=True))
    tail = mk([*base[:12], 1, 2, 3, 4])
    assert hashes(tail)[:3] == hashes(a)[:3]
    assert hashes(tail)[3] != hashes(a)[3]
    # Output tokens extend the chain exactly as prompt tokens would.
    r = mk(7)
    assert len(hashes(r)) == 1
    r.append_output_token_ids([107, 108])
    assert hashes(r) == hashes(mk(9))


def test_extra_keys_make_equal_tokens_differ_on_every_block() -> None:
    same_name_other_path = LoRARequest(lora_name="adapter-1", lora_int_id=1, lora_path="/x")
    variants: list[dict[str, Any]] = [
        {},
        {"adapter": lora(1)},
        {"adapter": lora(2)},
        {"adapter": same_name_other_path},
        {"cache_salt": "s"},
        {"cache_salt": "t"},
        {"adapter": lora(1), "cache_salt": "s"},
    ]
    all_hashes = [h for keys in variants for h in hashes(mk(12, **keys))]
    assert len(set(all_hashes)) == len(all_hashes) == 3 * len(variants)
    for keys in variants:  # equal keys hash equal
        assert hashes(mk(12, **keys)) == hashes(mk(12, **keys))


def test_lora_on_every_block_salt_on_first_only() -> None:
    r = mk(8, adapter=lora(1), cache_salt="s")
    tag = ("lora", "adapter-1", "/adapters/1", 1)
    assert request_extra_keys(r, 0) == (tag, ("cache_salt", "s"))
    assert request_extra_keys(r, 1) == (tag,)
    assert request_extra_keys(mk(8, cache_salt="s"), 1) is None
    first, second = hashes(r)
    assert first == hash_block_tokens(None, r.all_token_ids[:4], (tag, ("cache_salt", "s")))
    assert second == hash_block_tokens(first, r.all_token_ids[4:], (tag,))


def test_an_adapter_loaded_again_does_not_hit_its_old_weights_blocks() -> None:
    """Unloading an adapter and loading it again under the same name and path (new weights
    written to its folder) gives it a new id; its requests must not find the KV the old
    weights computed (they found it: the key was the name and path only)."""
    kv = make_kv()
    old = LoRARequest(lora_name="adapter-1", lora_int_id=1, lora_path="/adapters/1")
    again = LoRARequest(lora_name="adapter-1", lora_int_id=7, lora_path="/adapters/1")
    served = mk(13, adapter=old)
    admit(kv, served)
    assert kv.get_computed_blocks(mk(13, adapter=old))[1] == 12
    assert kv.get_computed_blocks(mk(13, adapter=again))[1] == 0
    free_all(kv, served)


def test_lora_and_salt_requests_only_hit_their_own_blocks() -> None:
    kv = make_kv()
    tuned, salted = mk(13, adapter=lora(1)), mk(13, cache_salt="s")
    admit(kv, tuned)
    admit(kv, salted)
    base = mk(13)
    assert kv.get_computed_blocks(base)[1] == 0
    assert kv.get_computed_blocks(mk(13, adapter=lora(2)))[1] == 0
    assert kv.get_computed_blocks(mk(13, cache_salt="t"))[1] == 0
    assert kv.get_computed_blocks(mk(13, adapter=lora(1)))[1] == 12
    assert kv.get_computed_blocks(mk(13, cache_salt="s"))[1] == 12
    # And a LoRA request never hits base-model blocks.
    admit(kv, base)
    assert kv.get_computed_blocks(mk(13, adapter=lora(3)))[1] == 0
    free_all(kv, tuned, salted, base)


@pytest.mark.parametrize(
    ("length", "expected_hit"), [(33, 32), (35, 32), (32, 16), (31, 16), (17, 16), (16, 0)]
)
def test_prefix_hit_block_aligned_never_covers_last_token(length: int, expected_hit: int) -> None:
    kv = make_kv(num_blocks=16, block_size=16, max_model_len=256)
    cached = mk(33)
    admit(kv, cached)
    probe = mk(length)
    hit_blocks, num_hit = kv.get_computed_blocks(probe)
    assert num_hit == expected_hit
    assert hit_blocks.get_block_ids() == kv.get_block_ids(cached.request_id)[: num_hit // 16]
    assert admit(kv, probe) == expected_hit
    free_all(kv, cached, probe)


def test_prefix_hit_stops_at_first_miss() -> None:
    kv = make_kv()
    a = mk(13)
    admit(kv, a)
    kv.free(a)
    middle = kv.block_pool.get_cached_block(hashes(a)[1])
    assert middle is not None
    kv.block_pool.uncache_block(middle)
    before = snapshot(kv)
    # Block 2 is still cached, but a hit must be a prefix.
    blocks, num_hit = kv.get_computed_blocks(mk(13))
    assert num_hit == 4
    assert blocks.blocks[0].ref_cnt == 0  # a look-up takes no reference ...
    assert snapshot(kv) == before  # ... and changes nothing
    assert kv.make_prefix_cache_stats().queries == 0  # stats are recorded at admission only
    free_all(kv)


def test_caching_off_never_hits_or_hashes() -> None:
    kv = make_kv(enable_caching=False)
    a, b = mk(12), mk(12)
    admit(kv, a)
    assert not kv.block_pool.cached
    assert kv.get_computed_blocks(b) == (KVCacheBlocks(), 0)
    admit(kv, b)
    free_all(kv, a, b)


def test_allocate_returns_only_new_blocks_and_grows_for_decode() -> None:
    kv = make_kv()
    r = mk(6)
    with pytest.raises(ValueError, match="allocate_slots"):
        kv.allocate_slots(r, 0)
    first = kv.allocate_slots(r, 6)
    assert first is not None and len(first) == 2
    r.num_computed_tokens = 6
    r.append_output_token_ids(1)
    same_block = kv.allocate_slots(r, 1)
    assert same_block is not None and len(same_block) == 0  # fits in block 1: not None
    r.num_computed_tokens = 7
    r.append_output_token_ids([1, 1])
    grown = kv.allocate_slots(r, 2)
    assert grown is not None and len(grown) == 1
    assert kv.get_block_ids(r.request_id) == first.get_block_ids() + grown.get_block_ids()
    free_all(kv, r)


def test_allocate_counts_revived_hits_as_required() -> None:
    kv = make_kv(num_blocks=8)
    cached = mk(16)
    admit(kv, cached)
    kv.free(cached)  # four hashed blocks in the free queue
    other = mk(list(range(500, 512)))
    admit(kv, other)  # three unhashed blocks taken from the head: 5 free, 4 of them hits
    r = mk(24)
    hits, num_hit = kv.get_computed_blocks(r)
    assert num_hit == 16
    before = snapshot(kv)
    # 2 new blocks + 4 revived hits = 6 > 5 free: refused, nothing touched.
    assert kv.allocate_slots(r, 8, num_hit, hits) is None
    assert snapshot(kv) == before
    assert r.request_id not in kv.req_to_blocks
    kv.free(other)
    new = kv.allocate_slots(r, 8, num_hit, hits)
    assert new is not None and len(new) == 2
    assert kv.get_block_ids(r.request_id)[:4] == hits.get_block_ids()
    assert [b.ref_cnt for b in hits.blocks] == [1, 1, 1, 1]
    free_all(kv, r)


def test_full_sequence_must_fit() -> None:
    kv = make_kv(num_blocks=8)
    holder = mk(16)
    admit(kv, holder)  # 4 free left
    r = mk(20)  # 5 blocks in all
    before = snapshot(kv)
    assert kv.allocate_slots(mk(20), 20) is None  # short of blocks: nothing changes
    assert snapshot(kv) == before
    assert kv.allocate_slots(r, 8, full_sequence_must_fit=True) is None
    assert snapshot(kv) == before
    chunk = kv.allocate_slots(r, 8)  # a chunk alone fits
    assert chunk is not None and len(chunk) == 2
    kv.free(r)
    kv.free(holder)
    # When it fits, only the chunk's blocks are allocated.
    fits = kv.allocate_slots(r, 8, full_sequence_must_fit=True)
    assert fits is not None and len(fits) == 2
    free_all(kv, r)


def test_lookahead_slots_allocate_extra_blocks_unhashed() -> None:
    kv = make_kv()
    r = mk(8)
    new = kv.allocate_slots(r, 8, num_lookahead_tokens=5)
    assert new is not None and len(new) == 4  # cdiv(8 + 5, 4)
    assert kv.num_cached_block[r.request_id] == 2
    assert [b.block_hash is not None for b in new.blocks] == [True, True, False, False]
    free_all(kv, r)
    capped = make_kv(num_blocks=8, max_model_len=16)
    near_end = mk(15)
    new = capped.allocate_slots(near_end, 15, num_lookahead_tokens=8)
    assert new is not None and len(new) == 4  # 16 tokens (max_model_len), not 23
    free_all(capped, near_end)


def test_external_tokens_get_fresh_blocks_hashed_later() -> None:
    kv = make_kv()
    r = mk(9)
    new = kv.allocate_slots(r, 0, num_external_computed_tokens=8, delay_cache_blocks=True)
    assert new is not None and len(new) == 2
    assert not kv.block_pool.cached  # the load has not landed yet
    assert kv.get_computed_blocks(mk(9))[1] == 0
    r.num_computed_tokens = 8
    kv.cache_blocks(r, 8)  # load done
    assert kv.get_computed_blocks(mk(9))[1] == 8
    free_all(kv, r)


def test_append_slots_matches_allocate_slots() -> None:
    """Same decisions, same blocks, same hashes as ``allocate_slots`` for running requests,
    including refusals when blocks run out."""
    rng = random.Random(0)
    slow, fast = make_kv(num_blocks=12), make_kv(num_blocks=12)
    live = [mk(5), mk(list(range(300, 311)))]
    for r in live:
        admit(slow, r)
        r.status, r.num_computed_tokens = RequestStatus.WAITING, 0
        admit(fast, r)
    refused = 0
    for _ in range(40):
        for r in list(live):
            k = rng.randint(1, 5)
            r.append_output_token_ids([rng.randint(3, 50) for _ in range(k)])
            lookahead = rng.choice([0, 0, 3])
            a = slow.allocate_slots(r, k, num_lookahead_tokens=lookahead)
            b = fast.append_slots(r, k, lookahead)
            assert (a is None) == (b is None)
            assert a is None or b is None or a.get_block_ids() == b.get_block_ids()
            assert snapshot(slow) == snapshot(fast)
            if a is None:
                refused += 1
                live.remove(r)
                slow.free(r)
                fast.free(r)
            else:
                r.num_computed_tokens += k
        slow.check_integrity()
        fast.check_integrity()
    assert refused == 2  # both ran out of blocks: the refusal path was compared too
    free_all(slow)
    free_all(fast)


def test_append_slots_refusal_and_fallback() -> None:
    kv = make_kv(num_blocks=4)
    r = mk(16)
    admit(kv, r)
    r.append_output_token_ids(1)
    before = snapshot(kv)
    assert kv.append_slots(r, 1) is None
    assert snapshot(kv) == before
    free_all(kv, r)
    # A request that holds nothing falls back to allocate_slots: the watermark applies.
    kv = make_kv(num_blocks=16, max_model_len=64, watermark=0.25)
    new_req = mk(52)
    assert kv.append_slots(new_req, 52) is None
    assert new_req.request_id not in kv.req_to_blocks
    new = kv.append_slots(new_req, 8)
    assert new is not None and len(new) == 2
    assert kv.num_cached_block[new_req.request_id] == 2
    free_all(kv, new_req)


def test_blocks_hashed_at_allocation_are_hit_in_the_same_step() -> None:
    kv = make_kv()
    a, b = mk(9), mk(9)
    hits, n = kv.get_computed_blocks(a)
    assert kv.allocate_slots(a, 9 - n, n, hits) is not None
    assert a.num_computed_tokens == 0  # nothing computed yet
    assert kv.num_cached_block[a.request_id] == 2  # the partial block is not hashed
    hits_b, n_b = kv.get_computed_blocks(b)
    assert n_b == 8
    assert kv.allocate_slots(b, 1, n_b, hits_b) is not None
    shared = kv.get_block_ids(a.request_id)[:2]
    assert kv.get_block_ids(b.request_id)[:2] == shared
    assert [kv.block_pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    assert kv.get_block_ids(a.request_id)[2] != kv.get_block_ids(b.request_id)[2]
    kv.check_integrity()
    free_all(kv, a, b)


def test_chunk_hashes_only_its_full_blocks() -> None:
    kv = make_kv()
    a = mk(16)
    assert kv.allocate_slots(a, 6) is not None
    assert kv.num_cached_block[a.request_id] == 1
    assert kv.get_computed_blocks(mk(16))[1] == 4
    a.num_computed_tokens = 6
    assert kv.allocate_slots(a, 10) is not None
    assert kv.num_cached_block[a.request_id] == 4
    assert kv.get_computed_blocks(mk(16))[1] == 12
    free_all(kv, a)


def test_prefix_cache_stats_preempted_apart_and_reset_on_read() -> None:
    kv = make_kv()
    fresh, resumed, released = mk(12), mk(20), mk(8)
    kv.record_prefix_hit(fresh, 8)
    kv.record_prefix_hit(mk(4), 0)
    resumed.status = RequestStatus.PREEMPTED
    resumed.num_preemptions = 1
    kv.record_prefix_hit(resumed, 16)
    # Its loaded KV released back to waiting (a preemption, status WAITING again): admitted
    # again, it is no new request, and its hits are its own blocks.
    released.num_preemptions = 1
    kv.record_prefix_hit(released, 8)
    stats = kv.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 16, 8)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (2, 28, 24)
    assert stats.hit_rate == pytest.approx(0.5)
    assert kv.make_prefix_cache_stats() == PrefixCacheStats()  # reset on read
    free_all(kv)


def test_reset_prefix_cache() -> None:
    kv = make_kv()
    a = mk(12)
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    assert kv.get_computed_blocks(mk(12))[1] == 8
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert not kv.block_pool.cached
    assert kv.get_computed_blocks(mk(12))[1] == 0
    free_all(kv)


def test_uncache_uncomputed_blocks() -> None:
    kv = make_kv()
    a = mk(16)
    kv.allocate_slots(a, 16)  # hashed at allocation, not computed
    b = mk(9)
    admit(kv, b)  # shares a's first two blocks
    ids = kv.get_block_ids(a.request_id)
    kv.uncache_uncomputed_blocks(a, 0)
    assert kv.num_cached_block[a.request_id] == 0
    pool = kv.block_pool
    # Blocks only a held lose their hash; blocks b also holds keep it.
    assert [pool.blocks[i].block_hash is not None for i in ids] == [True, True, False, False]
    assert kv.get_computed_blocks(mk(16))[1] == 8
    kv.check_integrity()
    kv.uncache_uncomputed_blocks(a, 0)  # idempotent
    free_all(kv, a, b)
    # Blocks already computed keep their hash.
    assert kv.reset_prefix_cache()
    c = mk(16)
    kv.allocate_slots(c, 16)
    kv.uncache_uncomputed_blocks(c, 5)
    assert kv.num_cached_block[c.request_id] == 1
    assert kv.get_computed_blocks(mk(16))[1] == 4
    free_all(kv, c)


def test_free_evicts_a_requests_last_block_first() -> None:
    kv = make_kv(num_blocks=8)
    a = mk(13)  # blocks: 3 full (hashed) + 1 partial
    admit(kv, a)
    kv.free(a)
    # Free queue: [a's partial block, 4 never-used blocks, a's block 2, block 1, block 0].
    filler = mk(list(range(500, 524)))  # 6 blocks: the 5 unhashed, then a's last full block
    admit(kv, filler)
    assert kv.get_computed_blocks(mk(13))[1] == 8
    free_all(kv, filler)


def test_watermark_applies_to_admissions_only() -> None:
    kv = make_kv(num_blocks=16, max_model_len=64, watermark=0.25)  # 4 blocks kept free
    assert kv.watermark_blocks == 4
    big = mk(52)  # 13 blocks
    assert kv.allocate_slots(big, 52) is None
    assert kv.allocate_slots(big, 52, has_scheduled_reqs=False) is not None
    kv.free(big)
    runner = mk(32)
    assert kv.allocate_slots(runner, 32) is not None  # 8 + 4 <= 16
    runner.status = RequestStatus.RUNNING
    runner.num_computed_tokens = 32
    assert kv.allocate_slots(mk(20), 20) is None  # 5 + 4 > 8
    preempted = mk(20)
    preempted.status = RequestStatus.PREEMPTED
    assert kv.allocate_slots(preempted, 20) is None
    waiting = mk(16)
    assert kv.allocate_slots(waiting, 16) is not None  # 4 + 4 <= 8
    # A running request may use the reserve.
    runner.append_output_token_ids(list(range(16)))
    assert kv.allocate_slots(runner, 16) is not None
    assert kv.block_pool.num_free_blocks == 0
    free_all(kv, runner, waiting)


def test_check_integrity_catches_corrupted_tables() -> None:
    kv = make_kv()
    a = mk(8)
    admit(kv, a)
    kv.check_integrity()
    kv.num_cached_block[a.request_id] = 3
    with pytest.raises(AssertionError, match="more cached blocks"):
        kv.check_integrity()
    kv.num_cached_block[a.request_id] = 2
    kv.req_to_blocks[a.request_id].append(kv.block_pool.blocks[20])  # no reference taken
    with pytest.raises(AssertionError, match="holders"):
        kv.check_integrity()
