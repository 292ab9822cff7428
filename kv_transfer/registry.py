"""Transports by name (``KVTransferConfig.transport``), imported only when used."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (the central scheduler asks for the names, in a process without torch)
    from kv_transfer.base import WorkerConnector

_TRANSPORTS = {
    "ray": "kv_transfer.ray_transport:RayWorkerConnector",
    "grpc": "kv_transfer.grpc_transport:GrpcWorkerConnector",
    "nixl": "kv_transfer.nixl_transport:NixlWorkerConnector",  # the [nixl] extra
}


def available_transports() -> list[str]:
    return sorted(_TRANSPORTS)


def create_worker_connector(transport: str, **options: Any) -> WorkerConnector:
    """A new worker-side connector for ``transport`` built with the transport's ``options``
    (``KVTransferConfig.connector_options``); ``ValueError`` names the known transports."""
    target = _TRANSPORTS.get(transport)
    if target is None:
        raise ValueError(
            f"unknown KV transport {transport!r}; available: {', '.join(available_transports())}"
        )
    module_name, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    connector: WorkerConnector = cls(**options)
    return connector
