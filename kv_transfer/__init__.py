"""The KV connector: a role-split API (scheduler side / worker side) and transports (the Ray
object store, gRPC) that move KV blocks between workers on any nodes; and the tracing helpers
every span-emitting process shares (``kv_transfer.tracing``).

The scheduler side's abstract hooks are defined in ``scheduler.kv_connector`` (so the scheduler
depends on nothing above it); ``PDConnector`` implements them for prefill/decode hand-off.
Importing this package loads nothing heavy: the worker side (torch) loads on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kv_transfer.base import KVTransferParams, TransferRecord, WorkerConnector
    from kv_transfer.connector import (
        KVConnectorMetadata,
        KVConnectorReport,
        LoadSpec,
        PDConnector,
        SaveSpec,
    )
    from kv_transfer.registry import available_transports, create_worker_connector
    from scheduler.kv_connector import SchedulerConnector

_EXPORTS = {
    "KVTransferParams": "kv_transfer.base",
    "TransferRecord": "kv_transfer.base",
    "WorkerConnector": "kv_transfer.base",
    "KVConnectorMetadata": "kv_transfer.connector",
    "KVConnectorReport": "kv_transfer.connector",
    "LoadSpec": "kv_transfer.connector",
    "PDConnector": "kv_transfer.connector",
    "SaveSpec": "kv_transfer.connector",
    "available_transports": "kv_transfer.registry",
    "create_worker_connector": "kv_transfer.registry",
    "SchedulerConnector": "scheduler.kv_connector",
}

__all__ = [
    "KVConnectorMetadata",
    "KVConnectorReport",
    "KVTransferParams",
    "LoadSpec",
    "PDConnector",
    "SaveSpec",
    "SchedulerConnector",
    "TransferRecord",
    "WorkerConnector",
    "available_transports",
    "create_worker_connector",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
