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
        self.switched_to: list[str] = []
        self.config: Any = SimpleNamespace(
            disaggregated=True,
            kv_transfer=SimpleNamespace(transport="nixl", connector_options=lambda: {}),
            with_kv_transport=self._switch,
        )

    def _switch(self, transport: str) -> Any:
        self.switched_to.append(transport)
        return self.config


class Spec:
    """An instance's spec: records the stage calls it gets."""

    def __init__(self, instance_id: str = "p-0") -> None:
        self.instance_id = instance_id
        self.kv_peers: list[Any] = [SimpleNamespace(agent=f"agent-{instance_id}")]
        self.calls: list[tuple[Any, ...]] = []

    async def call_stages(self, *args: Any, **options: Any) -> list[Any]:
        self.calls.append(args)
        return []


@pytest.fixture(autouse=True)
def unreachable(monkeypatch: pytest.MonkeyPatch) -> None:
    async def connect(specs: list[Any], new: list[Any], probe: bool = False) -> list[str]:
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
