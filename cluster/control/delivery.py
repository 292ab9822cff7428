"""How a ``Subscription`` delivers outputs: each request's in the order of their positions,
whichever stream brings them -- the central actor's and, with engine actors, every engine's
(a request's first token from its prefill engine, the rest from its decode engine) -- and how
it follows those engines: streams that break and are opened again, refills of what a broken
stream lost, gaps that never fill, and the tokens a request on a dead engine resumes after."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from typing import Any

from cluster.control.flights import Outcome, unpack_indexed
from cluster.engine.streams import Mailbox
from cluster.errors import StreamLostError
from scheduler import Request
from scheduler.outputs import EngineCoreOutput

# How long a client waits for its stream from a dead engine to end before it tells the
# central actor the tokens its requests there have (``Delivery._resume``).
RESUME_WAIT_S = 5.0
# How long a request may hold back outputs for a missing one (after a broken stream, the
# engines being asked again meanwhile: ``Delivery._fill_gaps``) before it fails.
GAP_GIVE_UP_S = 60.0

logger = logging.getLogger(__name__)


class Delivery:
    """A ``Subscription``'s delivery of outputs (a mixin: its state is the subscription's)."""

    handle: Any
    client_id: str
    loop: asyncio.AbstractEventLoop
    queues: dict[int, Mailbox[EngineCoreOutput | BaseException]]
    _next_index: dict[int, int]
    _early: dict[int, dict[int, EngineCoreOutput]]
    _tokens: dict[int, list[int]]
    _ended: dict[int, Outcome]
    _finals: OrderedDict[int, Outcome]
    _engines: dict[str, asyncio.Task[None]]
    _actors: dict[str, Any]
    _gap_watch: asyncio.Task[None] | None
    _open: dict[int, tuple[Request, dict[str, str] | None]]

    def abort(self, request_id: str) -> None:  # the subscription's
        raise NotImplementedError

    def _spawn(self, coro: Any) -> None:  # the subscription's
        raise NotImplementedError

    async def _unheard_ends(self) -> None:  # the subscription's
        raise NotImplementedError

    def _deliver_batch(self, wire: list[Any]) -> None:
        queues, next_index, early, tokens = self.queues, self._next_index, self._early, self._tokens
        for submission, out, index in unpack_indexed(wire):
            queue = queues.get(submission)  # type: ignore[arg-type]
            if queue is None:
                continue
            if (
                index is not None
                and not out.finished
                and index == next_index.get(submission, 0)  # type: ignore[arg-type]
                and submission not in early
            ):  # the common case (once per request per step): next in order, none held back
                queue.put_nowait(out)
                new = out.new_token_ids
                if new:
                    tokens.setdefault(submission, []).extend(new)  # type: ignore[arg-type]
                    next_index[submission] = index + len(new)  # type: ignore[index]
            elif index is None:  # no position (an end the central scheduler decided)
                queue.put_nowait(out)
                if out.finished:
                    self._end_of(submission, out)  # type: ignore[arg-type]
            else:
                self._in_order(queue, submission, out, index)  # type: ignore[arg-type]

    def _in_order(
        self,
        queue: Mailbox[EngineCoreOutput | BaseException],
        submission: int,
        out: EngineCoreOutput,
        index: int,
    ) -> None:
        """Deliver ``out`` (its first token at output position ``index``) once everything
        before it is delivered, then the outputs held back that it lets through; what
        overlaps what was delivered is dropped. (A loop, not recursion: after a long gap
        thousands of outputs may be held back.)"""
        todo: list[tuple[int, EngineCoreOutput]] = [(index, out)]  # a stack: the next on top
        while todo:
            index, out = todo.pop()
            expected = self._next_index.get(submission, 0)
            if index > expected:
                self._early.setdefault(submission, {})[index] = out
                self._watch_gaps()
                continue
            if index < expected:  # already delivered in part
                skip = expected - index
                if skip >= len(out.new_token_ids) and not out.finished:
                    early = self._early.get(submission)  # (covered: the next held back
                    if early and min(early) <= expected:  # one may start by now)
                        todo.append((min(early), early.pop(min(early))))
                    continue
                del out.new_token_ids[:skip]
                if out.new_logprobs is not None:  # the last ones are the kept tokens' (a
                    keep = len(out.new_token_ids)  # refill has none for its own tokens)
                    del out.new_logprobs[: max(len(out.new_logprobs) - keep, 0)]
                index = expected
            early = self._early.get(submission)
            if early and out.new_logprobs is None:
                # A refill (no logprobs) that overlaps outputs held back: those give their
                # own positions (with their logprobs, if asked for); its rest, and its end if
                # it has one, come after them.
                cut = max(min(early) - index, 1)
                if cut < len(out.new_token_ids):
                    tokens = out.new_token_ids
                    rest = dataclasses.replace(
                        out, new_token_ids=tokens[cut:], prompt_logprobs=None
                    )
                    todo.append((index + cut, rest))
                    out = dataclasses.replace(
                        out,
                        new_token_ids=tokens[:cut],
                        finish_reason=None,
                        stop_reason=None,
                        error=None,
                    )
            queue.put_nowait(out)
            if out.new_token_ids:
                self._tokens.setdefault(submission, []).extend(out.new_token_ids)
            if out.finished:
                self._end_of(submission, out)
                return
            expected = index + len(out.new_token_ids)
            self._next_index[submission] = expected
            if early:  # the first held-back output, if it now starts at or before the end
                first = min(early)
                if first <= expected:
                    todo.append((first, early.pop(first)))

    def _end_of(self, submission: int, out: EngineCoreOutput) -> None:
        reason = out.finish_reason.value if out.finish_reason is not None else "stop"
        tokens = self._tokens.get(submission)
        count = len(tokens) if tokens else len(out.new_token_ids)
        self._ended[submission] = (reason, out.error, count)

    async def _resume(self, iid: str, submissions: list[int]) -> None:
        """Instance ``iid``'s engine died: once this client's stream from it has ended (so
        every output it sent is delivered; at most ``RESUME_WAIT_S``, then the stream is
        cancelled), tell the central actor which tokens each of ``submissions`` has; they
        move on after them (``control/migration.py``)."""
        stream = self._engines.get(iid)
        if stream is not None:
            done, _ = await asyncio.wait({stream}, timeout=RESUME_WAIT_S)
            stream.cancel()  # nothing of the dead engine may arrive after the answer
            if not done:  # (a stream that ended by itself saw the engine die: it asked)
                self._spawn(self._unheard_ends())
        items: list[tuple[int, list[int] | None, Outcome | None]] = []
        for s in submissions:
            if s in self._ended or s not in self._open:  # its final is here: it is over
                items.append((s, None, self._ended.get(s) or self._finals.get(s)))
                continue
            # What came past a gap came from the dead engine (or before the hand-off): the
            # request goes on from what was delivered (the central actor refills the rest).
            self._early.pop(s, None)
            items.append((s, list(self._tokens.get(s, [])), None))
        if not items:
            return
        try:
            await self.handle.resume.remote(self.client_id, iid, items)
        except Exception as exc:  # the actor ends them when its wait runs out
            logger.warning("client %s: could not resume on %s: %s", self.client_id, iid, exc)

    def _follow(self, engines: dict[str, Any]) -> None:
        """Stream from every engine actor in ``engines`` not streamed from yet."""
        for iid, actor in engines.items():
            if iid not in self._engines:
                task = self.loop.create_task(self._stream_engine(iid, actor))
                self._engines[iid] = task
                self._actors[iid] = actor

    async def _stream_engine(self, iid: str, actor: Any) -> None:
        """Deliver instance ``iid``'s stream. A stream that breaks while the engine lives
        (it answers a ping) is opened again, carrying each open request's next position:
        the engine sends again what the broken stream may have lost, and every other engine
        is asked to as well (a request's first token comes from its prefill engine, the
        rest from its decode engine). So is one whose engine does not answer but is not
        known dead (Ray cannot reach it for now, or it is slow): only the central actor
        declares an engine dead, and then ``_resume`` stops this stream. One whose engine
        died ends: the central actor has its requests move on (``_resume``)."""
        positions: list[tuple[int, int]] | None = None
        backoff = 0.05
        try:
            while True:
                opened = time.monotonic()
                try:
                    async for ref in actor.subscribe.remote(self.client_id, positions):
                        self._deliver_batch(await ref)
                    return
                except Exception as exc:
                    if time.monotonic() - opened > 5.0:  # it had held: not breaking again
                        backoff = 0.05
                    alive = await _answers(actor)
                    if alive is False:
                        logger.warning(
                            "client %s: instance %s's stream ended: %s", self.client_id, iid, exc
                        )
                        # What it sent last may never have come: the final of a request
                        # that ended there just before (the central actor, told so, forgot
                        # it, so no move or resume brings it, and no gap shows it).
                        self._spawn(self._unheard_ends())
                        return
                    logger.warning(
                        "client %s: instance %s's stream broke (%s); %s: streaming again "
                        "from the positions delivered",
                        self.client_id,
                        iid,
                        exc,
                        "it lives" if alive else "it does not answer, and is not known dead",
                    )
                    positions = self._positions()
                    self._spawn(self._refill([i for i in self._actors if i != iid], positions))
                    self._watch_gaps()
                    await asyncio.sleep(backoff)  # (a stream that keeps breaking: less often)
                    backoff = min(2 * backoff, 2.0)
        finally:
            if self._engines.get(iid) is asyncio.current_task():
                del self._engines[iid]
                self._actors.pop(iid, None)

    def _positions(self) -> list[tuple[int, int]]:
        """Each open request's next output position here (for a refill)."""
        return [(s, self._next_index.get(s, 0)) for s in self._open if s not in self._ended]

    def _gaps(self) -> dict[int, int]:
        """Open requests holding back an output because one before it is missing: their
        next position."""
        return {
            s: self._next_index.get(s, 0)
            for s, early in self._early.items()
            if early and s in self._open and s not in self._ended
        }

    def _watch_gaps(self) -> None:
        """Run ``_fill_gaps`` (unless it runs): an output is held back, or a stream broke.
        Held back, the one before it is usually on its way (a decode engine's tokens before
        the prefill engine's first); when it is not -- lost with a stream that ended, or in
        a central scheduler's replay that died with it -- only asking again fills the gap,
        and nothing else asked: the request hung."""
        if self._gap_watch is None or self._gap_watch.done():
            self._gap_watch = self.loop.create_task(self._fill_gaps())

    async def _fill_gaps(self) -> None:
        """While requests hold back outputs for one before them
        that is missing, ask every engine again (after 0.25 s, then less and less often):
        a first token lost with the prefill engine's stream is sent again by the prefill
        engine, which remembers what it handed off, or by the decode engine once the
        request is there. A gap that lasts ``GAP_GIVE_UP_S`` ends its request with an
        error (never a hang)."""
        since: dict[int, float] = {}
        wait = 0.25
        while True:
            await asyncio.sleep(wait)
            wait = min(2 * wait, 2.0)
            gaps = self._gaps()
            if not gaps:
                return
            now = time.monotonic()
            for s in list(since):
                if s not in gaps:
                    del since[s]
            for s in gaps:
                since.setdefault(s, now)
                if now - since[s] > GAP_GIVE_UP_S:
                    queue = self.queues.get(s)
                    if queue is not None:
                        queue.put_nowait(
                            StreamLostError(
                                "an output of the request was lost with a broken stream"
                            )
                        )
                    self._early.pop(s, None)
                    opened = self._open.get(s)
                    if opened is not None:  # nothing may keep running for nobody
                        self.abort(opened[0].request_id)
            await self._refill(list(self._actors), list(gaps.items()))

    async def _refill(self, iids: list[str], positions: list[tuple[int, int]]) -> None:
        """Ask engines ``iids`` at once to send again what they hold from ``positions``."""

        async def one(iid: str) -> None:
            actor = self._actors.get(iid)
            if actor is None:
                return
            try:
                await asyncio.wait_for(
                    _awaited(actor.refill.remote(self.client_id, positions)), RESUME_WAIT_S
                )
            except Exception as exc:  # gone (its requests move on: ``_resume``), or hung
                logger.warning("client %s: no refill from %s: %s", self.client_id, iid, exc)

        await asyncio.gather(*(one(iid) for iid in iids))


async def _answers(actor: Any) -> bool | None:
    """Whether engine actor ``actor`` answers a ping within ``RESUME_WAIT_S``: True; False
    when Ray says it died; None when neither (unreachable for now, or slow)."""
    import ray

    try:
        await asyncio.wait_for(_awaited(actor.ping.remote()), RESUME_WAIT_S)
    except ray.exceptions.ActorDiedError:
        return False
    except Exception:
        return None
    return True


async def _awaited(ref: Any) -> Any:
    return await ref
