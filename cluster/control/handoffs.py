"""Hand-offs waiting for their decode engine: a prefilled request's copy on the prefill
engine is dropped (``handed_off``) only once the decode engine has the request.

With engine actors the central scheduler gives the decode engine the request (``add``) and
tells the prefill engine it was taken (``handed_off``) in two Ray calls to two processes. Sent
together, a central scheduler that died between them could leave the request nowhere: the
prefill engine forgot it, the decode engine never got it, and a restarted central scheduler
rebuilds only from what the engines hold. So ``handed_off`` waits until a report of the
decode engine counts the request among those it received (``EngineSummary.num_received``
reaches the request's place in what was sent to it): until then a restart finds the prefilled
copy and hands it off again.

If the decode engine fails, dies or leaves first, its requests move by their own way and the
prefilled copies are let go (``drop``); ``stale`` lets go of any a silent engine never
confirmed, so nothing is kept for ever.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

MAX_UNCONFIRMED_S = 30.0  # an engine that has not reported for this long is not stepping


@dataclass(slots=True)
class _Waiting:
    seq: int  # the request's place among those sent to the decode engine (1-based)
    since: float  # time.monotonic() of the hand-off
    prefill: str  # the prefill instance holding the copy
    internal_id: str


class HandOffs:
    """Per decode instance, the hand-offs it has not confirmed yet, in the order sent."""

    def __init__(self) -> None:
        self._waiting: dict[str, deque[_Waiting]] = {}

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def __len__(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def expect(self, decode: str, seq: int, prefill: str, internal_id: str) -> None:
        """``internal_id``, prefilled on ``prefill``, was sent to ``decode`` as its
        ``seq``-th request."""
        entry = _Waiting(seq, time.monotonic(), prefill, internal_id)
        self._waiting.setdefault(decode, deque()).append(entry)

    def received(self, decode: str, num_received: int) -> dict[str, list[str]]:
        """``decode`` reported ``num_received`` requests received: the confirmed hand-offs,
        by prefill instance."""
        waiting = self._waiting.get(decode)
        confirmed: dict[str, list[str]] = {}
        while waiting and waiting[0].seq <= num_received:
            entry = waiting.popleft()
            confirmed.setdefault(entry.prefill, []).append(entry.internal_id)
        if waiting is not None and not waiting:
            del self._waiting[decode]
        return confirmed

    def drop(self, decode: str) -> dict[str, list[str]]:
        """``decode`` failed, died or left: every hand-off to it, by prefill instance."""
        confirmed: dict[str, list[str]] = {}
        for entry in self._waiting.pop(decode, ()):
            confirmed.setdefault(entry.prefill, []).append(entry.internal_id)
        return confirmed

    def stale(self, now: float, max_age_s: float = MAX_UNCONFIRMED_S) -> dict[str, list[str]]:
        """Hand-offs older than ``max_age_s`` (their engine stopped reporting), let go."""
        confirmed: dict[str, list[str]] = {}
        for decode in list(self._waiting):
            waiting = self._waiting[decode]
            while waiting and now - waiting[0].since > max_age_s:
                entry = waiting.popleft()
                confirmed.setdefault(entry.prefill, []).append(entry.internal_id)
            if not waiting:
                del self._waiting[decode]
        return confirmed
