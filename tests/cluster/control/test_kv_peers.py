"""``KVPeers._connect_kv_peers`` when the first instances' workers cannot reach one another:
``transport: auto`` falls back to ``ray``; a transport the user named is kept, and the
instances are refused with the peers it could not reach."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.control import placement
from cluster.control.kv_peers import KVPeers

ERRORS = ["p-0: RuntimeError: no route to d-0"]


class Peers(KVPeers):
    """The mixin with what it uses of the actor: no instance yet, a disaggregated config."""

    def __init__(self, auto: bool) -> None:
        self._kv_auto = auto
        self.specs = {}
        self.views = {}
        self.engines: dict[str, Any] = {}
        self.switched_to: list[str] = []
        self.config: Any = SimpleNamespace(
            disaggregated=True,
            step_timeout_s=None,
            kv_transfer=SimpleNamespace(transport="nixl", connector_options=lambda: {}),
            with_kv_transport=self._switch,
        )

    def _switch(self, transport: str) -> Any:
        self.switched_to.append(transport)
        return self.config

    @staticmethod
    async def unreachable(
        specs: list[Any], new: list[Any], probe: bool = False, *_: Any
    ) -> list[str]:
        return [f"{new[0].instance_id}: RuntimeError: no route"]


class Spec:
    """An instance's spec: records the stage calls it gets."""

    def __init__(self, instance_id: str = "p-0") -> None:
        self.instance_id = instance_id
        self.kv_peers: list[Any] = [SimpleNamespace(agent=f"agent-{instance_id}")]
        self.calls: list[tuple[Any, ...]] = []
        self.unanswered: str | None = None

    async def call_stages(self, *args: Any, **options: Any) -> list[Any]:
        self.calls.append(args)
        return []


@pytest.fixture(autouse=True)
def unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    async def connect(specs: list[Any], new: list[Any], probe: bool = False, *_: Any) -> list[str]:
        return list(ERRORS)

    monkeypatch.setattr(placement, "connect_kv_peers", connect)


def test_an_explicit_nixl_transport_is_never_swapped_for_ray() -> None:
    peers, spec = Peers(auto=False), Spec()
    with pytest.raises(RuntimeError, match="cannot reach: p-0: RuntimeError: no route to d-0"):
        asyncio.run(peers._connect_kv_peers([spec]))  # type: ignore[list-item]
    assert peers.switched_to == [] and spec.calls == [] and len(spec.kv_peers) == 1


def test_a_refused_instance_is_forgotten_by_the_live_ones() -> None:
    """A later instance the live ones cannot reach is refused; they had been told of its
    workers (before the probe): they forget them -- they kept their agents' endpoints."""
    peers, live, new = Peers(auto=True), Spec("d-0"), Spec("p-1")
    peers.specs = {"d-0": live}
    peers.views = {"d-0": SimpleNamespace(alive=True)}
    with pytest.raises(RuntimeError, match="cannot reach"):
        asyncio.run(peers._connect_kv_peers([new]))  # type: ignore[list-item]
    assert live.calls == [("remove_kv_peers", ["agent-p-1"])]


def test_auto_falls_back_to_ray_for_the_first_instances() -> None:
    peers, spec = Peers(auto=True), Spec()
    asyncio.run(peers._connect_kv_peers([spec]))  # type: ignore[list-item]
    assert peers.switched_to == ["ray"]
    assert spec.calls == [("use_kv_transport", "ray", {})] and spec.kv_peers == []


class Rejoining(Peers):
    """A rejoined instance ``d-0`` beside a live ``d-1``; the probe's answers in turn."""

    def __init__(self, *answers: list[str]) -> None:
        super().__init__(auto=True)
        self.answers = list(answers)
        self.spec = Spec("d-0")
        self.specs = {"d-0": self.spec, "d-1": Spec("d-1")}
        self.views = {"d-0": SimpleNamespace(alive=False), "d-1": SimpleNamespace(alive=True)}
        self.failures: list[dict[str, Any]] = []
        self.probed: list[list[str]] = []
        self.resized: list[str] = []
        self.autoscaler = SimpleNamespace(resized=self.resized.append)
        self.spec.pool = SimpleNamespace(name="d")  # type: ignore[attr-defined]

        async def call_stages(*args: Any, **options: Any) -> list[Any]:
            return [{"kv_transport": "nixl"}] if args[0] == "health" else []

        self.spec.call_stages = call_stages  # type: ignore[method-assign]

    async def connect(
        self, specs: list[Any], new: list[Any], probe: bool = False, *_: Any
    ) -> list[str]:
        self.probed.append([s.instance_id for s in specs])
        return self.answers.pop(0) if self.answers else []

    def rejoin(self) -> None:
        asyncio.run(self._rejoin_kv("d-0", self.views["d-0"], 0))  # type: ignore[arg-type]

    def events(self) -> list[tuple[str, str]]:
        return [(f["instance_id"], f["event"]) for f in self.failures]


def test_a_rejoin_whose_peer_died_during_its_probe_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The soak's kills 7 s apart: d-1 was killed while d-0's restarted workers probed it, so
    the probe failed both ways, and d-0 stayed out of routing for good (lost capacity), while
    d-1 rejoined. The rejoin now tries again (with the instances alive then) and serves."""
    from cluster.control import kv_peers

    died = ["d-0[0] -> d-1[0]: ConnectionError: NIXL could not read (ERR)"]
    peers = Rejoining(died)
    monkeypatch.setattr(placement, "connect_kv_peers", peers.connect)
    monkeypatch.setattr(kv_peers, "REJOIN_RETRY_S", (0.01,), raising=False)
    real_sleep = asyncio.sleep

    def d1_failed(_: float) -> Any:  # (during the pause, d-1's failure is found)
        peers.views["d-1"].alive = False
        peers.failures.append({"instance_id": "d-1", "event": "failed"})
        return real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", d1_failed)
    peers.rejoin()
    assert peers.views["d-0"].alive
    assert peers.events() == [("d-0", "failed"), ("d-1", "failed"), ("d-0", "rejoined")]
    assert peers.probed == [["d-0", "d-1"], ["d-0"]]  # the second time without the dead one
    assert peers.resized == ["d"]


def test_a_rejoin_stops_trying_when_the_instance_fails_again_or_its_transport_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cluster.control import kv_peers

    monkeypatch.setattr(kv_peers, "REJOIN_RETRY_S", (0.0,), raising=False)
    peers = Rejoining(["unreachable"], ["unreachable"], ["unreachable"])
    monkeypatch.setattr(placement, "connect_kv_peers", peers.connect)
    real_sleep = asyncio.sleep

    def fails_again(_: float) -> Any:
        if len(peers.probed) == 2:
            peers.failures.append({"instance_id": "d-0", "event": "failed"})
        return real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", fails_again)
    peers.rejoin()
    assert len(peers.probed) == 2 and not peers.views["d-0"].alive
    assert peers.events() == [("d-0", "failed"), ("d-0", "failed")]  # its own, then the new

    other = Rejoining()  # NIXL no longer starts on its node: final, no retry

    async def fell_back(*args: Any, **options: Any) -> list[Any]:
        return [{"kv_transport": "ray"}] if args[0] == "health" else []

    other.spec.call_stages = fell_back  # type: ignore[method-assign]
    monkeypatch.setattr(placement, "connect_kv_peers", other.connect)
    other.rejoin()
    assert other.probed == [] and not other.views["d-0"].alive
    assert other.events() == [("d-0", "failed")]


def test_an_instance_let_serve_during_a_rejoins_probe_is_connected_with_it_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two instances back at once (p-0 and d-0 killed seconds apart, say): each connected with
    the instances alive when its round began, so neither with the other -- p-0's rejoin ended
    during d-0's probe. d-0 connects again, with p-0, before it serves: neither had the
    other's agents (every hand-off from p-0 to d-0 would have failed its KV load for good)."""
    peers = Rejoining()
    peers.specs["p-0"] = Spec("p-0")  # type: ignore[assignment]
    peers.views["p-0"] = SimpleNamespace(alive=False)  # type: ignore[assignment]
    probe = peers.connect

    async def connect(specs: list[Any], new: list[Any], probe_: bool = False, *_: Any) -> list[str]:
        found = await probe(specs, new, probe_)
        peers.views["p-0"].alive = True  # its own rejoin ended meanwhile
        return found

    monkeypatch.setattr(placement, "connect_kv_peers", connect)
    peers.rejoin()
    assert peers.probed == [["d-0", "d-1"], ["d-0", "d-1", "p-0"]]
    assert peers.views["d-0"].alive and peers.events() == [("d-0", "rejoined")]


def test_new_instances_connect_with_one_that_rejoined_while_they_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool grows while d-0 rejoins: the new p-1 connected with the instances alive then
    (not d-0), and d-0 -- let serve while p-1's engine started -- without p-1 (not there yet).
    Before p-1 serves it connects with d-0; one it cannot reach refuses it, as at its start."""
    peers, p1, d0 = Peers(auto=True), Spec("p-1"), Spec("d-0")
    peers.specs = {"d-0": d0}  # type: ignore[dict-item]
    peers.views = {"d-0": SimpleNamespace(alive=True)}  # type: ignore[dict-item]
    rounds: list[list[str]] = []

    async def connect(specs: list[Any], new: list[Any], probe: bool = False, *_: Any) -> list[str]:
        rounds.append([s.instance_id for s in specs])
        return []

    monkeypatch.setattr(placement, "connect_kv_peers", connect)
    asyncio.run(peers._connect_serving_since([p1], {}))  # type: ignore[list-item]
    assert rounds == [["d-0", "p-1"]]
    before = {"d-0": peers.views["d-0"]}
    asyncio.run(peers._connect_serving_since([p1], dict(before)))  # type: ignore[list-item]
    assert rounds == [["d-0", "p-1"]]  # nothing new: no round
    # d-0 alive when p-1 connected, then failed and rejoined while p-1's engine started:
    # its restarted workers' agents are new (a new view), so p-1 connects with it again.
    peers.views["d-0"] = SimpleNamespace(alive=True)  # type: ignore[assignment]
    asyncio.run(peers._connect_serving_since([p1], dict(before)))  # type: ignore[list-item]
    assert rounds == [["d-0", "p-1"], ["d-0", "p-1"]]
    monkeypatch.setattr(placement, "connect_kv_peers", Peers.unreachable)
    d1 = Spec("d-1")  # alive when p-1 connected (``_connect_kv_peers`` told it of p-1)
    peers.specs["d-1"] = d1  # type: ignore[assignment]
    peers.views["d-1"] = SimpleNamespace(alive=True)  # type: ignore[assignment]
    live = {"d-1": peers.views["d-1"]}
    with pytest.raises(RuntimeError, match="cannot reach: p-1"):
        asyncio.run(peers._connect_serving_since([p1], live))  # type: ignore[list-item]
    # Refused: d-0 and d-1 alike forget p-1's workers (both were told of them).
    assert d0.calls == [("remove_kv_peers", ["agent-p-1"])]
    assert d1.calls == [("remove_kv_peers", ["agent-p-1"])]


def test_a_peer_that_failed_and_rejoined_during_a_rejoins_probe_is_connected_with_it_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """d-1 was alive when d-0's round began, then failed and rejoined before the round ended:
    its restarted workers' agents are new, and its own round ran without d-0 (not alive then).
    Its id among those the round took is not enough: d-0 connects again, with d-1's new view."""
    peers = Rejoining()
    probe = peers.connect
    flapped: list[bool] = []

    async def connect(specs: list[Any], new: list[Any], probe_: bool = False, *_: Any) -> list[str]:
        found = await probe(specs, new, probe_)
        if not flapped:  # once: d-1 failed and rejoined (``_rejoined``: a new view)
            flapped.append(True)
            peers.views["d-1"] = SimpleNamespace(alive=True)  # type: ignore[assignment]
        return found

    monkeypatch.setattr(placement, "connect_kv_peers", connect)
    peers.rejoin()
    assert peers.probed == [["d-0", "d-1"], ["d-0", "d-1"]]
    assert peers.views["d-0"].alive and peers.events() == [("d-0", "rejoined")]
