"""Copy a request's KV blocks out of a worker's paged cache and into another's.

Every transport moves the same thing: for each layer of a range, the K and V slabs of a list of
blocks. With the cache layout of ``actors.model.attention`` (per layer
``[2, num_blocks, block_size, kv_heads, head_dim]``) one request's blocks pack into::

    data[layer - first_layer, kv, i] = kv_caches[layer][kv, block_ids[i]]
    shape [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]

A layer range lets pipeline stages send and receive only the layers they hold. The packed array
is numpy (Ray's object store shares numpy arrays zero-copy on a node; pickled tensors are not);
bfloat16, which numpy lacks, travels as its raw 16-bit pattern.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

__all__ = ["extract_blocks", "insert_blocks"]


def extract_blocks(
    kv_caches: list[torch.Tensor], block_ids: list[int], layers: range | None = None
) -> np.ndarray:
    """A fresh numpy array holding ``block_ids`` of the given layers (all by default)."""
    layers = range(len(kv_caches)) if layers is None else layers
    _check_layers(kv_caches, layers)
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    packed = torch.stack([kv_caches[layer].index_select(1, index) for layer in layers])
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
