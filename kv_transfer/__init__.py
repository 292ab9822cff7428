"""The KV connector: a role-split API (scheduler side / worker side) and transports (the Ray
object store, gRPC) that move KV blocks between workers on any nodes.

The scheduler side's abstract hooks are defined in ``scheduler.kv_connector`` (so the scheduler
depends on nothing above it); ``PDConnector`` implements them for prefill/decode hand-off.
"""

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
