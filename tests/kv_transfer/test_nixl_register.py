"""``NixlWorkerConnector.register_kv_caches`` with a stand-in NIXL agent (runs without the
``nixl`` extra): a new cache's registration deregisters the old cache from the old agent
while the old cache is still alive -- memory freed while registered could be unmapped or
handed out again under UCX."""

from __future__ import annotations

import time
import weakref
from typing import Any

import pytest
import torch

from kv_transfer import nixl_transport
from kv_transfer.blocks import allocate_kv_caches
from kv_transfer.nixl_retired import _Retired

LAYERS = range(2)


class _Binding:
    """Stands in for an agent's C++ side (``nixl_agent.agent``): the agent ends with it."""


class FakeAgent:
    """What ``register_kv_caches`` and ``_close_agent`` use of a NIXL agent; on deregister it
    notes whether the registered cache (watched through ``alive``) still exists."""

    def __init__(self, name: str, alive: list[weakref.ref[torch.Tensor]]) -> None:
        self.name = name
        self.agent: _Binding | None = _Binding()
        self.backends = ["UCX"]
        self.alive = alive
        self.cache_alive_at_deregister: list[bool] = []
        self.removed: list[str] = []

    def register_memory(self, descs: list[Any], mem_type: str) -> Any:
        return ("registration", len(descs), mem_type)

    def deregister_memory(self, registration: Any) -> None:
        self.cache_alive_at_deregister.append(self.alive[0]() is not None)

    def remove_remote_agent(self, name: str) -> None:
        self.removed.append(name)

    def check_xfer_state(self, xfer: Any) -> str:
        return str(xfer.state)


def _caches() -> list[torch.Tensor]:
    return allocate_kv_caches(len(LAYERS), 8, 4, 2, 8, torch.float32)


def _registered(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[Any, list[FakeAgent], list[weakref.ref[torch.Tensor]], list[torch.Tensor]]:
    """A connector on stand-in agents (``agents``, in the order made) that registered a
    first cache (returned, watched through ``alive``)."""
    alive: list[weakref.ref[torch.Tensor]] = []
    agents: list[FakeAgent] = []

    def make_agent(api: Any, name: str, backends: list[str], wait_us: int) -> FakeAgent:
        agents.append(FakeAgent(name, alive))
        return agents[-1]

    monkeypatch.setattr(nixl_transport, "nixl_api", lambda: object())
    monkeypatch.setattr(nixl_transport, "_make_agent", make_agent)
    connector = nixl_transport.NixlWorkerConnector(same_node_copy=False)
    old = _caches()
    alive.append(weakref.ref(old[0]))
    connector.register_kv_caches(old, LAYERS)
    return connector, agents, alive, old


def test_the_old_cache_is_deregistered_before_it_is_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    connector, agents, alive, old = _registered(monkeypatch)
    del old  # the connector holds the only reference now
    connector.register_kv_caches(_caches(), LAYERS)
    assert agents[0].cache_alive_at_deregister == [True]
    assert alive[0]() is None  # then let go
    assert connector.agent is agents[1]
    connector.close()


def test_a_closed_agent_ends_at_once_after_its_peers_and_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``nixl_agent`` has no close: its C++ side (progress thread, UCX worker) ends with the
    last reference to it. Closing drops that reference once the peers are removed and the
    memory deregistered, whoever still holds the Python object (here the test; a traceback or
    a cycle left one to the garbage collector, which could end it during a later test, with
    UCX's work still queued: the process aborts)."""
    connector, agents, *_ = _registered(monkeypatch)
    agent = agents[0]
    connector._peers["peer"] = connector.layout  # (a peer it knows)
    seen: list[tuple[list[str], list[bool]]] = []  # what was undone when the agent ended

    def ended() -> None:
        seen.append((list(agent.removed), list(agent.cache_alive_at_deregister)))

    weakref.finalize(agent.agent, ended)
    connector.close()
    assert seen == [(["peer"], [True])] and agent.agent is None  # last, and at once


class FakeRead:
    """A transfer an agent posted: running until ``state`` says otherwise."""

    def __init__(self) -> None:
        self.state = "PROC"
        self.released = False

    def release(self) -> None:
        self.released = True


def test_an_agent_whose_reads_still_run_is_undone_once_they_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read still running when the cache is replaced writes into memory the old agent
    registered, from a peer it knows: the old agent's registrations and peers are undone
    once the read ends, not under it."""
    connector, agents, _, old = _registered(monkeypatch)
    read = FakeRead()
    # as ``_drop_reads`` leaves it
    connector._retired.append(_Retired([read], ["peer"], old, agents[0], time.monotonic() + 60))
    connector.register_kv_caches(_caches(), LAYERS)
    assert agents[0].cache_alive_at_deregister == []  # not while the read runs
    connector._poll_reads()
    assert agents[0].cache_alive_at_deregister == [] and not read.released
    read.state = "DONE"
    connector._poll_reads()
    assert read.released and agents[0].cache_alive_at_deregister == [True]
    assert not connector._closing
    connector.close()


def test_a_cache_replaced_while_a_probe_reads_stays_until_its_agent_is_undone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A probe's read was running (it holds only the scratch slab) when the cache was
    replaced: the old agent waited for it, still registered over the old cache -- which was
    dropped at once, so a peer with an older handle read freed memory. The old cache now
    lives until its agent is undone."""
    connector, agents, alive, old = _registered(monkeypatch)
    read = FakeRead()
    # as ``probe`` does
    watched = _Retired([read], ["peer"], [connector.scratch], agents[0], time.monotonic() + 60)
    connector._probing.append(watched)
    del old
    connector.register_kv_caches(_caches(), LAYERS)
    assert alive[0]() is not None  # still registered with the old agent: kept
    connector._probing.clear()  # the probe ended
    read.state = "DONE"
    connector._poll_reads()
    assert agents[0].cache_alive_at_deregister == [True]
    assert not connector._closing
    assert alive[0]() is None  # then let go
    connector.close()


def test_a_dropped_read_past_its_deadline_has_its_source_disconnected_by_its_own_agent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read dropped with its cache whose source hangs: past its deadline its source is
    disconnected through the old agent (not the new one), which ends it; then the old agent
    is undone and the old cache let go."""
    connector, agents, alive, old = _registered(monkeypatch)
    read = FakeRead()
    connector._retired.append(_Retired([read], ["peer"], old, agents[0], time.monotonic() - 1))
    del old
    connector.register_kv_caches(_caches(), LAYERS)
    connector._poll_reads()
    assert agents[0].removed == ["peer"] and agents[1].removed == []
    assert agents[0].cache_alive_at_deregister == [] and not read.released  # still running
    read.state = "ERR"  # the closed endpoint ended it
    connector._poll_reads()
    assert read.released and agents[0].cache_alive_at_deregister == [True]
    assert not connector._retired and not connector._closing and alive[0]() is None
    connector.close()
