"""A subscription's keep-alive thread survives a send that fails: one exception used to end
the thread, and the actor then dropped the client after its timeout, failing every stream."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from cluster.control import subscription
from cluster.control.subscription import Subscription


def test_a_failed_keep_alive_does_not_end_the_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subscription, "KEEPALIVE_S", 0.0)
    stop = threading.Event()
    sent: list[str] = []

    def remote(client_id: str) -> None:
        sent.append(client_id)
        if len(sent) == 1:
            raise RuntimeError("the object store is full")
        if len(sent) == 3:
            stop.set()

    client = SimpleNamespace(
        handle=SimpleNamespace(keepalive=SimpleNamespace(remote=remote)),
        client_id="c",
        _stop=stop,
    )
    thread = threading.Thread(target=Subscription._keep_alive, args=(client,))
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and sent == ["c", "c", "c"]
