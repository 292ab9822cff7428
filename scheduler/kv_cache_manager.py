"""KVCacheManager: per-request block tables, prefix look-up and slot allocation."""

from __future__ import annotations

import sys
from collections import Counter

from scheduler.block_pool import BlockPool, KVCacheBlock
from scheduler.kv_cache_utils import KVCacheBlocks, PrefixCacheStats, update_block_hashes
from scheduler.request import Request, RequestStatus


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


_ADMISSION_STATUSES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
NO_BLOCKS = KVCacheBlocks()  # shared result of an allocation that added nothing


class KVCacheManager:
    """Maps requests to blocks of one instance's paged KV cache.

    Block table of a request, with ``block_size = 4``, 10 tokens computed and 3 scheduled::

        tokens   0 1 2 3 | 4 5 6 7 | 8 9 a b |
        blocks   [ b17  ] [  b3   ] [  b9   ]      a, b: scheduled this step
                 hit      computed   computed up to 9, a/b being computed
                 (shared)            -> hashed at allocation once full (optimistic)

    A block is hashed (made findable by prefix look-ups) as soon as the step that fills it is
    scheduled, so two identical prompts admitted in the same step share blocks.
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        enable_caching: bool = True,
        watermark: float = 0.0,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.watermark_blocks = int(watermark * num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request carry a hash.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    # -- prefix look-up --------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of ``request``: (blocks, tokens). Changes nothing in the
        cache (it may extend the request's own list of block hashes).

        The hit is block-aligned and never covers the last token, which must be computed to
        produce logits: 33 tokens in cached blocks of 16 -> 32 hit; 32 tokens -> 16 hit. A
        request that wants prompt logprobs gets no hit (vLLM's rule).
        """
        if not self.enable_caching:
            return KVCacheBlocks(), 0
        hashes = update_block_hashes(request, self.block_size)
        if request.prompt_logprobs is not None:  # every prompt token's logits are wanted
            return KVCacheBlocks(), 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        get = self.block_pool.get_cached_block
        for block_hash in hashes[:max_hit_blocks]:
            block = get(block_hash)
            if block is None:
                break
            hits.append(block)
        return KVCacheBlocks(tuple(hits)), len(hits) * self.block_size

    def record_prefix_hit(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admission's look-up (called by the scheduler at admission only). A
        request admitted again after any preemption counts as preempted, as in vLLM: also one
        whose loaded KV was released back to waiting (its status is WAITING again, and its
        hits are mostly its own blocks)."""
        self.prefix_cache_stats.record(
            request.num_tokens, num_hit_tokens, request.num_preemptions > 0
        )

    # -- allocation ------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
        reserved_blocks: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        ``reserved_blocks`` must stay free besides (vLLM's: the blocks that prefills in
        progress still need, kept from a remote load admitted now).

        ``new_computed_blocks`` are prefix hits (``num_new_computed_tokens`` tokens) taken at
        admission; ``num_external_computed_tokens`` are tokens a KV connector will load into
        fresh blocks. Returns the newly allocated blocks, or ``None`` when there is no room --
        in which case nothing has changed. Unless ``delay_cache_blocks`` (remote KV not yet
        loaded), the blocks that become full are hashed immediately.
        """
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else ()
        required, num_blocks_needed, total_computed = self._blocks_required(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            hits,
            num_lookahead_tokens,
            num_external_computed_tokens,
            full_sequence_must_fit,
            has_scheduled_reqs,
        )
        if required + reserved_blocks > self.block_pool.free_queue.num_free_blocks:
            return None

        req_id = request.request_id
        held = self.req_to_blocks.get(req_id)
        bs = self.block_size
        if held is None:
            held = self.req_to_blocks[req_id] = []
        if hits:
            self.block_pool.touch(hits)
            held.extend(hits)
            self.num_cached_block[req_id] = len(held)
        if num_blocks_needed > 0:
            new_blocks = self.block_pool.get_new_blocks(num_blocks_needed)
            held.extend(new_blocks)
            result = KVCacheBlocks(tuple(new_blocks))
        else:
            result = NO_BLOCKS

        if delay_cache_blocks:
            request.kv_hash_deferred = True
        if self.enable_caching and not request.kv_hash_deferred:
            known = total_computed + num_new_tokens
            num_tokens = request.num_tokens
            if known > num_tokens:
                known = num_tokens
            if known // bs > self.num_cached_block.get(req_id, 0):
                self.cache_blocks(request, known)
        self._refresh_hint(request)
        return result

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
        freeing: str | None = None,
    ) -> bool:
        """Would ``allocate_slots`` with these arguments succeed -- after freeing the blocks
        of request ``freeing``, if given? No state change. Hits on blocks only ``freeing``
        holds would, once it is freed, have to be revived from the free queue: they count."""
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else ()
        required, _, _ = self._blocks_required(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            hits,
            num_lookahead_tokens,
            num_external_computed_tokens,
            full_sequence_must_fit,
            has_scheduled_reqs,
        )
        free = self.block_pool.free_queue.num_free_blocks
        if freeing is not None:
            released = {id(b) for b in self.req_to_blocks.get(freeing, ()) if b.ref_cnt == 1}
            free += len(released)
            required += sum(1 for b in hits if id(b) in released)
        return required <= free

    def _blocks_required(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        hits: tuple[KVCacheBlock, ...],
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        full_sequence_must_fit: bool,
        has_scheduled_reqs: bool,
    ) -> tuple[int, int, int]:
        """(free blocks the allocation needs incl. watermark, new blocks it takes, tokens
        computed once hits and external tokens count)."""
        if not (num_new_tokens or num_new_computed_tokens or num_external_computed_tokens):
            raise ValueError("allocate_slots needs new, hit or external tokens")
        held = self.req_to_blocks.get(request.request_id)
        num_held = len(held) if held is not None else 0
        bs, max_len = self.block_size, self.max_model_len
        total_computed = min(
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens,
            max_len,
        )
        need_tokens = min(total_computed + num_new_tokens + num_lookahead_tokens, max_len)
        num_blocks_needed = cdiv(need_tokens, bs) - len(hits) - num_held
        # Hits sitting in the free queue are taken out of it: they cost a free block.
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        required = max(num_blocks_needed, 0) + num_revived
        if full_sequence_must_fit:
            full_tokens = min(request.num_tokens, max_len)
            num_full = max(cdiv(full_tokens, bs) - len(hits) - num_held, 0) + num_revived
            required = max(required, num_full)
        if has_scheduled_reqs and request.status in _ADMISSION_STATUSES:
            required += self.watermark_blocks
        return required, num_blocks_needed, total_computed

    def append_slots(
        self, request: Request, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> KVCacheBlocks | None:
        """``allocate_slots`` for a request that already holds blocks and brings no prefix
        hits or external tokens (a running request): same result, a fraction of the cost.
        Most calls (decodes within their last block) change nothing and return no blocks."""
        req_id = request.request_id
        held = self.req_to_blocks.get(req_id)
        if held is None or request.status != RequestStatus.RUNNING:
            return self.allocate_slots(request, num_new_tokens, 0, None, num_lookahead_tokens)
        computed = request.num_computed_tokens
        need_tokens = computed + num_new_tokens + num_lookahead_tokens
        if need_tokens > self.max_model_len:
            need_tokens = self.max_model_len
        bs = self.block_size
        num_blocks_needed = -(-need_tokens // bs) - len(held)
        if num_blocks_needed > 0:
            if num_blocks_needed > self.block_pool.free_queue.num_free_blocks:
                return None
            new_blocks = self.block_pool.get_new_blocks(num_blocks_needed)
            held.extend(new_blocks)
            request.kv_slots = len(held) * bs
            result = KVCacheBlocks(tuple(new_blocks))
        else:
            result = NO_BLOCKS
        if self.enable_caching and not request.kv_hash_deferred:
            known = computed + num_new_tokens
            num_tokens = len(request.all_token_ids)
            if known > num_tokens:
                known = num_tokens
            if known // bs > self.num_cached_block.get(req_id, 0):
                self.cache_blocks(request, known)
        return result

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash the full blocks among the first ``num_tokens`` tokens of ``request``."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        num_cached = self.num_cached_block.get(req_id, 0)
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        hashes = update_block_hashes(request, self.block_size)
        blocks = self.req_to_blocks[req_id]
        for i in range(num_cached, num_full):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self.num_cached_block[req_id] = num_full
        request.kv_hash_boundary = (num_full + 1) * self.block_size

    def uncache_uncomputed_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Un-hash blocks that were hashed for a step that will not run after all (a request
        preempted in the step that scheduled it): their content will never be computed."""
        req_id = request.request_id
        num_cached = self.num_cached_block.get(req_id, 0)
        first = num_computed_tokens // self.block_size
        if num_cached <= first:
            return
        for block in self.req_to_blocks[req_id][first:num_cached]:
            if block.ref_cnt == 1:
                self.block_pool.uncache_block(block)
        self.num_cached_block[req_id] = first
        self._refresh_hint(request)

    def forget_hashes(self, request: Request, start: int, end: int) -> None:
        """``request``'s tokens ``[start, end)`` were not computed as its block hashes say (a
        step could not apply its LoRA adapter): no block may be found under the hashes of the
        blocks they fall in, wherever it is -- in its table, in the table of a request that
        hit it (its ref count is then above one), or back in the free queue (freed by a
        preemption or an abort while the step ran). A copy of that content computed right
        elsewhere loses its hash too (a prefix-cache miss, never wrong KV). The tables are
        left as they are: a block that lost its hash is never hashed again by a request that
        counts it as hashed, and ``request`` is about to be freed."""
        if not self.enable_caching or end <= start:
            return
        bs = self.block_size
        for block_hash in update_block_hashes(request, bs)[start // bs : cdiv(end, bs)]:
            for block in list(self.block_pool.cached.get(block_hash, {}).values()):
                self.block_pool.uncache_block(block)

    def uncomputed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Blocks ``request`` hashed ahead of ``num_computed_tokens`` (this step fills them)."""
        req_id = request.request_id
        first = request.num_computed_tokens // self.block_size
        return self.req_to_blocks.get(req_id, [])[first : self.num_cached_block.get(req_id, 0)]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (its last block is evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        request.kv_slots = request.kv_hash_boundary = 0
        request.kv_hash_deferred = False  # its loaded blocks are gone with the rest
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def _refresh_hint(self, request: Request) -> None:
        req_id = request.request_id
        request.kv_slots = len(self.req_to_blocks.get(req_id, ())) * self.block_size
        request.kv_hash_boundary = (
            (self.num_cached_block.get(req_id, 0) + 1) * self.block_size
            if self.enable_caching
            else sys.maxsize
        )

    def check_hint(self, request: Request) -> None:
        """Assert that the request's slot hint matches the tables (see Request.kv_slots)."""
        held = self.req_to_blocks.get(request.request_id, ())
        assert request.kv_slots == len(held) * self.block_size, (
            f"{request} kv_slots {request.kv_slots} != {len(held)} blocks"
        )
        if self.enable_caching and held:
            boundary = (self.num_cached_block.get(request.request_id, 0) + 1) * self.block_size
            assert request.kv_hash_boundary == boundary, (
                f"{request} kv_hash_boundary {request.kv_hash_boundary} != {boundary}"
            )

    # -- queries ---------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(self.req_to_blocks.get(request_id, ())))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Counters since the last call (reset on read)."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; fails (False) while any block is in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.num_cached_block.clear()
        return True

    def check_integrity(self) -> None:
        """The pool's invariants, plus: each block's ref count equals the number of block
        tables that hold it, and no table holds a free block."""
        self.block_pool.check_integrity()
        refs: Counter[int] = Counter()
        for req_id, blocks in self.req_to_blocks.items():
            for block in blocks:
                refs[block.block_id] += 1
            assert self.num_cached_block.get(req_id, 0) <= len(blocks), (
                f"{req_id} has more cached blocks than blocks"
            )
        for block in self.block_pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"{block} has ref_cnt {block.ref_cnt} but {refs.get(block.block_id, 0)} holders"
            )
