"""``get_or_build_cluster`` finds a cluster by name that another process created but has not
started (two Serve replicas at once; or its builder died before starting it): it is returned
started, and a start that overlaps another one starts no second set of workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cluster.config import ClusterConfig
from tests.cluster.conftest import RayCluster, assert_clean
from tests.cluster.control.helpers import BOTH, cluster_config

ray = pytest.importorskip("ray")

from cluster.control.client import ClusterClient  # noqa: E402
from cluster.control.launch import (  # noqa: E402
    get_or_build_cluster,
    scheduler_actor_class,
    shutdown_cluster,
)
from cluster.control.placement import worker_actor_prefix  # noqa: E402
from scheduler import SamplingParams  # noqa: E402

NAMESPACE = "tandem-tests"


def unstarted(config: ClusterConfig, name: str) -> Any:
    """What a builder leaves when it stops after creating the actor (or while it starts it)."""
    options = {"name": name, "namespace": NAMESPACE, "num_cpus": 0, "max_restarts": -1}
    return scheduler_actor_class().options(max_concurrency=10_000, **options).remote(config)


def workers_of(handle: Any) -> list[str]:
    prefix = worker_actor_prefix(handle._actor_id.hex())
    named = ray.util.list_named_actors(all_namespaces=True)
    return [e["name"] for e in named if e["name"].startswith(prefix)]


def test_a_cluster_found_unstarted_is_started(ray_cluster: RayCluster, tiny_model: Path) -> None:
    config = cluster_config(tiny_model, [BOTH], engine_actors=True)
    created = unstarted(config, "adopted")
    handle = get_or_build_cluster(config, name="adopted", namespace=NAMESPACE)
    try:
        assert handle._actor_id == created._actor_id
        out = ClusterClient(handle).generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4
        assert_clean(handle)
    finally:
        shutdown_cluster(handle)


def test_a_name_taken_while_building_uses_the_cluster_that_took_it(
    ray_cluster: RayCluster, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two replicas look the name up at once, find none, and both build: the second's
    creation meets the name taken (not an error that fails its replica): it uses the
    first's cluster, started."""
    from cluster.control import launch

    config = cluster_config(tiny_model, [BOTH], engine_actors=True)
    created = unstarted(config, "raced")
    looked = []

    def first_finds_none(name: str, namespace: str) -> Any:
        looked.append(name)
        if len(looked) == 1:  # the other replica's actor is named just after this look-up
            raise ValueError(f"no actor {name}")
        return ray.get_actor(name, namespace=namespace)

    monkeypatch.setattr(launch, "get_cluster", first_finds_none)
    handle = get_or_build_cluster(config, name="raced", namespace=NAMESPACE)
    try:
        assert handle._actor_id == created._actor_id and len(looked) == 2
        out = ClusterClient(handle).generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        assert len(out[0].outputs[0].token_ids) == 2
        assert len(workers_of(handle)) == 1  # no second cluster's workers left behind
    finally:
        shutdown_cluster(handle)


def test_starts_at_the_same_time_start_one_set_of_workers(
    ray_cluster: RayCluster, tiny_model: Path
) -> None:
    handle = unstarted(cluster_config(tiny_model, [BOTH], engine_actors=True), "started-twice")
    try:
        first, second = handle.start.remote(), handle.start.remote()
        assert ray.get(first, timeout=120) == ray.get(second, timeout=120)
        assert len(workers_of(handle)) == 1  # one instance of one stage
        assert_clean(handle)
    finally:
        shutdown_cluster(handle)


def test_the_central_scheduler_runs_on_the_head_node_wherever_it_is_built(
    ray_cluster: RayCluster, tiny_model: Path
) -> None:
    """A builder on a worker node (a Serve replica there) puts the central scheduler on the
    head: a worker node that goes never takes the control plane with it."""

    @ray.remote(num_cpus=0, resources={"decode": 0.001})
    def build_here(config: ClusterConfig) -> tuple[str, list[Any]]:
        from cluster.control.launch import build_cluster

        handle = build_cluster(config, name="built-on-a-worker", namespace=NAMESPACE, detached=True)
        return ray.get_runtime_context().get_node_id(), [handle]

    config = cluster_config(tiny_model, [BOTH], engine_actors=True)
    builder_node, (handle,) = ray.get(build_here.remote(config), timeout=180)
    try:
        assert builder_node == ray_cluster.decode_node_id
        central_node = ray.get(
            handle.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
        )
        assert central_node == ray_cluster.head_node_id
    finally:
        shutdown_cluster(handle)
