"""Block hashing for prefix caching, the ``KVCacheBlocks`` result type and prefix-cache stats."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Any

from scheduler.block_pool import KVCacheBlock
from scheduler.request import Request

# Parent of the first block. Stable across processes, so hashes can be compared between
# instances (the router's prefix affinity, KV events).
NONE_HASH = hashlib.sha256(b"tandem-none-hash").digest()


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: list[int], extra_keys: tuple[Any, ...] | None
) -> bytes:
    """``H_i = sha256(H_{i-1} || tokens || extra_keys)``; a chain, so a hit implies its prefix."""
    h = hashlib.sha256(parent_hash or NONE_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def request_extra_keys(request: Request, block_index: int) -> tuple[Any, ...] | None:
    """Keys that make equal tokens different content: the LoRA adapter (every block) and the
    cache salt (first block only, which by the chain separates every later block too).

    The adapter is its name and path (vLLM's key) and its id: an adapter unloaded and loaded
    again under the same name and path -- new weights written to its folder -- gets a new id
    (ids are never given twice: workers cache weights by id), and its requests must not
    find the KV the old weights computed."""
    keys: tuple[Any, ...] = ()
    lora = request.lora_request
    if lora is not None:
        keys += (("lora", lora.lora_name, lora.lora_path, lora.lora_int_id),)
    if block_index == 0 and request.cache_salt is not None:
        keys += (("cache_salt", request.cache_salt),)
    return keys or None


def update_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Extend ``request.block_hashes`` to cover every full block of its known tokens.

    Same values as chaining ``hash_block_tokens``, computed from one byte buffer for all new
    blocks: hashing is the largest per-token cost of admitting a long prompt.
    """
    hashes = request.block_hashes
    start = len(hashes)
    num_full = len(request.all_token_ids) // block_size
    if start >= num_full:
        return hashes
    data = array("q", request.all_token_ids[start * block_size : num_full * block_size]).tobytes()
    stride = 8 * block_size
    parent = hashes[-1] if hashes else NONE_HASH
    sha256 = hashlib.sha256
    for i in range(start, num_full):
        offset = (i - start) * stride
        extra = request_extra_keys(request, i)
        chunk = parent + data[offset : offset + stride]
        if extra:
            chunk += repr(extra).encode()
        parent = sha256(chunk).digest()
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks returned by the KV cache manager. Read the ids; do not mutate the blocks."""

    blocks: tuple[KVCacheBlock, ...] = ()

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters since the last read. Preempted requests are counted apart, so
    resumptions do not inflate the hit rate of fresh traffic."""

    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
