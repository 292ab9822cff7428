"""``WorkerKV``: a ``ModelWorker``'s KV connector -- made, given the cache, switched to
another transport -- and the peers it reads from (a mixin of ``actors.worker.ModelWorker``)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kv_transfer.base import WorkerConnector

logger = logging.getLogger(__name__)


class WorkerKV:
    """The KV transport's side in a worker (a mixin of ``ModelWorker``)."""

    # What of the worker this uses (annotations only).
    connector: WorkerConnector | None
    kv_transfer: str | None
    kv_transfer_options: dict[str, Any]
    kv_transfer_fallback: str | None
    kv_caches: list[torch.Tensor]
    layers: range
    tracing: Any
    _step_lock: threading.Lock

    # -- KV transport peers ---------------------------------------------------------------
    def kv_peer(self) -> Any:
        """What other workers need to read this worker's KV blocks (``nixl``: its agent and
        pool layout), or None for a transport that needs nothing published."""
        if self.connector is None:
            return None
        with self._step_lock:  # the transport's agent is not thread-safe (probes run apart)
            return self.connector.peer_info()

    def add_kv_peers(self, peers: list[Any]) -> None:
        """Learn other workers' ``kv_peer`` (the control plane calls this when instances
        register)."""
        if self.connector is not None:
            with self._step_lock:  # the transport's agent is not thread-safe
                self.connector.add_peers(peers)

    def remove_kv_peers(self, names: list[str]) -> None:
        """Forget the workers named ``names`` (``kv_peer`` names): they left the cluster."""
        if self.connector is not None:
            with self._step_lock:
                self.connector.remove_peers(names)

    def kv_probe(self, peer: Any, timeout_s: float = 5.0) -> str | None:
        """Read a little of ``peer``'s cache (into scratch space, not this worker's cache:
        safe while serving): None when the transport reaches it, else why not."""
        if self.connector is None:
            return "no KV connector"
        probe = getattr(self.connector, "probe", None)
        if probe is None:
            return None  # nothing to probe: the transport needs no direct reach
        try:  # the lock only around each use of the agent: steps go on while it waits
            probe(peer, timeout_s, lock=self._step_lock)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def use_kv_transport(self, transport: str, options: dict[str, Any]) -> None:
        """Switch to another KV transport (``transport: auto`` falling back before serving):
        the old connector closes, the new one takes the current cache."""
        with self._step_lock:
            if self.connector is not None:
                self.connector.close()
                self.connector = None
            self.kv_transfer, self.kv_transfer_options = transport, dict(options)
            if self.kv_caches:
                self._attach_connector()

    def _attach_connector(self) -> None:
        """Give the connector (made now if there is none) the current cache. A transport
        that cannot be made or set up here gives way to ``kv_transfer_fallback``."""
        try:
            if self.connector is None:
                self.connector = self._new_connector(self.kv_transfer, self.kv_transfer_options)
            self.connector.register_kv_caches(self.kv_caches, self.layers)
        except Exception as exc:
            fallback = self.kv_transfer_fallback
            if fallback is None or fallback == self.kv_transfer:
                raise
            logger.warning(
                "KV transport %s unusable here (%s: %s); using %s",
                self.kv_transfer,
                type(exc).__name__,
                exc,
                fallback,
            )
            if self.connector is not None:
                self.connector.close()
            self.kv_transfer, self.kv_transfer_options = fallback, {}
            self.connector = self._new_connector(fallback, {})
            self.connector.register_kv_caches(self.kv_caches, self.layers)

    def _new_connector(self, transport: str | None, options: dict[str, Any]) -> WorkerConnector:
        from kv_transfer.registry import create_worker_connector

        assert transport is not None
        connector = create_worker_connector(transport, **options)
        if self.tracing is not None:
            from kv_transfer.tracing import init_tracing

            connector.tracer = init_tracing(self.tracing, "worker")
        return connector
