"""An engine actor's bookkeeping of its clients, without Ray (the actor's methods on a bare
instance)."""

from __future__ import annotations

import pytest


def test_an_engine_remembers_only_its_latest_dropped_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Client ids are unique, and the blocking ``generate`` makes a client per call: an
    engine actor keeps the latest ``DROPPED_REMEMBERED`` dropped ones (as the central actor
    does), not every one it ever saw."""
    from collections import OrderedDict

    from cluster.control import engine_actor, engine_streams
    from cluster.control.refill import PastRequests

    monkeypatch.setattr(engine_streams, "DROPPED_REMEMBERED", 3)
    actor = engine_actor.EngineActor.__new__(engine_actor.EngineActor)  # (no engine needed)
    actor._dropped, actor._streams, actor._outboxes = OrderedDict(), {}, {}
    actor._past = PastRequests()
    for i in range(10):
        actor._drop_client(f"client-{i}")
    assert list(actor._dropped) == ["client-7", "client-8", "client-9"]
    assert actor._outbox("client-9") is None  # a dropped client gets no outbox
