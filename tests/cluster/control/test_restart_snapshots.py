"""The rebuild after a central restart asks every engine for its snapshot. An engine that
gave a passing fault (Ray's ActorUnavailableError) was left untaken: nothing ever ended its
requests or freed its resources. It is asked again a few times; one that still does not
answer (while others did) is killed with its workers, as a dead one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError

from cluster.control.restart import gather_snapshots


def _engine(*answers: Any) -> tuple[Any, list[int]]:
    """An engine handle whose snapshot calls give ``answers`` in turn (an exception raised)."""
    asked = [0]

    async def snapshot() -> Any:
        answer = answers[min(asked[0], len(answers) - 1)]
        asked[0] += 1
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return SimpleNamespace(snapshot=SimpleNamespace(remote=snapshot)), asked


def test_an_engine_that_was_briefly_unreachable_is_asked_again() -> None:
    unavailable = ActorUnavailableError("unreachable for now", None)
    late, late_asked = _engine(unavailable, unavailable, "snapshot of d-1")
    never, never_asked = _engine(unavailable)
    dead, dead_asked = _engine(ActorDiedError())
    fine, fine_asked = _engine("snapshot of d-0")
    answers = asyncio.run(gather_snapshots([fine, late, never, dead], waits=(0.0, 0.0, 0.0)))
    assert answers[0] == "snapshot of d-0" and answers[1] == "snapshot of d-1"
    assert isinstance(answers[2], ActorUnavailableError)  # (the rebuild kills it)
    assert isinstance(answers[3], ActorDiedError)
    # Only the passing faults are asked again, each until it answers or the waits run out.
    assert (fine_asked, late_asked, never_asked, dead_asked) == ([1], [3], [4], [1])
