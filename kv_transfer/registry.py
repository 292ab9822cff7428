"""Transports by name (``KVTransferConfig.transport``), imported only when used."""

from __future__ import annotations

import importlib

from kv_transfer.base import WorkerConnector

_TRANSPORTS = {
    "ray": "kv_transfer.ray_transport:RayWorkerConnector",
}


def available_transports() -> list[str]:
    return sorted(_TRANSPORTS)


def create_worker_connector(transport: str) -> WorkerConnector:
    """A new worker-side connector for ``transport``; ``ValueError`` names the known ones."""
    target = _TRANSPORTS.get(transport)
    if target is None:
        raise ValueError(
            f"unknown KV transport {transport!r}; available: {', '.join(available_transports())}"
        )
    module_name, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    connector: WorkerConnector = cls()
    return connector
