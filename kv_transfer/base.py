"""The worker side of a KV connector, and the shape of ``kv_transfer_params``.

Per-step order on a worker (DESIGN §3.2, as in vLLM v1)::

    bind the step's connector metadata
    start_load_kv(...)                 loads of remote KV into this step's blocks begin
    for each layer:
        wait_for_layer_load(layer)     before attention reads the layer's KV
        save_kv_layer(layer, ...)      after the layer's KV is written (prefill side)
    wait_for_save()                    saves of this step are complete
    get_finished(finished_req_ids)     -> (sending done, receiving done, failed receives)

The three sets travel back in ``ModelRunnerOutput.finished_sending / finished_recving /
failed_recving``. No implementation lives here yet: the Ray and gRPC transports arrive with
the cluster issues and subclass ``WorkerConnector``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, TypedDict


class KVTransferParams(TypedDict, total=False):
    """Where a request's KV is and what to do with it; a plain dict on the request."""

    do_remote_prefill: bool  # decode side: load the prompt's KV instead of computing it
    do_remote_decode: bool  # prefill side: keep the KV for a decode instance to take
    remote_instance_id: str
    remote_block_ids: list[int]
    remote_num_tokens: int
    handle: Any  # transport-specific: an object reference, or a gRPC address + token
    deadline: float  # absolute time (time.time()) after which the load counts as failed


class WorkerConnector(ABC):
    """Hooks a model worker calls around its forward pass to move KV blocks.

    ``transport`` names the implementation in config (``ray``, ``grpc``); capabilities are
    class attributes so the control plane can check a pairing without instantiating it.
    """

    transport: str = ""
    supports_cross_node: bool = False
    supports_layer_ranges: bool = False  # can move a pipeline stage's layer range alone

    @abstractmethod
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """The worker's KV cache tensors, by layer name, once allocated."""

    @abstractmethod
    def start_load_kv(self, metadata: Any) -> None:
        """Begin loading the remote KV named in this step's metadata into local blocks."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the layer's loads of this step are in place."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, metadata: Any) -> None:
        """Save the layer's KV for requests that hand off to a decode instance."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Block until this step's saves are complete (their blocks may then be reused)."""

    @abstractmethod
    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None, set[str] | None]:
        """``(sending done, receiving done, receives failed)`` since the last call."""
