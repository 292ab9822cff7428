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


def test_an_engine_that_does_not_answer_a_scrape_gives_its_last_metrics() -> None:
    """The central scheduler sums the engines' metrics into /metrics: an engine missing from
    one scrape (slow, hung, dead) read as all its counters reset, and Prometheus's rate()
    then added their whole history once it answered again."""
    import asyncio

    from cluster.control.remote_engine import RemoteEngine

    engine = RemoteEngine.__new__(RemoteEngine)  # (no actor: its answers are set below)
    engine.instance_id, engine.dead, engine._last_metrics = "d-0", None, ""
    answers: list[object] = ["a_total 3.0\n", TimeoutError("no answer"), "a_total 5.0\n"]

    async def ask(method: str, *args: object, **kwargs: object) -> object:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    engine._ask = ask  # type: ignore[method-assign]
    texts = [asyncio.run(engine.metrics_text()) for _ in range(3)]
    assert texts == ["a_total 3.0\n", "a_total 3.0\n", "a_total 5.0\n"]
    engine.dead = "its process died"
    assert asyncio.run(engine.metrics_text()) == "a_total 5.0\n"
