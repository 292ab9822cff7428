"""Pools resized while the cluster serves (``SchedulerActor.scale_pool``): a new decode
instance starts and takes requests; a removed one drains -- the requests it holds finish there,
or move when the drain time is up -- with outputs equal to the in-process engine's and every
block freed; a pool cannot lose its last instance. A real multi-node ``ray.cluster_utils``
cluster (tests/cluster/conftest)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import RayCluster, assert_clean, wait_until
from tests.cluster.control.helpers import DECODE, PREFILL, cluster_config, generate_in_process

ray = pytest.importorskip("ray")

from cluster.control.client import ClusterClient  # noqa: E402
from cluster.control.launch import build_cluster, shutdown_cluster  # noqa: E402
from scheduler import SamplingParams  # noqa: E402

LONG = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_cluster: RayCluster, tiny_model: Path) -> Iterator[Any]:
    config = cluster_config(tiny_model, [PREFILL, DECODE], router={"disaggregation": "always"})
    handle = build_cluster(config, name="scaling", namespace="tandem-tests")
    yield handle
    shutdown_cluster(handle)


@pytest.fixture(scope="module")
def client(cluster: Any) -> ClusterClient:
    return ClusterClient(cluster)


@pytest.fixture(autouse=True)
def _one_decode_instance_and_no_leaks(cluster: Any) -> Iterator[None]:
    yield
    ray.get(cluster.scale_pool.remote("d", 1, 5.0))
    assert_clean(cluster)


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(6 + 5 * i)] for i in range(count)]


async def _generate(client: ClusterClient, prompts: list[list[int]]) -> list[Any]:
    async def one(k: int, prompt: list[int]) -> Any:
        final = None
        async for out in client.generate_async(prompt, LONG, request_id=f"s{k}"):
            final = out
        return final

    return list(await asyncio.gather(*(one(k, p) for k, p in enumerate(prompts))))


def _instances(cluster: Any) -> set[str]:
    return set(ray.get(cluster.stats.remote())["instances"])


def _shrink_while_decoding(
    cluster: Any, client: ClusterClient, prompts: list[list[int]], drain_timeout_s: float
) -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
    """Grow d to 2, start ``prompts``, and once some decode on d-1, shrink d to 1."""
    grown = ray.get(cluster.scale_pool.remote("d", 2))["instances"]
    assert grown[0] == "d-0" and len(grown) == 2
    new = grown[1]
    # The new instance steps slowly, so its requests are still running when the drain begins.
    ray.get(cluster.set_fault_injection.remote(new, 0.0, 0.05))

    async def run() -> tuple[list[Any], dict[str, Any], dict[str, Any]]:
        task = asyncio.ensure_future(_generate(client, prompts))
        where: dict[str, Any] = {}
        for _ in range(500):
            where = await client.live_requests()
            if any(w["instance"] == new and w["phase"] == "decode" for w in where.values()):
                break
            await asyncio.sleep(0.01)
        resized = await cluster.scale_pool.remote("d", 1, drain_timeout_s)
        return await task, where, resized

    return asyncio.run(asyncio.wait_for(run(), 120))


def test_a_removed_instance_drains_its_requests(
    cluster: Any, client: ClusterClient, tiny_model: Path
) -> None:
    moves_before = ray.get(cluster.stats.remote())["num_moves"]
    prompts = _prompts(8, seed=1)
    outs, where, resized = _shrink_while_decoding(cluster, client, prompts, drain_timeout_s=60)
    assert any(w["instance"] != "d-0" for w in where.values()), where
    assert resized == {"pool": "d", "instances": ["d-0"]}
    assert _instances(cluster) == {"p-0", "d-0"}
    stats = ray.get(cluster.stats.remote())
    assert stats["num_moves"] == moves_before  # drained: every request finished where it was
    expected = generate_in_process(tiny_model, prompts, LONG)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_what_is_left_after_the_drain_time_moves(
    cluster: Any, client: ClusterClient, tiny_model: Path
) -> None:
    moves_before = ray.get(cluster.stats.remote())["num_moves"]
    prompts = _prompts(8, seed=2)
    outs, where, _ = _shrink_while_decoding(cluster, client, prompts, drain_timeout_s=0.0)
    assert [w for w in where.values() if w["instance"] != "d-0"]
    assert ray.get(cluster.stats.remote())["num_moves"] > moves_before  # they moved to d-0
    assert _instances(cluster) == {"p-0", "d-0"}
    expected = generate_in_process(tiny_model, prompts, LONG)
    assert [o.outputs[0].token_ids for o in outs] == expected  # no token lost or repeated


def test_a_grown_pool_serves_on_the_new_instance(cluster: Any, client: ClusterClient) -> None:
    (_, new) = ray.get(cluster.scale_pool.remote("d", 2))["instances"]
    outs = asyncio.run(_generate(client, _prompts(6, seed=3)))
    assert all(len(o.outputs[0].token_ids) == LONG.max_tokens for o in outs)
    added = ray.get(cluster.stats.remote())["instances"][new]["num_requests_added"]
    assert added > 0  # the router sent some of them there


def test_a_dead_instance_counts_for_nothing(cluster: Any, client: ClusterClient) -> None:
    """A dead instance (its worker killed, no restarts) is no replica: scaling to 2 replaces
    it with a new one, and the dead one leaves the cluster."""
    (_, doomed) = ray.get(cluster.scale_pool.remote("d", 2))["instances"]
    pid = ray.get(cluster.worker_health.remote())[doomed]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_until(
        lambda: not ray.get(cluster.stats.remote())["instances"][doomed]["alive"],
        30,
        "the instance to be declared dead",
    )
    (kept, fresh) = ray.get(cluster.scale_pool.remote("d", 2))["instances"]
    assert kept == "d-0" and fresh not in (doomed, "d-0")
    assert doomed not in _instances(cluster)
    outs = asyncio.run(_generate(client, _prompts(4, seed=4)))
    assert all(len(o.outputs[0].token_ids) == LONG.max_tokens for o in outs)
    assert ray.get(cluster.scale_pool.remote("d", 1))["instances"] == ["d-0"]


def test_scaling_refuses_what_it_cannot_do(cluster: Any) -> None:
    with pytest.raises(ray.exceptions.RayTaskError, match="must keep at least one instance"):
        ray.get(cluster.scale_pool.remote("d", 0))
    with pytest.raises(ray.exceptions.RayTaskError, match="no pool named 'x'"):
        ray.get(cluster.scale_pool.remote("x", 2))
    assert _instances(cluster) == {"p-0", "d-0"}
