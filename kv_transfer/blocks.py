"""Copy a request's KV blocks out of a worker's paged cache and into another's.

Every transport moves the same thing: for each layer of a range, the K and V slabs of a list of
blocks. A worker's cache is one buffer, block first (``allocate_kv_caches``)::

    pool          [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    kv_caches[l]  pool[:, l].transpose(0, 1): [2, num_blocks, block_size, kv_heads, head_dim]

so the model sees the per-layer layout of ``actors.model.attention`` (as views with a block
stride), while everything one block holds, every layer's K and V, is one contiguous span: a
run of adjacent blocks is one span of memory, which a one-sided transport (``nixl``) reads with
one descriptor. One request's blocks pack into::

    data[layer - first_layer, kv, i] = kv_caches[layer][kv, block_ids[i]]
    shape [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]

A layer range lets pipeline stages send and receive only the layers they hold. The packed array
is numpy (Ray's object store shares numpy arrays zero-copy on a node; pickled tensors are not);
bfloat16, which numpy lacks, travels as its raw 16-bit pattern.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "KVPayload",
    "allocate_kv_caches",
    "extract_blocks",
    "gather_blocks",
    "insert_blocks",
    "scatter_blocks",
]


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """A zeroed paged cache: one block-first buffer, returned as one view per layer
    (``[2, num_blocks, block_size, kv_heads, head_dim]``, block stride = a whole block of every
    layer). The views keep the buffer alive.

    On CPU the buffer comes from numpy, which asks the kernel for transparent huge pages on
    large allocations (``madvise``): a cross-process copy of KV blocks (NIXL's kernel copy
    pins the pages it reads) runs 2-2.5x faster on them here than on torch's 4 KiB pages."""
    shape = (num_blocks, num_layers, 2, block_size, kv_heads, head_dim)
    if torch.device(device).type == "cpu":
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        pool = torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(dtype).view(shape)
        pool.zero_()  # touched now: a cache that does not fit fails at start, not under load
    else:
        pool = torch.zeros(shape, dtype=dtype, device=device)
    return [pool[:, layer].transpose(0, 1) for layer in range(num_layers)]


def extract_blocks(
    kv_caches: list[torch.Tensor], block_ids: list[int], layers: range | None = None
) -> np.ndarray:
    """A fresh numpy array holding ``block_ids`` of the given layers (all by default)."""
    layers = range(len(kv_caches)) if layers is None else layers
    _check_layers(kv_caches, layers)
    first = kv_caches[layers[0]]
    index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    # One copy: each layer's blocks are gathered straight into their slot of the result.
    packed = torch.empty(
        (len(layers), 2, len(block_ids), *first.shape[2:]), dtype=first.dtype, device=first.device
    )
    for i, layer in enumerate(layers):
        torch.index_select(kv_caches[layer], 1, index, out=packed[i])
    if packed.dtype == torch.bfloat16:
        packed = packed.view(torch.int16)
    return packed.cpu().numpy()


def insert_blocks(
    kv_caches: list[torch.Tensor],
    block_ids: list[int],
    data: np.ndarray,
    layers: range | None = None,
) -> None:
    """Write ``data`` (from ``extract_blocks``) into ``block_ids`` of the given layers.
    Shapes are checked first: a mismatch raises before anything is written."""
    layers = range(len(kv_caches)) if layers is None else layers
    _check_layers(kv_caches, layers)
    cache = kv_caches[layers[0]]
    expected = (len(layers), 2, len(block_ids), *cache.shape[2:])
    if tuple(data.shape) != expected:
        raise ValueError(f"KV data has shape {tuple(data.shape)}, expected {expected}")
    with warnings.catch_warnings():
        # A zero-copy buffer from the object store is read-only; it is only read here.
        warnings.simplefilter("ignore", UserWarning)
        source = torch.from_numpy(np.ascontiguousarray(data))
    if cache.dtype == torch.bfloat16:
        if source.dtype != torch.int16:
            raise ValueError(f"bfloat16 caches take int16 bit patterns, not {source.dtype}")
        source = source.view(torch.bfloat16)
    elif source.dtype != cache.dtype:
        raise ValueError(f"KV data is {source.dtype}, the cache is {cache.dtype}")
    source = source.to(cache.device)
    index = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    for i, layer in enumerate(layers):
        kv_caches[layer].index_copy_(1, index, source[i])


def _check_layers(kv_caches: list[torch.Tensor], layers: range) -> None:
    if len(layers) == 0 or layers.start < 0 or layers.stop > len(kv_caches) or layers.step != 1:
        raise ValueError(f"layer range {layers} is not within the {len(kv_caches)} layers")


# -- the transport format: contiguous pieces, gathered without a copy ---------------------------
@dataclass
class KVPayload:
    """One request's KV blocks for a layer range, as contiguous numpy pieces.

    Block ids are split into runs of consecutive ids, ascending or descending (a freed table
    returns to the pool tail first, so fresh allocations often count down); each (layer, K or
    V, run) is one piece, a plain slice of the cache, so gathering copies nothing::

        block_ids  7 8 9 | 2 | 6 5          runs = [3, 1, 2], descending = [F, F, T]
        pieces     [(layer i, kv, run r) for i in layers for kv in (K, V) for r in runs]
                   piece shape [run length, block_size, kv_heads, head_dim], rows in
                   ascending id order (a descending run's rows are its blocks backwards)

    Pieces gathered from a cache are views: valid until those blocks change, so a transport
    copies them out at once (``ray.put`` does; the decode side reads its copy zero-copy).

    From a block-first cache (``allocate_kv_caches``) a run's blocks of every layer are one
    contiguous span of memory, so a payload gathered whole from one carries ``spans`` (per run,
    ``[run length, num_layers, 2, block_size, kv_heads, head_dim]``) and its pieces are views of
    them. Pickled, only the spans travel: contiguous buffers that ``ray.put`` stores out of
    band and ``ray.get`` maps back without a copy (strided pieces would be copied in band).
    """

    runs: list[int]
    pieces: list[np.ndarray]
    num_layers: int
    bfloat16: bool  # pieces hold bfloat16 bit patterns as int16
    descending: list[bool] | None = None  # per run; None: all ascending
    first_layer: int = 0  # the model layer of layer index 0 (a pipeline stage's range)
    spans: list[np.ndarray] | None = None  # per run, every layer (block-first caches)

    def __post_init__(self) -> None:
        if self.spans is not None and not self.pieces:
            self.pieces = _pieces_of(self.spans, self.num_layers)

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        if self.spans is not None:
            state["pieces"] = []  # views of the spans: rebuilt on arrival
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    @property
    def layers(self) -> range:
        """The model layers this payload holds."""
        return range(self.first_layer, self.first_layer + self.num_layers)

    @property
    def num_blocks(self) -> int:
        return sum(self.runs)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    def piece(self, layer_index: int, kv: int, run: int) -> np.ndarray:
        return self.pieces[(layer_index * 2 + kv) * len(self.runs) + run]

    def copy(self) -> KVPayload:
        """A payload that owns its memory (for transports that keep it in process)."""
        if self.spans is not None:
            return KVPayload(
                list(self.runs),
                [],
                self.num_layers,
                self.bfloat16,
                None if self.descending is None else list(self.descending),
                self.first_layer,
                [span.copy() for span in self.spans],
            )
        return KVPayload(
            list(self.runs),
            [p.copy() for p in self.pieces],
            self.num_layers,
            self.bfloat16,
            None if self.descending is None else list(self.descending),
            self.first_layer,
        )


def _pieces_of(spans: list[np.ndarray], num_layers: int) -> list[np.ndarray]:
    """The (layer, K or V, run) pieces of block-first spans, as views."""
    return [span[:, layer, kv] for layer in range(num_layers) for kv in (0, 1) for span in spans]


def _block_first_pool(kv_caches: list[torch.Tensor], layers: range) -> np.ndarray | None:
    """The numpy view of the block-first buffer behind ``kv_caches`` when they are exactly its
    per-layer views (``allocate_kv_caches``) and ``layers`` is all of them; else None."""
    first = kv_caches[0]
    if layers != range(len(kv_caches)) or first.dim() != 5 or first.device.type != "cpu":
        return None
    _, num_blocks, *block = first.shape
    shape = (num_blocks, len(kv_caches), 2, *block)
    strides = torch.empty(0).new_empty(shape, device="meta").stride()  # C order
    expected = (strides[2], strides[0], *strides[3:])  # a layer's view of that buffer
    step = strides[1] * first.element_size()
    for i, cache in enumerate(kv_caches):
        if cache.stride() != expected or cache.data_ptr() != first.data_ptr() + i * step:
            return None
    pool = torch.as_strided(first, shape, strides, first.storage_offset())
    return _numpy_view(pool)


def _runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """(first id, length, step) of each run of consecutive ids, in order; step is +1 or -1."""
    runs: list[tuple[int, int, int]] = []
    for block_id in block_ids:
        if runs:
            first, n, step = runs[-1]
            if n == 1 and abs(block_id - first) == 1:
                runs[-1] = (first, 2, block_id - first)
                continue
            if n > 1 and block_id == first + step * n:
                runs[-1] = (first, n + 1, step)
                continue
        runs.append((block_id, 1, 1))
    return runs


def _lowest(first: int, n: int, step: int) -> int:
    return first if step == 1 else first - n + 1


def _numpy_view(cache: torch.Tensor) -> np.ndarray:
    """The tensor as numpy (bfloat16 as int16 bits): a view on CPU, a host copy otherwise."""
    t = cache.view(torch.int16) if cache.dtype == torch.bfloat16 else cache
    return t.cpu().numpy()


def gather_blocks(
    kv_caches: list[torch.Tensor], block_ids: list[int], layers: range | None = None
) -> KVPayload:
    """``block_ids`` of the given layers (all by default) as a payload of views (no copy on
    CPU)."""
    layers = range(len(kv_caches)) if layers is None else layers
    _check_layers(kv_caches, layers)
    bf16 = kv_caches[layers[0]].dtype == torch.bfloat16
    if kv_caches[layers[0]].device.type != "cpu":
        # A device cache: gather the request's blocks on the device, copy only those to the
        # host (one run per layer and K/V), never the whole cache.
        index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[layers[0]].device)
        host: list[np.ndarray] = []
        for layer in layers:
            blocks = kv_caches[layer].index_select(1, index)
            host.extend(_numpy_view(blocks)[kv] for kv in (0, 1))
        return KVPayload([len(block_ids)], host, len(layers), bf16)
    runs = _runs(block_ids)
    spans = [(_lowest(first, n, step), n) for first, n, step in runs]
    descending = [step == -1 for _, _, step in runs]
    lengths = [n for _, n, _ in runs]
    pool = _block_first_pool(kv_caches, layers)
    if pool is not None:  # one contiguous span per run, every layer
        return KVPayload(
            lengths,
            [],
            len(layers),
            bf16,
            descending if any(descending) else None,
            spans=[pool[lo : lo + n] for lo, n in spans],
        )
    pieces: list[np.ndarray] = []
    for layer in layers:
        array = _numpy_view(kv_caches[layer])
        for kv in (0, 1):
            pieces.extend(array[kv, lo : lo + n] for lo, n in spans)
    return KVPayload(lengths, pieces, len(layers), bf16, descending if any(descending) else None)


def scatter_blocks(
    kv_caches: list[torch.Tensor],
    block_ids: list[int],
    payload: KVPayload,
    first_block: int = 0,
    layers: range | None = None,
    payload_layer_offset: int | None = None,
) -> int:
    """Write the payload's blocks ``[first_block, first_block + len(block_ids))`` into
    ``block_ids`` of the given layers (cache indices); returns the bytes written. Cache layer
    ``layers[i]`` takes payload layer ``payload_layer_offset + i``; without an offset the
    payload's layers must be exactly ``layers`` (a pipeline stage takes a sub-range of a wider
    payload by giving one). Everything is checked before the first write: a mismatch raises
    ``ValueError`` and leaves the cache untouched."""
    layers = range(len(kv_caches)) if layers is None else layers
    _check_layers(kv_caches, layers)
    cache = kv_caches[layers[0]]
    count = len(block_ids)
    if payload_layer_offset is None:
        if payload.num_layers != len(layers):
            raise ValueError(f"KV payload has {payload.num_layers} layers, expected {len(layers)}")
        payload_layer_offset = 0
    if payload_layer_offset < 0 or payload_layer_offset + len(layers) > payload.num_layers:
        raise ValueError(
            f"KV payload has {payload.num_layers} layers; layers [{payload_layer_offset}, "
            f"{payload_layer_offset + len(layers)}) were asked for"
        )
    if first_block < 0 or payload.num_blocks < first_block + count:
        raise ValueError(
            f"the source holds {payload.num_blocks} blocks, blocks [{first_block}, "
            f"{first_block + count}) were asked for"
        )
    if payload.bfloat16 != (cache.dtype == torch.bfloat16):
        raise ValueError("KV payload and cache disagree on bfloat16")
    expected = (tuple(cache.shape[2:]), np.dtype(np.int16) if payload.bfloat16 else None)
    for piece in payload.pieces:
        if tuple(piece.shape[1:]) != expected[0]:
            raise ValueError(f"KV piece has block shape {piece.shape[1:]}, expected {expected[0]}")
        if not payload.bfloat16 and torch.from_numpy(np.empty(0, piece.dtype)).dtype != cache.dtype:
            raise ValueError(f"KV payload is {piece.dtype}, the cache is {cache.dtype}")
    segments = _segments(payload, first_block, _runs(block_ids))
    written = 0
    with warnings.catch_warnings():
        # Zero-copy buffers from the object store are read-only; they are only read here.
        warnings.simplefilter("ignore", UserWarning)
        for i, layer in enumerate(layers):
            target = kv_caches[layer]
            if target.dtype == torch.bfloat16:
                target = target.view(torch.int16)
            host = target.numpy() if target.device.type == "cpu" else None
            for kv in (0, 1):
                for run, row, dst, n, flip in segments:
                    piece = payload.piece(payload_layer_offset + i, kv, run)[row : row + n]
                    if host is not None:  # numpy's copy is ~20% faster than torch's here
                        np.copyto(host[kv, dst : dst + n], piece[::-1] if flip else piece)
                    else:
                        source = torch.from_numpy(piece)
                        target[kv, dst : dst + n].copy_(source.flip(0) if flip else source)
                    written += piece.nbytes
    return written


def _segments(
    payload: KVPayload, first: int, dst_runs: list[tuple[int, int, int]]
) -> list[tuple[int, int, int, int, bool]]:
    """Copies that move payload blocks ``[first, ...)`` into the destination runs, as
    (source run, first piece row, lowest destination id, length, reversed): each copies a
    contiguous slice of a piece onto a contiguous slice of the cache."""
    runs = payload.runs
    descending = payload.descending or [False] * len(runs)
    segments = []
    run, offset = 0, first  # position in the payload's block order
    while run < len(runs) and offset >= runs[run]:
        offset -= runs[run]
        run += 1
    for dst_first, length, dst_step in dst_runs:
        done = 0
        while done < length:
            n = min(length - done, runs[run] - offset)
            # Piece rows of payload blocks [offset, offset + n) of this run.
            src_desc = descending[run]
            row = runs[run] - offset - n if src_desc else offset
            # Destination ids of destination positions [done, done + n) of this run.
            dst_desc = dst_step == -1
            dst = dst_first - done - n + 1 if dst_desc else dst_first + done
            segments.append((run, row, dst, n, src_desc != dst_desc))
            done, offset = done + n, offset + n
            if offset == runs[run]:
                run, offset = run + 1, 0
    return segments
