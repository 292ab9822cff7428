"""The KV connector: a role-split API (scheduler side / worker side) and, in later issues,
transports (Ray object store, gRPC) that move KV blocks between workers on any nodes.

The scheduler side is defined in ``scheduler.kv_connector`` (so the scheduler depends on
nothing above it) and re-exported here with the worker side.
"""

from kv_transfer.base import KVTransferParams, WorkerConnector
from scheduler.kv_connector import SchedulerConnector

__all__ = ["KVTransferParams", "SchedulerConnector", "WorkerConnector"]
