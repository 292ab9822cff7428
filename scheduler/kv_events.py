"""KV cache events: what an instance's prefix cache gained and lost, for a mirror elsewhere.

The names are vLLM's (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, a
``KVEventBatch`` per step). The meaning is one notch narrower, so that a mirror built from
them is exact: an event is about a *hash*, not a block copy. ``BlockStored(h)`` says the pool
can now find content ``h`` (its first copy was cached); ``BlockRemoved(h)`` says it no longer
can (its last copy was evicted). Two copies of the same content (two requests that computed
it at once) are one entry; evicting one of them is no event.

``BlockPool`` records them only when asked (``KVEvents``); ``PrefixIndex`` applies them in
order and answers what the router asks: how many leading blocks of a prompt are cached.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """These hashes became findable, in this order."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """These hashes are no longer findable."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every hash is forgotten (a prefix-cache reset)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEvents:
    """The events of one pool since they were last taken, merged as they come: consecutive
    stores (or removals) share one event, so a step that caches a prompt's 100 blocks is one
    ``BlockStored`` of 100 hashes."""

    __slots__ = ("_events", "_hashes", "_stored")

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []
        self._hashes: list[bytes] = []  # the hashes of the run being gathered
        self._stored = True  # what the run is

    def stored(self, block_hash: bytes) -> None:
        if not self._stored:
            self._close()
            self._stored = True
        self._hashes.append(block_hash)

    def removed(self, block_hash: bytes) -> None:
        if self._stored:
            self._close()
            self._stored = False
        self._hashes.append(block_hash)

    def cleared(self) -> None:
        self._hashes.clear()
        self._events = [AllBlocksCleared()]  # nothing before a reset matters

    def take(self) -> list[KVCacheEvent]:
        """The events so far, oldest first; the record starts empty again."""
        self._close()
        events, self._events = self._events, []
        return events

    def _close(self) -> None:
        if self._hashes:
            hashes = tuple(self._hashes)
            self._events.append(BlockStored(hashes) if self._stored else BlockRemoved(hashes))
            self._hashes.clear()


class PrefixIndex:
    """The hashes one instance can find, rebuilt from its events (the router's copy of a
    prefix cache that lives in another process)."""

    __slots__ = ("hashes",)

    def __init__(self, hashes: Iterable[bytes] = ()) -> None:
        self.hashes: set[bytes] = set(hashes)

    def apply(self, events: Iterable[KVCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.hashes.difference_update(event.block_hashes)
            else:
                self.hashes.clear()

    def num_cached_blocks(self, block_hashes: Sequence[bytes], max_blocks: int) -> int:
        """How many of the first ``max_blocks`` hashes are cached, counted up to the first
        that is not (a prefix hit stops at the first miss)."""
        hashes = self.hashes
        hits = 0
        for block_hash in block_hashes[:max_blocks]:
            if block_hash not in hashes:
                break
            hits += 1
        return hits

    def __len__(self) -> int:
        return len(self.hashes)
