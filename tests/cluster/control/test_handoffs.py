"""``HandOffs``: a prefilled copy is let go only once its decode engine counts the request
among those it received, or the decode engine failed, died, left or went silent."""

from __future__ import annotations

import time

from cluster.control.handoffs import HandOffs


def test_confirmed_in_the_order_sent_once_received() -> None:
    h = HandOffs()
    assert not h
    h.expect("d-0", 3, "p-0", "a@1")
    h.expect("d-0", 4, "p-1", "b@2")
    h.expect("d-1", 1, "p-0", "c@3")
    assert h and len(h) == 3
    assert h.received("d-0", 2) == {}  # a report from before the hand-offs
    assert h.received("d-0", 3) == {"p-0": ["a@1"]}
    assert h.received("d-0", 9) == {"p-1": ["b@2"]}
    assert h.received("d-0", 9) == {}  # once
    assert len(h) == 1
    assert h.received("d-1", 1) == {"p-0": ["c@3"]}
    assert not h


def test_a_failed_engine_lets_go_of_its_hand_offs_only() -> None:
    h = HandOffs()
    h.expect("d-0", 1, "p-0", "a@1")
    h.expect("d-0", 2, "p-0", "b@2")
    h.expect("d-1", 1, "p-0", "c@3")
    assert h.drop("d-0") == {"p-0": ["a@1", "b@2"]}
    assert h.drop("d-0") == {}
    assert len(h) == 1


def test_hand_offs_a_silent_engine_never_confirmed_are_let_go() -> None:
    h = HandOffs()
    h.expect("d-0", 1, "p-0", "old@1")
    h._waiting["d-0"][0].since -= 60.0
    h.expect("d-0", 2, "p-0", "new@2")
    assert h.stale(time.monotonic(), max_age_s=30.0) == {"p-0": ["old@1"]}
    assert len(h) == 1
