"""Placement checks that fail fast, naming the pool, instead of leaving actors pending."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from cluster.config import ClusterConfig
from cluster.control.launch import local_node_resources
from cluster.control.placeable import check_placeable, launchable_node_groups
from tests.cluster.conftest import RayCluster

CONFIG = ClusterConfig.model_validate(
    {
        "pools": [
            {"name": "p", "role": "prefill", "resources": {"prefill": 0.01}},
            {"name": "d", "role": "decode", "resources": {"decode": 0.01}, "num_cpus": 1},
        ]
    }
)


def _node(alive: bool = True, **resources: float) -> dict[str, object]:
    return {"Alive": alive, "Resources": {"CPU": 2.0, "node:127.0.0.1": 1.0, **resources}}


def test_placeable_when_some_node_offers_each_pool() -> None:
    check_placeable(CONFIG, [_node(prefill=1.0), _node(decode=1.0)])
    check_placeable(CONFIG, [_node(**local_node_resources(CONFIG))])


def test_missing_resource_names_the_pool_and_what_nodes_offer() -> None:
    with pytest.raises(ValueError, match=r"pool 'd' needs .*decode.*offer: CPU, prefill"):
        check_placeable(CONFIG, [_node(prefill=1.0)])


def test_dead_nodes_and_missing_cpus_do_not_count() -> None:
    with pytest.raises(ValueError, match="pool 'd'"):
        check_placeable(CONFIG, [_node(prefill=1.0), _node(alive=False, decode=1.0)])
    no_cpu = {"Alive": True, "Resources": {"decode": 1.0, "prefill": 1.0}}
    with pytest.raises(ValueError, match="pool 'd'"):
        check_placeable(CONFIG, [no_cpu])


def test_a_node_group_the_ray_autoscaler_can_add_counts() -> None:
    """A KubeRay worker group of decode nodes, none running yet: the worker's pending demand
    is what makes the autoscaler add one, so the check lets it wait for it."""
    check_placeable(CONFIG, [_node(prefill=1.0)], [{"CPU": 4.0, "decode": 1.0}])
    with pytest.raises(ValueError, match="nor can the Ray autoscaler add one"):
        check_placeable(CONFIG, [_node(prefill=1.0)], [{"CPU": 4.0, "GPU": 1.0}])


def test_the_node_groups_are_read_as_the_autoscaler_publishes_them(
    ray_cluster: RayCluster,
) -> None:
    """Through the GCS, where the Ray autoscaler (v2, as KubeRay runs it) puts its node
    groups: one that may grow counts, one capped at 0 nodes does not."""
    import ray
    from ray.core.generated import autoscaler_pb2
    from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_put

    assert launchable_node_groups() == []  # no autoscaler here
    cluster = autoscaler_pb2.ClusterConfig()
    gpu = cluster.node_group_configs.add(name="gpu", min_count=0, max_count=4)
    gpu.resources.update({"CPU": 8, "GPU": 1})
    off = cluster.node_group_configs.add(name="off", min_count=0, max_count=0)
    off.resources.update({"CPU": 8, "decode": 1})
    namespace = ray._raylet.GCS_AUTOSCALER_STATE_NAMESPACE
    key = ray._raylet.GCS_AUTOSCALER_CLUSTER_CONFIG_KEY
    _internal_kv_put(key, cluster.SerializeToString(), overwrite=True, namespace=namespace)
    try:
        assert launchable_node_groups() == [{"CPU": 8.0, "GPU": 1.0}]
    finally:
        _internal_kv_del(key, namespace=namespace)
    assert launchable_node_groups() == []


def test_local_node_resources_cover_every_custom_resource() -> None:
    assert local_node_resources(CONFIG) == {"decode": 1000.0, "prefill": 1000.0}
    # Those only a pipeline stage asks for too (they could never be placed on a local Ray).
    staged = ClusterConfig.model_validate(
        {"pools": [{"name": "s", "pp_size": 2, "stage_resources": [{"s0": 1}, {"s1": 1}]}]}
    )
    assert local_node_resources(staged) == {"s0": 1000.0, "s1": 1000.0}
    check_placeable(staged, [_node(**local_node_resources(staged))])


def test_the_central_scheduler_goes_to_the_head_even_from_a_placement_group(
    ray_cluster: RayCluster,
) -> None:
    """Built from a task in a placement group that captures its children (a Serve replica
    given ``placement_group_bundles``), the central actor is not put in that group -- none of
    its bundles has the head node's resource: it waited there forever -- but on the head."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from cluster.control.launch import central_actor_options

    @ray.remote(num_cpus=0)
    class Central:
        # Async, as the SchedulerActor is: a sync class given the central options'
        # max_concurrency (10_000) is a threaded actor that starts 10,000 threads, each taking
        # the GIL, before it serves -- seconds on a loaded 2-core machine (and Ray aborts the
        # worker past 10 s) -- which the real, async, central actor never does.
        async def node_id(self) -> str:
            return str(ray.get_runtime_context().get_node_id())

    @ray.remote(num_cpus=0.01)
    def build() -> str:
        options = central_actor_options(CONFIG, "pg-central", "tandem-tests", detached=False)
        central = Central.options(**options).remote()  # type: ignore[attr-defined]
        try:
            return str(ray.get(central.node_id.remote(), timeout=90))  # (a worker starts)
        finally:
            ray.kill(central)

    group = placement_group([{"CPU": 0.01, "prefill": 0.01}])
    ray.get(group.ready(), timeout=30)
    try:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_capture_child_tasks=True)
        node = ray.get(build.options(scheduling_strategy=strategy).remote(), timeout=150)
    finally:
        remove_placement_group(group)
    assert node == ray_cluster.head_node_id


def test_a_grow_checks_only_the_pools_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill pool's node is gone (its instances failed): the decode pool still grows --
    ``start_instances`` checks the pools of the instances it starts, not every pool of the
    cluster (a ValueError naming pool 'p' refused it) -- and a prefill instance is still
    refused at once, naming its pool."""
    import asyncio

    import ray

    from cluster.control import placement

    class Checked(Exception):
        """Past the placement check (where the workers would be created)."""

    def worker_class() -> None:
        raise Checked

    monkeypatch.setattr(ray, "nodes", lambda: [_node(decode=1.0)])
    monkeypatch.setattr(placement, "launchable_node_groups", lambda: [])
    monkeypatch.setattr(placement, "worker_class", worker_class)
    config = CONFIG.with_kv_transport("ray")
    pools = {pool.name: pool for pool in config.pools}
    with pytest.raises(Checked):
        asyncio.run(placement.start_instances(config, [("d-1", pools["d"])], 1.0))
    with pytest.raises(ValueError, match="pool 'p' needs"):
        asyncio.run(placement.start_instances(config, [("p-1", pools["p"])], 1.0))
