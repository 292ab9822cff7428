"""What the ``nixl`` transport's workers tell each other (``kv_transfer.nixl_transport``): where
a worker's KV blocks are (``PoolLayout``), its agent (``NixlPeer``), a request's leased blocks
(``NixlHandle``), and how a read's slabs become NIXL descriptors (``merge_descriptors``).
Plain data and numpy: no NIXL import."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np

from kv_transfer.cma import Token

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PoolLayout:
    """Where a worker's blocks are, for a peer to read them: per held layer, the address of
    block 0's K and of its V; the bytes from one block to the next; one block's K (or V)
    of one layer (``slab``). Plus what both sides must agree on (dtype, block shape)."""

    first_layer: int
    bases: tuple[tuple[int, int], ...]
    block_stride: int
    slab: int
    num_blocks: int
    dtype: str
    block_shape: tuple[int, ...]
    mem_type: str  # "DRAM" or "VRAM"
    device_id: int

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + len(self.bases))

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor], layers: range) -> PoolLayout:
        first = kv_caches[0]
        strides = {(c.stride(), c.dtype, tuple(c.shape)) for c in kv_caches}
        if len(strides) != 1:
            raise ValueError("every layer's cache must have the same shape, dtype and strides")
        elem = first.element_size()
        block_shape = tuple(first.shape[2:])
        slab = int(np.prod(block_shape)) * elem
        if not first[0, 0].is_contiguous():
            raise ValueError("each block of a layer's K (and V) must be contiguous")
        cuda = first.device.type == "cuda"
        return cls(
            first_layer=layers.start,
            bases=tuple((c[0].data_ptr(), c[1].data_ptr()) for c in kv_caches),
            block_stride=first.stride(1) * elem,
            slab=slab,
            num_blocks=first.shape[1],
            dtype=str(first.dtype),
            block_shape=block_shape,
            mem_type="VRAM" if cuda else "DRAM",
            device_id=(first.device.index or 0) if cuda else 0,
        )

    def addresses(self, block_ids: np.ndarray, layers: range) -> np.ndarray:
        """The address of every (layer, K or V, block) slab, layer-major, for model
        ``layers`` (within this pool's)."""
        lo = layers.start - self.first_layer
        bases = np.array(self.bases[lo : lo + len(layers)], dtype=np.uint64).reshape(-1, 1)
        offsets = block_ids.astype(np.uint64) * np.uint64(self.block_stride)
        addresses: np.ndarray = (bases + offsets.reshape(1, -1)).reshape(-1)
        return addresses

    def span(self, layers: range) -> int | None:
        """The bytes of one block's K and V of every layer in ``layers`` when they lie end to end
        (the block-first cache): a block's read is then one span, at ``block_addresses``.
        None when they do not (a cache of a tensor per layer)."""
        lo = layers.start - self.first_layer
        flat = [address for pair in self.bases[lo : lo + len(layers)] for address in pair]
        if any(b - a != self.slab for a, b in pairwise(flat)):
            return None
        return self.slab * len(flat)

    def block_addresses(self, block_ids: Sequence[int], layers: range) -> list[int]:
        """Where each block's span for ``layers`` starts (see ``span``)."""
        base, stride = self.bases[layers.start - self.first_layer][0], self.block_stride
        return [base + int(block) * stride for block in block_ids]

    def check_compatible(self, other: PoolLayout) -> None:
        if (self.dtype, self.block_shape) != (other.dtype, other.block_shape):
            raise ValueError(
                f"KV layouts differ: {self.dtype} blocks of {self.block_shape} here, "
                f"{other.dtype} blocks of {other.block_shape} at the source"
            )


@dataclass(frozen=True)
class NixlPeer:
    """What a worker publishes once per cache: its agent's name and metadata, its layout."""

    agent: str
    metadata: bytes
    layout: PoolLayout
    same_host: Token | None = None  # where a reader of this machine may copy from directly


@dataclass(frozen=True)
class NixlHandle:
    """A ``KVSegment.handle`` of this transport: a lease on the source worker's blocks.
    Small and picklable; it travels in ``kv_transfer_params``."""

    agent: str
    lease_id: str
    first_layer: int  # the model layers [first_layer, last_layer) the lease covers
    last_layer: int
    block_ids: tuple[int, ...]
    expires_at: float  # time.time() after which the source may reuse the blocks


def merge_descriptors(
    src: np.ndarray, dst: np.ndarray, length: int, src_dev: int = 0, dst_dev: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Pair up equal-size slabs (``src[i]`` -> ``dst[i]``, ``length`` bytes each) and merge
    every run that is contiguous on both sides into one descriptor. Returns the two NIXL
    descriptor lists (N x 3: address, bytes, device), in the same order."""
    order = np.argsort(src, kind="stable")
    s, d = src[order], dst[order]
    step = np.uint64(length)
    breaks = np.flatnonzero((s[1:] != s[:-1] + step) | (d[1:] != d[:-1] + step)) + 1
    starts = np.concatenate(([0], breaks))
    sizes = np.diff(np.append(starts, len(s))).astype(np.uint64) * step
    local = np.stack([d[starts], sizes, np.full(len(starts), dst_dev, np.uint64)], axis=1)
    remote = np.stack([s[starts], sizes, np.full(len(starts), src_dev, np.uint64)], axis=1)
    return local, remote


def merge_spans(
    src: Sequence[int], dst: Sequence[int], length: int, src_dev: int = 0, dst_dev: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``merge_descriptors`` for a few spans (a read's blocks, one span each), in plain
    Python: numpy's per-call cost is most of the time at a few dozen entries."""
    pairs = sorted(zip(src, dst, strict=True))
    local: list[tuple[int, int, int]] = []
    remote: list[tuple[int, int, int]] = []
    for s, d in pairs:
        if local and remote[-1][0] + remote[-1][1] == s and local[-1][0] + local[-1][1] == d:
            remote[-1] = (remote[-1][0], remote[-1][1] + length, src_dev)
            local[-1] = (local[-1][0], local[-1][1] + length, dst_dev)
        else:
            remote.append((s, length, src_dev))
            local.append((d, length, dst_dev))
    return np.array(local, dtype=np.uint64), np.array(remote, dtype=np.uint64)
