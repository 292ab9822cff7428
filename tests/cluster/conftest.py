"""A real multi-node Ray cluster on this machine, and helpers to build Tandem clusters on it.

One ``ray.cluster_utils.Cluster`` per test session: a head, a node offering the ``prefill``
resource and one offering ``decode``, all on 127.0.0.1 (see docs/cluster.md). Tandem clusters
(SchedulerActor + workers) are built per module and checked for leaks after every test.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from cluster.launch import ray_env_defaults  # noqa: E402

OBJECT_STORE_BYTES = 96 << 20


@dataclass
class RayCluster:
    cluster: Any
    prefill_node_id: str
    decode_node_id: str
    head_node_id: str


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[RayCluster]:
    from ray.cluster_utils import Cluster

    ray_env_defaults()
    # Ray's socket paths must stay short: a fresh directory directly under the temp root.
    tmp = tempfile.mkdtemp(prefix="tandem-ray-")
    os.environ["RAY_TMPDIR"] = tmp
    node = {"node_ip_address": "127.0.0.1", "object_store_memory": OBJECT_STORE_BYTES}
    cluster = Cluster(
        initialize_head=True,
        head_node_args={**node, "num_cpus": 2, "include_dashboard": False},
    )
    try:
        prefill = cluster.add_node(num_cpus=1, resources={"prefill": 1}, **node)
        decode = cluster.add_node(num_cpus=1, resources={"decode": 1}, **node)
        ray.init(
            address=cluster.address,
            _node_ip_address="127.0.0.1",
            namespace="tandem-tests",
            log_to_driver=False,
        )
        yield RayCluster(cluster, prefill.node_id, decode.node_id, cluster.head_node.node_id)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.model.conftest import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny-llama-cluster"), "llama")


def plasma_objects() -> int:
    """Objects in the object stores of all nodes."""
    from ray._private.internal_api import memory_summary

    summary = memory_summary(stats_only=True)
    for line in summary.splitlines():
        if "Plasma memory usage" in line:
            return int(line.split(",")[1].split()[0])
    raise AssertionError(f"no object store stats in:\n{summary}")


# Copies that outlive a dead owner: after a process that put an object dies while another
# node is pulling it, Ray can keep that node's copy with no owner and no reference left (see
# docs/cluster.md, faults). Fault tests accept them explicitly; later tests check against it.
_orphans = 0


def accept_orphaned_objects(settle_s: float = 3.0) -> int:
    """After a fault (and after ``assert_clean(..., objects=False)``): the objects still in
    the stores once Ray has freed what it frees on its own become the floor for every later
    leak check. Returns how many there are."""
    global _orphans
    time.sleep(settle_s)
    _orphans = max(_orphans, plasma_objects())
    return _orphans


def wait_until(predicate: Any, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def assert_clean(handle: Any, timeout_s: float = 10.0, objects: bool = True) -> None:
    """Nothing left anywhere: no request in any scheduler or in flight, every block free,
    no connector state, consistent schedulers, and (``objects``) no KV object in the object
    store."""

    def idle() -> bool:
        stats = ray.get(handle.stats.remote())
        if stats["num_flights"]:
            return False
        return all(
            i["num_requests"] == 0
            and i["num_pending"] == 0
            and i["kv_cache_usage"] == 0.0
            and i["num_free_blocks"] == i["num_blocks"]
            and i["connector_pending"] == 0
            for i in stats["instances"].values()
        )

    wait_until(idle, timeout_s, "every instance to be idle with all blocks free")
    ray.get(handle.check_integrity.remote())
    if objects:
        try:
            wait_until(
                lambda: plasma_objects() <= _orphans,
                timeout_s,
                f"the object stores to be empty (but for {_orphans} accepted orphans)",
            )
        except AssertionError as e:
            from ray._private.internal_api import memory_summary

            raise AssertionError(
                f"{e}; what is left:\n{memory_summary(stats_only=False)}"
            ) from None
