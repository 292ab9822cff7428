"""``ClusterOperations._retire`` of a prefill instance whose drain timed out: decode
instances may still read the KV it sent, so its workers stay for the reads' lease; drained,
or a decode instance, they stop at once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.control import operations
from cluster.control.handoffs import HandOffs
from cluster.control.operations import ClusterOperations

LEASE_S = 7.5


class Retire(ClusterOperations):
    """The mixin with what ``_retire`` uses of the actor; one in-process engine."""

    def __init__(self, role: str, holds: bool) -> None:
        engine = SimpleNamespace(
            remote=False,
            holds_requests=lambda: holds,
            take_all=lambda: [],
            close=lambda: None,
        )

        async def stop() -> None:
            pass

        engine.stop = stop
        self.config: Any = SimpleNamespace(
            disaggregated=True, kv_transfer=SimpleNamespace(effective_lease_s=LEASE_S)
        )
        self.engines = {"p-0": engine}
        self.roles = {"p-0": role}
        self.views = {"p-0": SimpleNamespace(alive=True)}
        pool = SimpleNamespace(role=role)
        self.specs = {"p-0": SimpleNamespace(instance_id="p-0", actors=[], pool=pool, kv_peers=[])}
        self.flights = {}
        self._orphans = {}
        self.hand_offs = HandOffs()
        self._confirm = lambda confirmed: None
        self.observe: Any = SimpleNamespace(remove_instance=lambda iid, role: None)
        self.lora: Any = SimpleNamespace(forget=lambda iid: None)
        self.spawned: list[Any] = []
        self.stopped: list[tuple[str, float]] = []

    def _spawn(self, coro: Any) -> None:
        self.spawned.append(coro)

    async def _stop_workers(self, spec: Any, after_s: float) -> None:
        self.stopped.append((spec.instance_id, after_s))


@pytest.fixture(autouse=True)
def no_kv_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    from cluster.control import placement

    async def disconnect(specs: list[Any], names: list[str]) -> None:
        pass

    monkeypatch.setattr(placement, "disconnect_kv_peers", disconnect)
    monkeypatch.setattr(operations, "refreeze_heap", lambda: None)


@pytest.mark.parametrize(
    ("role", "holds", "delay"),
    [("prefill", True, LEASE_S), ("prefill", False, 0.0), ("decode", True, 0.0)],
)
def test_a_prefill_instance_retired_undrained_keeps_its_workers_for_the_lease(
    role: str, holds: bool, delay: float
) -> None:
    ops = Retire(role, holds)
    ops.specs["p-0"].actors = ["worker"]

    async def main() -> None:
        await ops._retire("p-0")
        for coro in ops.spawned:
            await coro

    asyncio.run(main())
    assert ops.stopped == [("p-0", delay)]
    assert "p-0" not in ops.engines and "p-0" not in ops.specs
