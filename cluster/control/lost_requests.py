"""``LostRequests``: what a client's ``Subscription`` does about open requests the central
actor may no longer know -- after its restart (sent again when they have no output yet, failed
when they have), and after the death of an engine it streamed from (failed unless their final
comes) -- so that none waits for ever."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from typing import Any

from cluster.control.flights import Abort, Stopped
from cluster.engine.streams import Mailbox
from cluster.errors import StreamLostError
from scheduler import Request
from scheduler.outputs import EngineCoreOutput

# After a restart, how long a request with output that the central actor does not know may
# still end on its own (its final on its way from its engine) before it is called lost.
LOST_GRACE_S = 2.0

logger = logging.getLogger(__name__)


class LostRequests:
    """A ``Subscription``'s reconciliation of its open requests with the central actor (a
    mixin: its state is the subscription's)."""

    handle: Any
    client_id: str
    queues: dict[int, Mailbox[EngineCoreOutput | BaseException]]
    _ops: list[tuple[Any, asyncio.Future[None] | None]]
    _in_flight: Counter[str]
    _open: dict[int, tuple[Request, dict[str, str] | None]]
    _next_index: dict[int, int]
    _early: dict[int, dict[int, EngineCoreOutput]]
    _ended: dict[int, Any]
    _generation: int
    _central_away: bool

    def _spawn(self, coro: Any) -> None:  # the subscription's
        raise NotImplementedError

    def _submit(
        self, request: Request, trace_context: dict[str, str] | None, submission: int
    ) -> asyncio.Future[None]:  # the subscription's
        raise NotImplementedError

    async def _resubmit_lost(
        self, after_restart: bool = True, generation: int | None = None
    ) -> None:
        """After a central actor's restart: ask it which open requests it does not know. One
        without any output yet was acknowledged by the dead process but never given to an
        engine: it is submitted again. One with output was on an engine the restarted actor
        could not take it back from: it ends with an error (never a hang). Not
        ``after_restart`` (an engine died; the central actor that placed them lives): a
        request it does not know has ended, and ends with an error unless its final comes --
        unless the central actor restarted meanwhile (``generation``, as of the engine's death):
        then the restart's own check, which sends those without output again, decides."""
        pending = {_op_id(item) for item, _ in self._ops} | set(self._in_flight)
        asked = {  # (a submit still on its way is not lost: it is being sent again)
            submission: item
            for submission, item in self._open.items()
            if item[0].request_id not in pending
        }
        if not asked:
            return
        pairs = [(request.request_id, submission) for submission, (request, _) in asked.items()]
        try:
            unknown: list[int] = await self.handle.unknown_requests.remote(self.client_id, pairs)
        except Exception as exc:
            logger.warning("client %s: could not reconcile: %s", self.client_id, exc)
            return
        if not after_restart and self._restarted_since(generation):
            return  # (the restarted actor knows none of what its dead process had not placed)
        for submission in unknown:
            request, trace_context = asked[submission]
            if submission not in self._open:
                continue  # ended meanwhile
            if (
                not after_restart
                or self._next_index.get(submission, 0)
                or submission in self._early
            ):
                why = "the central scheduler's restart" if after_restart else "its engine"
                lost = self._lost_unless_it_ends(submission, request.request_id, why, generation)
                self._spawn(lost)
                continue
            self._spawn(self._resubmit_unless_it_ends(submission, request, trace_context))

    async def _unheard_ends(self) -> None:
        """An engine this client streamed from died. A request that ended there just before
        -- its report reached the central actor, which forgot it -- may have lost its last
        output (its final, often with its last tokens) with the engine's stream, and nobody
        sends it again: the central actor moves and resumes only what it still holds, no
        engine remembers it, and nothing comes after a final to show a gap. The requests the
        central actor no longer knows get ``LOST_GRACE_S`` for their final, then fail (they
        waited for ever). (First ``LOST_GRACE_S`` for the engine's last reports to land.) Not
        while the central actor restarts, or once it did: its own check (``_resubmit_lost``
        after the restart) asks after every open request, and sends again those without
        output that the restarted actor does not know -- which this check would fail.
        """
        generation = self._generation
        await asyncio.sleep(LOST_GRACE_S)
        if self._restarted_since(generation):
            return
        await self._resubmit_lost(after_restart=False, generation=generation)

    def _restarted_since(self, generation: int | None) -> bool:
        """Whether the central actor is away, or came back from a restart, since
        ``generation``."""
        return generation is not None and (self._central_away or self._generation != generation)

    async def _resubmit_unless_it_ends(
        self, submission: int, request: Request, trace_context: dict[str, str] | None
    ) -> None:
        """A request without output that the restarted central actor does not know: never
        given to an engine -- unless it ended with no token just before the actor was asked
        (an error at its prefill, an abort), its final still on its way: it is given
        ``LOST_GRACE_S`` to arrive, else it is submitted again (it ran twice, for nobody)."""
        await asyncio.sleep(LOST_GRACE_S)
        if submission not in self._open or submission in self._ended:
            return
        if self._next_index.get(submission, 0) or submission in self._early:
            return  # under way after all: its outputs arrive
        logger.warning("request %s was lost with the central actor: sent again", request.request_id)
        future = self._submit(request, trace_context, submission)
        future.add_done_callback(functools.partial(self._resubmitted, submission=submission))

    async def _lost_unless_it_ends(
        self,
        submission: int,
        request_id: str,
        why: str = "the central scheduler's restart",
        generation: int | None = None,
    ) -> None:
        """A request with output that the restarted central actor does not know: lost with
        the restart -- unless it ended just before the actor was asked, and its final is
        still on its way from its engine (the actor forgets a request once its engine
        reports it ended): it is given ``LOST_GRACE_S`` to arrive. ``generation``: asked after an
        engine's death, as of then (a restart since decides instead)."""
        await asyncio.sleep(LOST_GRACE_S)
        if submission not in self._open or submission in self._ended:
            return
        if self._restarted_since(generation):
            return
        queue = self.queues.get(submission)
        if queue is not None:
            queue.put_nowait(StreamLostError(f"request {request_id} was lost with {why}"))

    def _resubmitted(self, future: asyncio.Future[None], *, submission: int) -> None:
        """A refused resubmit ends its request's stream with the reason."""
        if future.cancelled() or future.exception() is None or _in_use(future.exception()):
            return
        queue = self.queues.get(submission)
        if queue is not None:
            queue.put_nowait(future.exception() or RuntimeError("resubmit failed"))


def _in_use(outcome: BaseException | None) -> bool:
    return isinstance(outcome, ValueError) and "is already in use" in str(outcome)


def _op_id(item: Any) -> str:
    """The request id of a queued op: an abort's id, or a submit's request's."""
    if isinstance(item, Stopped | Abort):
        return item.request_id
    return item if isinstance(item, str) else str(item[0].request_id)
