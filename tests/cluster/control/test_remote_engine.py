"""How the central scheduler notices an engine process die (``RemoteEngine``), with
``health_check_interval_s: 0`` -- the workers' checks off. A real Ray actor stands in for the
engine: it answers the engine's ``ping`` and ``ops``, and is killed."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from tests.cluster.conftest import RayCluster

ray = pytest.importorskip("ray")


class _Engine:
    def ping(self) -> bool:
        return True

    def ops(self, epoch: int, seq: int, items: list[Any]) -> None:
        return None


class _CutOff(_Engine):
    """An engine whose ``drained`` never answers (as one cut off by a partition)."""

    def drained(self) -> bool:
        time.sleep(60)
        return True


def _watched(
    monkeypatch: pytest.MonkeyPatch, watch_s: float, engine_class: type = _Engine
) -> tuple[Any, Any, list[tuple[str, str]]]:
    from cluster.config import ClusterConfig
    from cluster.control import remote_engine

    monkeypatch.setattr(remote_engine, "ENGINE_WATCH_S", watch_s)
    config = ClusterConfig.model_validate(
        {"block_size": 16, "pools": [{"name": "d", "role": "decode"}], "health_check_interval_s": 0}
    )
    actor = ray.remote(engine_class).options(num_cpus=0).remote()
    assert ray.get(actor.ping.remote())
    spec = SimpleNamespace(instance_id="d-0", pool=SimpleNamespace(role="decode"))
    dead: list[tuple[str, str]] = []
    engine = remote_engine.RemoteEngine(
        config, spec, 64, None, lambda iid, why: dead.append((iid, why)), attach=(actor, 0)
    )
    return engine, actor, dead


async def _until(predicate: Any, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_a_dead_engine_is_noticed_with_health_checks_off(
    ray_cluster: RayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It is pinged all the same (it was not watched at all: its requests hung and the
    router kept sending it work)."""
    engine, actor, dead = _watched(monkeypatch, 0.2)

    async def run() -> None:
        engine.start()
        await asyncio.sleep(0.5)
        assert not dead  # it answers its pings
        ray.kill(actor)
        await _until(lambda: bool(dead), 10.0)
        await engine.stop()

    asyncio.run(run())
    assert dead[0][0] == "d-0" and "died" in dead[0][1]
    assert engine.dead == dead[0][1]


def test_an_op_batch_that_finds_the_engine_gone_declares_it_dead(
    ray_cluster: RayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before its next ping: the engine applies op batches in order, so one it never got
    would hold every later one for ever."""
    engine, actor, dead = _watched(monkeypatch, 3600.0)  # (no ping within the test)

    async def run() -> None:
        engine.start()
        ray.kill(actor)
        await asyncio.sleep(0.5)
        engine.draining = True  # an op
        await _until(lambda: bool(dead), 10.0)
        await engine.stop()

    asyncio.run(run())
    assert "died" in dead[0][1] and engine.dead is not None


def test_waiting_for_a_cut_off_engine_to_drain_ends_at_its_timeout(
    ray_cluster: RayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retire waits for the clients to take the engine's last outputs, at most
    ``timeout_s``: the call itself is bounded too (it waited for ever on an engine that no
    longer answered, holding up the retire and every resize after it)."""
    engine, actor, _ = _watched(monkeypatch, 3600.0, _CutOff)

    async def run() -> float:
        started = time.monotonic()
        await engine.wait_drained(timeout_s=1.0)
        return time.monotonic() - started

    try:
        assert asyncio.run(run()) < 30  # 1 s and the call's trip; not drained's 60
    finally:
        ray.kill(actor)


def test_an_op_batch_that_may_not_have_reached_the_engine_declares_it_dead(
    ray_cluster: RayCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that failed in Ray itself (a system error) may never have run, and the
    engine applies batches in order: every later one -- the requests they place -- would
    wait for it for ever while the engine went on answering its pings. Only a batch that ran
    and raised (a bug in it) leaves the engine be."""
    engine, actor, dead = _watched(monkeypatch, 3600.0)

    async def failing(exc: Exception) -> None:
        raise exc

    async def run() -> None:
        raised = ray.exceptions.RayTaskError("ops", "traceback", ValueError("a bug"))
        await engine._sent(failing(raised))
        assert not dead  # it ran: the next batches are applied
        await engine._sent(failing(ray.exceptions.RaySystemError("the object was lost")))
        assert dead and "may not have reached" in dead[0][1]
        await engine.stop()

    try:
        asyncio.run(run())
    finally:
        ray.kill(actor)
