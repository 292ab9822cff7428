"""BlockPool: KV block ids, reference counts, the LRU free queue and the hash -> block map.

It knows nothing of requests; ``KVCacheManager`` maps requests to blocks on top of it.

Free queue (a doubly linked list, O(1) removal from the middle when a prefix hit revives a block)::

    head                                                        tail
    [unhashed, reused first] ... [hashed, least recently freed] ... [hashed, most recently freed]

``get_new_blocks`` pops from the head. A freed block that carries a hash goes to the tail (it may
still be hit, and is evicted last-in-line LRU); one without a hash goes to the head (nothing to
lose, reuse it first). Requests free their blocks tail-first, so a request's last block is evicted
before its prefix.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from scheduler.kv_events import KVEvents


class KVCacheBlock:
    """One block of ``block_size`` token slots in every layer's KV cache."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        # Links of the free queue; both None when the block is not in it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None  # sentinel invariant, not user input
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Owns every KV block of one instance.

    ``cached`` maps a block hash to the blocks holding that content. There can be more than one:
    block tables are append-only, so two requests that computed the same content concurrently
    keep separate copies; evicting one keeps the others findable.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, dict[int, KVCacheBlock]] = {}
        # Set by ``record_events``: which hashes became findable or stopped being so.
        self.events: KVEvents | None = None

    def record_events(self) -> KVEvents:
        """Record ``kv_events`` from now on (a mirror of this pool's hashes elsewhere: the
        router's ``PrefixIndex``); the record starts with every hash already cached."""
        if self.events is None:
            self.events = KVEvents()
            for block_hash in self.cached:
                self.events.stored(block_hash)
        return self.events

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (0.0 - 1.0)."""
        return 1.0 - self.free_queue.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        by_id = self.cached.get(block_hash)
        if not by_id:
            return None
        return next(iter(by_id.values()))

    # -- mutation --------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the head of the free queue (evicting their hashes)."""
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(
                f"asked for {num_blocks} blocks with {self.free_queue.num_free_blocks} free"
            )
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving those that sat in the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the order given (callers pass tail-first)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Record that ``block`` holds the content named by ``block_hash``."""
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        by_id = self.cached.setdefault(block_hash, {})
        if not by_id and self.events is not None:
            self.events.stored(block_hash)
        by_id[block.block_id] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget a block's hash (its content will not be computed after all)."""
        if block.block_hash is not None:
            self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        by_id = self.cached.get(block.block_hash)
        if by_id is not None:
            by_id.pop(block.block_id, None)
            if not by_id:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Only possible when no block is in use; returns success."""
        if self.free_queue.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    # -- invariants ------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` on any broken invariant (tests; debug mode when idle).

        free + in use == total; no negative ref counts; a block is in the free queue iff its
        ref count is 0; the hash map and the blocks' hashes agree.
        """
        in_queue = 0
        for block in self.free_queue:
            assert block.ref_cnt == 0, f"{block} is in the free queue with references"
            in_queue += 1
        assert in_queue == self.free_queue.num_free_blocks, (
            f"free queue holds {in_queue} blocks but counts {self.free_queue.num_free_blocks}"
        )
        in_use = 0
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"{block} has a negative ref count"
            if block.ref_cnt > 0:
                in_use += 1
                assert block.prev_free is None and block.next_free is None, (
                    f"{block} is in use but linked into the free queue"
                )
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash, {}).get(block.block_id) is block, (
                    f"{block} has a hash missing from the map"
                )
        assert in_use + in_queue == self.num_blocks, (
            f"{in_use} in use + {in_queue} free != {self.num_blocks} blocks"
        )
        for block_hash, by_id in self.cached.items():
            assert by_id, "empty entry in the hash map"
            for block in by_id.values():
                assert block.block_hash == block_hash, f"{block} is mapped under another hash"
        if not self.enable_caching:
            assert not self.cached, "prefix caching is off but blocks are cached"
