"""Placement checks that fail fast, naming the pool, instead of leaving actors pending."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from cluster.config import ClusterConfig
from cluster.control.launch import local_node_resources
from cluster.control.placement import check_placeable

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


def test_local_node_resources_cover_every_custom_resource() -> None:
    assert local_node_resources(CONFIG) == {"decode": 1000.0, "prefill": 1000.0}
