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


def test_the_drains_go_on_and_a_stopped_engine_is_retired_at_once() -> None:
    """The previous central actor drained d-1 and had stopped d-2's engine (it died in the
    retire, before it moved d-2's requests). d-1's drain goes on; d-2 never steps again: it
    is retired at once, not after the drain timeout (600 s by default) its requests waited."""
    from cluster.control.restart import resume_drains

    shrinks: list[tuple[list[str], float | None]] = []

    async def shrink(ids: list[str], timeout_s: float | None) -> None:
        shrinks.append((ids, timeout_s))

    async def main() -> None:
        tasks: list[asyncio.Task[None]] = []
        actor = SimpleNamespace(
            _shrink=shrink, _spawn=lambda c: tasks.append(asyncio.ensure_future(c))
        )

        def snap(iid: str, draining: bool, stopped: bool = False) -> Any:
            return SimpleNamespace(
                spec=SimpleNamespace(instance_id=iid), draining=draining, stopped=stopped
            )

        snaps = [snap("d-0", False), snap("d-1", True), snap("d-2", True, stopped=True)]
        resume_drains(actor, snaps)
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert shrinks == [(["d-1"], None), (["d-2"], 0.0)]
