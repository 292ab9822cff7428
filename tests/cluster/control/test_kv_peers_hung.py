"""A worker that never answers a KV-peer call -- hung in a step, idle behind a stuck call, or
one Ray cannot place again -- held the connection round, and with it the ``_membership``
lock (every resize, every retire, a restarted central actor's rebuild), for ever. Each call
now waits at most ``placement.KV_PEERS_TIMEOUT_S``; the instance that did not answer fails
as after a step timeout (its requests move, its workers are ended)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.control import placement, restart
from cluster.control.kv_peers import KVPeers


class Spec:
    """An instance's spec whose workers answer every KV-peer call (``hung``: never)."""

    def __init__(self, instance_id: str, hung: bool = False) -> None:
        self.instance_id = instance_id
        self.hung = hung
        self.kv_peers: list[Any] = [SimpleNamespace(agent=f"agent-{instance_id}")]
        self.unanswered: str | None = None
        self.calls: list[str] = []

    async def call_stages(self, method: str, *args: Any, **options: Any) -> list[Any]:
        self.calls.append(method)
        if self.hung:
            await asyncio.Event().wait()  # never set
        if method == "kv_peer":
            return [SimpleNamespace(agent=f"agent-{self.instance_id}")]
        if method == "health":
            return [{"kv_transport": "nixl"}]
        return [None]


class Engine:
    def __init__(self) -> None:
        self.failed: list[tuple[str, bool]] = []

    def fail(self, reason: str, hung: bool = False) -> None:
        self.failed.append((reason, hung))


class Peers(KVPeers):
    """The mixin with a live, hung decode instance d-0 (the nixl transport as configured)."""

    def __init__(self) -> None:
        self._kv_auto = False
        self.hung = Spec("d-0", hung=True)
        self.specs = {"d-0": self.hung}  # type: ignore[dict-item]
        self.views = {"d-0": SimpleNamespace(alive=True)}  # type: ignore[dict-item]
        self.engines = {"d-0": Engine()}
        self.config: Any = SimpleNamespace(
            disaggregated=True,
            step_timeout_s=None,
            kv_transfer=SimpleNamespace(transport="nixl", connector_options=lambda: {}),
        )


@pytest.fixture(autouse=True)
def short_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "KV_PEERS_TIMEOUT_S", 0.05)


def test_a_new_instance_connects_and_the_hung_live_one_fails() -> None:
    """A pool grows (p-1) while d-0's worker hangs: the round ends, p-1 is not refused for
    it, and d-0 fails as hung (its workers are ended, and come back under max_restarts)."""
    peers, new = Peers(), Spec("p-1")
    asyncio.run(asyncio.wait_for(peers._connect_kv_peers([new]), 10))  # type: ignore[list-item]
    ((reason, hung),) = peers.engines["d-0"].failed
    assert hung and "d-0" in reason and "did not answer add_kv_peers" in reason
    assert peers.hung.unanswered is None  # dealt with
    assert new.calls == ["kv_peer", "add_kv_peers"] and new.unanswered is None
    # Forgetting a peer does not wait for it either, nor marks it: no caller fails the
    # instances it tells (a retire's), and a mark left would fail a healthy one later.
    asyncio.run(asyncio.wait_for(placement.disconnect_kv_peers([peers.hung], ["x"]), 10))  # type: ignore[list-item]
    assert peers.hung.unanswered is None


def test_a_hung_new_instance_is_refused() -> None:
    peers = Peers()
    peers.specs, peers.views, peers.engines = {}, {}, {}
    with pytest.raises(RuntimeError, match="p-1: its workers did not answer kv_peer"):
        asyncio.run(asyncio.wait_for(peers._connect_kv_peers([Spec("p-1", hung=True)]), 10))  # type: ignore[list-item]


def test_a_restarted_central_actor_learns_the_transport_from_the_workers_that_answer() -> None:
    """``transport: auto`` resolved again after a restart: one hung instance does not hold
    the rebuild (it stayed 503 for ever); the answering one's transport is taken."""
    actor = SimpleNamespace(
        config=SimpleNamespace(
            kv_transfer=SimpleNamespace(transport="ray"),
            with_kv_transport=lambda t: SimpleNamespace(chosen=t),
        )
    )
    specs = [Spec("d-0", hung=True), Spec("p-0")]
    asyncio.run(asyncio.wait_for(restart._kv_transport_in_use(actor, specs), 10))
    assert actor.config.chosen == "nixl"


def test_a_round_takes_a_worker_for_hung_no_sooner_than_its_step_would_be(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A KV-peer call waits behind the worker's step in progress: a step the step timeout
    still allows must not get the instance killed by a round; with no step timeout a round
    still ends."""
    monkeypatch.setattr(placement, "KV_PEERS_TIMEOUT_S", 60.0)
    assert placement.kv_peers_timeout_s(None) == 60.0
    assert placement.kv_peers_timeout_s(2.0) == 60.0
    assert placement.kv_peers_timeout_s(300.0) == 300.0 + placement.STEP_MARGIN_S


def test_an_engine_failed_as_hung_reports_it_so_its_workers_are_ended() -> None:
    """``fail(reason, hung=True)`` -- a round's verdict -- fails the loop as a step timeout
    does: ``hung`` set before the failure reaches the owner (``InstanceEngine._on_loop_failed``
    then ends the workers). A plain ``fail`` (a worker found dead) does not."""
    from cluster.control.engine import InstanceEngine
    from cluster.control.engine_loop import EngineLoop
    from tests.scheduler.helpers import make_scheduler

    seen: list[tuple[bool, str]] = []
    for hung in (True, False):
        loop = EngineLoop("d-0", make_scheduler(block_size=4, num_blocks=32), None, print)  # type: ignore[arg-type]
        loop.on_failure = lambda failed, ids, reason: seen.append((failed.hung, reason))
        InstanceEngine.fail(SimpleNamespace(loop=loop), f"no answer ({hung})", hung=hung)  # type: ignore[arg-type]
    assert seen == [(True, "no answer (True)"), (False, "no answer (False)")]


def test_the_new_instances_of_a_round_are_asked_at_once() -> None:
    """A restarted central actor's rebuild connects every instance: asked one after the
    other, k hung ones held it (503s meanwhile) k timeouts long. Two instances that answer
    only once both were asked show that the round asks them together."""
    asked: list[str] = []
    both = asyncio.Event()

    class Barrier(Spec):
        async def call_stages(self, method: str, *args: Any, **options: Any) -> list[Any]:
            if method == "kv_peer":
                asked.append(self.instance_id)
                if len(asked) == 2:
                    both.set()
                await both.wait()
            return await super().call_stages(method, *args, **options)

    specs = [Barrier("p-0"), Barrier("d-0")]
    errors = asyncio.run(placement.connect_kv_peers(specs, specs))  # type: ignore[arg-type]
    assert errors == [] and sorted(asked) == ["d-0", "p-0"]
    assert all(s.unanswered is None for s in specs)


def test_a_round_waits_as_long_as_the_configured_step_timeout_allows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The wait that reaches ``connect_kv_peers`` and ``disconnect_kv_peers`` is the
    config's (``step_timeout_s`` + the margin), not the floor."""
    waits: list[tuple[str, float | None]] = []

    async def connect(specs: Any, new: Any, probe: bool = False, timeout_s: Any = None) -> Any:
        waits.append(("connect", timeout_s))
        return ["p-1: unreachable"]

    async def disconnect(specs: Any, names: Any, timeout_s: Any = None) -> None:
        waits.append(("disconnect", timeout_s))

    monkeypatch.setattr(placement, "connect_kv_peers", connect)
    monkeypatch.setattr(placement, "disconnect_kv_peers", disconnect)
    peers = Peers()
    peers.hung.hung = False
    peers.config.step_timeout_s = 30.0
    with pytest.raises(RuntimeError, match="cannot reach"):
        asyncio.run(peers._connect_kv_peers([Spec("p-1")]))  # type: ignore[list-item]
    wait = 30.0 + placement.STEP_MARGIN_S
    assert waits == [("connect", wait), ("disconnect", wait)]
