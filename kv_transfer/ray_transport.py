"""The ``ray`` KV transport: saved KV goes into the Ray object store as one numpy array.

The prefill worker ``ray.put``s the request's blocks (a ``KVPayload``: from the workers'
block-first cache one contiguous span of every layer per run of adjacent blocks, views of the
cache, so the put is the only copy on that side) and hands the ``ObjectRef`` to the scheduler;
the reference travels inside ``kv_transfer_params`` to the decode instance, whose worker
``ray.get``s it (zero-copy from shared memory on the same node, pulled by Ray's object manager
from another node) and writes it into its own blocks.

Lifetime follows Ray's reference counting: the object lives while the decode request's params
or a load in progress hold the reference, and is freed when the load ends (the scheduler drops
the handle) or when the request ends. The prefill side keeps nothing, so its blocks are freed
as soon as the copy is made. If the owner (the prefill worker process) dies, the fetch fails
fast with ``OwnerDiedError`` and the decode side recomputes.
"""

from __future__ import annotations

from typing import Any

import ray

from kv_transfer.base import WorkerConnector
from kv_transfer.blocks import KVPayload


class RayWorkerConnector(WorkerConnector):
    transport = "ray"
    supports_cross_node = True
    supports_layer_ranges = True

    def _save(self, req_id: str, data: KVPayload) -> Any:
        return ray.put(data)  # copies the pieces into the object store before returning

    def _fetch(self, handle: Any, layers: range, timeout_s: float) -> KVPayload:
        # The object holds the source stage's layers; the caller writes the ones it needs.
        data = ray.get(handle, timeout=max(timeout_s, 0.001))
        if not isinstance(data, KVPayload):
            raise TypeError(f"KV object holds {type(data).__name__}, not a KVPayload")
        return data
