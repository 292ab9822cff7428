"""``cluster.control.recovery.end_hung_workers`` on real Ray actors: after a step timeout it
kills the workers that still answer with their state (hung) and leaves alone the ones that died or
already came back empty (their death was only reported late; killing the new process would
spend a restart)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.cluster.conftest import RayCluster, wait_until

ray = pytest.importorskip("ray")

from cluster.config import InstancePool  # noqa: E402
from cluster.control.placement import MONITOR, InstanceSpec  # noqa: E402
from cluster.control.recovery import end_hung_workers, restore_workers  # noqa: E402


@ray.remote(num_cpus=0, concurrency_groups={MONITOR: 1})
class Stage:
    """A worker stand-in: its health answers on the monitor group, like ModelWorker's."""

    def __init__(self, ok: bool) -> None:
        self.ok = ok

    @ray.method(concurrency_group=MONITOR)
    def health(self) -> dict[str, bool]:
        return {"ok": self.ok}

    def step(self, seconds: float) -> None:
        time.sleep(seconds)

    def load_model(self) -> None:
        time.sleep(600)  # (a reload that never ends: its process cannot be placed, say)


def _alive(actor: object) -> bool:
    try:
        ray.get(actor.health.remote(), timeout=30)  # type: ignore[attr-defined]
    except ray.exceptions.RayActorError:
        return False
    return True


def test_only_the_workers_that_still_hold_their_state_are_killed(
    ray_cluster: RayCluster,
) -> None:
    hung, restarted, dead = Stage.remote(True), Stage.remote(False), Stage.remote(True)
    hung.step.remote(600)  # its step never returns; health still answers
    ray.kill(dead, no_restart=True)
    spec = InstanceSpec(
        "x-0", InstancePool(name="x"), None, None, {}, stages=[hung, restarted, dead]
    )
    asyncio.run(asyncio.wait_for(end_hung_workers(spec), 60))
    wait_until(lambda: not _alive(hung), 30, "the hung worker to be killed")  # kill is async
    assert _alive(restarted)  # came back empty: left for the rejoin to reload
    ray.kill(restarted)


def test_a_restore_keeps_to_its_deadline(ray_cluster: RayCluster) -> None:
    """A worker that does not come back within the restore's timeout (Ray cannot place it,
    its reload hangs) makes the restore give up at its deadline: it awaited each call with
    no bound, so the instance was never declared out of routing."""
    stage = Stage.remote(False)
    spec = InstanceSpec("x-0", InstancePool(name="x"), None, None, {}, stages=[stage])
    start = time.monotonic()
    assert asyncio.run(asyncio.wait_for(restore_workers(spec, 2.0), 60)) is False
    assert time.monotonic() - start < 10
    ray.kill(stage)
