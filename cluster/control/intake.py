"""``Intake``: the ``SchedulerActor``'s side of its clients -- what they call to submit,
stream, abort and keep alive (a mixin). Admission (the waiting bound, 429), the request's
``Flight`` and its placement start here; ``scheduler_actor.py`` routes and hands off."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import aclosing
from typing import Any

from cluster.config import ClusterConfig
from cluster.control.clients import Clients
from cluster.control.flights import (
    Abort,
    Flight,
    Outbox,
    Stopped,
    Submission,
    WireOutput,
    admitted_with_another,
    made_after,
    pack_batch,
)
from cluster.control.observer import RequestObserver
from cluster.control.remembered import EarlyAborts, RefusedRequests
from cluster.control.router import family_of
from cluster.control.summaries import InstanceView
from cluster.engine.streams import Mailbox
from cluster.errors import OverloadedError, UnavailableError
from scheduler import Request
from scheduler.outputs import EngineCoreOutput, merge_outputs
from scheduler.request import FinishReason

ENDED_FINAL_WAIT_S = 30.0  # for a final its engine sent while no central actor ran
# A submit refused while ``tandem down`` stops the cluster (a 503 the client may retry).
SHUTTING_DOWN = "the cluster is shutting down (tandem down); retry once it is back"


class Intake:
    """Submits, streams, aborts and keep-alives of the ``SchedulerActor``'s clients."""

    # What of the actor this uses (annotations only: the actor's own or its other mixins').
    config: ClusterConfig
    clients: Clients
    engines: dict[str, Any]
    views: dict[str, InstanceView]
    flights: dict[str, Flight]
    _internal: dict[str, Flight]
    _early_aborts: EarlyAborts
    _refused: RefusedRequests
    observe: RequestObserver
    max_model_len: int
    started: bool
    stopped: bool = False  # shut down for good (``SchedulerActor.shutdown``)
    _ready: Callable[[], Coroutine[Any, Any, None]]
    _kick_recovery: Callable[[], None]
    engine_handles: Callable[[], dict[str, Any]]
    _place: Callable[[Flight], Coroutine[Any, Any, None]]
    _forget: Callable[[Flight], None]
    _end: Callable[..., None]
    # After a restart: the submits (client, submission) that ended on their engines while no
    # central actor heard of it (the rebuild's; its clients may send them again).
    _ended_submits: frozenset[tuple[str, Any]] = frozenset()
    # The flights a later submit of their client replaced (``_submit``), by (client,
    # submission, request id), for an aimed abort that misses (``_replaced``): one holds while
    # the flight is still in ``_internal`` (its engine runs it until its report ends it).
    # Made on first use (an actor built without ``__init__`` has none yet).
    _superseded: dict[tuple[str | None, Submission, str], Flight] | None = None

    async def generate(
        self, request: Request, trace_context: dict[str, str] | None = None
    ) -> AsyncIterator[EngineCoreOutput]:
        """Stream ``request``'s progress: one ``EngineCoreOutput`` per step that produced
        tokens for it (several steps' worth merged when the consumer lags), the last one with
        ``finish_reason`` set. Raises ``ValueError`` before the first output for a request that
        can never be served. A consumer that goes away aborts the request. ``trace_context``:
        the caller's span (a W3C carrier) when tracing is on."""
        if self.config.engine_actors:
            raise ValueError(
                "with engine_actors the engines stream to their clients: use a ClusterClient "
                "(submit / subscribe), not generate()"
            )
        queue: Mailbox[EngineCoreOutput] = Mailbox()
        flight = await self._submit(request, trace_context, queue=queue)
        rid = request.request_id
        try:
            while True:
                out = await queue.get()
                while not out.finished and not queue.empty():
                    out = merge_outputs(out, queue.get_nowait())
                yield out
                if out.finished:
                    return
        finally:
            if self.flights.get(rid) is flight:  # the consumer left early
                self.abort(rid)

    async def submit(
        self,
        request: Request,
        client_id: str,
        trace_context: dict[str, str] | None = None,
        submission: Submission | None = None,
    ) -> None:
        """Start ``request`` for client ``client_id``: its outputs go to the client's batched
        stream (``subscribe``), tagged with ``submission`` (the client's own tag of this
        submit; default the request id), not to a stream of its own. Raises ``ValueError``
        (or ``OverloadedError``) for a request that is refused, ``RuntimeError`` for a client
        that was dropped; otherwise returns once it is placed, and ``abort`` reaches it from
        then on."""
        if self.stopped:  # (before the outbox: ``shutdown`` drops every client)
            raise UnavailableError(SHUTTING_DOWN)
        outbox = self.clients.outbox(client_id)
        await self._ready()
        if (client_id, submission) in self._ended_submits:
            # Placed by this actor's previous process, which died before answering, and
            # ended on its engine meanwhile: its client has (or gets) the final from there.
            # Placed again, it ran to the end for nobody. Should that final never come (lost
            # with a stream), an error ends the request after a while, not a hang; one that
            # comes after the real final is dropped (the client's stream of it has ended).
            error = EngineCoreOutput(
                request.request_id,
                [],
                FinishReason.ERROR,
                error="it ended while the central scheduler restarted, and its final output "
                "did not reach the client",
            )
            loop = asyncio.get_running_loop()
            tag = request.request_id if submission is None else submission
            loop.call_later(ENDED_FINAL_WAIT_S, outbox.put, tag, error, None)
            return
        await self._submit(
            request, trace_context, outbox=outbox, submission=submission, client_id=client_id
        )

    async def submit_many(
        self,
        client_id: str,
        items: list[
            tuple[Request, dict[str, str] | None, Submission | None] | str | Stopped | Abort
        ],
    ) -> list[Exception | None]:
        """``submit`` for several requests of client ``client_id`` in one call -- (request,
        trace context, submission) each -- and ``abort`` for a bare request id (or, as
        ``stop``, a ``Stopped`` one; an ``Abort``: of that submit only), in order.
        Each gets its own outcome: None (placed; aborts always) or the exception that refused
        it, as a value: one refusal does not fail the others. A client sends what it has at
        once this way, so a burst costs a few Ray calls instead of one each, and an abort
        and a later submit of the same id cannot swap."""
        outcomes: list[Exception | None] = []
        for item in items:
            if isinstance(item, Abort):
                reason = FinishReason.STOP if item.stopped else FinishReason.ABORT
                self.abort(item.request_id, reason, client_id, item.submission)
                outcomes.append(None)
                continue
            if isinstance(item, str | Stopped):
                stopped = isinstance(item, Stopped)
                rid = item.request_id if isinstance(item, Stopped) else item
                self.abort(rid, FinishReason.STOP if stopped else FinishReason.ABORT)
                outcomes.append(None)
                continue
            request, trace_context, submission = item
            try:
                await self.submit(request, client_id, trace_context, submission)
            except Exception as exc:
                outcomes.append(exc)
            else:
                outcomes.append(None)
        return outcomes

    async def subscribe(self, client_id: str) -> AsyncIterator[list[WireOutput] | dict[str, Any]]:
        """The outputs of every request ``client_id`` submitted, as they come: one batch per
        wake-up (a step's outputs of every instance at once), one merged output per request
        with its submission tag, each request's last with ``finish_reason`` set, packed as
        plain tuples (``flights.unpack_batch`` restores them). Tokens cross to the client in
        one Ray message per batch, not one per token or per request. When the
        stream ends (the client left, ``unsubscribe``, or it fell silent) its unfinished
        requests are aborted. With ``engine_actors`` the tokens come from the engines (the
        client streams from each, ``EngineActor.subscribe``): this stream first says which
        engines there are, again when that changes (a dict), and carries the ends the actor
        decides. (A generator function itself: Ray streams only those.)"""
        await self._ready()
        # Its outbox is there before the engines are read below: an engine that joins while
        # they go out is noticed (``notify_engines`` tells only the outboxes there are).
        self.clients.outbox(client_id)
        # Where its tokens come from (engine actors): read as its stream takes over the
        # outbox, with nothing awaited in between (``Clients.stream``).
        first = (lambda: {"engines": self.engine_handles()}) if self.config.engine_actors else None
        async with aclosing(self.clients.stream(client_id, first)) as batches:
            async for batch in batches:
                yield batch if isinstance(batch, dict) else pack_batch(batch)

    async def unknown_requests(
        self, client_id: str, pairs: list[tuple[str, Submission]]
    ) -> list[Submission]:
        """Of client ``client_id``'s (request id, submission) pairs, the submissions this
        actor has no request for: after a restart, what its previous process acknowledged
        but never gave an engine (the client sends them again)."""
        await self._ready()
        unknown = []
        for rid, submission in pairs:
            flight = self.flights.get(rid)
            if flight is None or flight.client_id != client_id or flight.tag != submission:
                unknown.append(submission)
        return unknown

    def keepalive(self, client_id: str) -> None:
        """Client ``client_id`` lives (its ``Subscription`` says so every second); one that
        then stays silent for ``client_timeout_s`` is taken for dead (``control/clients.py``)."""
        self.clients.keepalive(client_id)
        self._kick_recovery()

    def unsubscribe(self, client_id: str) -> None:
        """Forget client ``client_id``: its stream ends and its unfinished requests are
        aborted."""
        self.clients.drop(client_id)

    async def _submit(
        self,
        request: Request,
        trace_context: dict[str, str] | None = None,
        queue: Mailbox[EngineCoreOutput] | None = None,
        outbox: Outbox | None = None,
        submission: Submission | None = None,
        client_id: str | None = None,
    ) -> Flight:
        await self._ready()
        if not self.started:
            # Shutting down (``tandem down``: ``shutdown`` clears ``started`` first, then
            # stops the engines, which takes a while) or not started yet: the client may
            # retry (503), as it does once the actor is gone -- not a 500.
            raise UnavailableError(
                SHUTTING_DOWN if self.stopped else "the cluster is not started yet; retry"
            )
        rid = request.request_id
        previous = self.flights.get(rid)
        if previous is not None and self._ended_for_its_client(previous, client_id, submission):
            del self.flights[rid]  # (its engine's last report still finds it by internal id)
            self._supersede(previous)  # (an aimed abort of it still finds it)
        elif previous is not None and _sent_again(previous, client_id, submission):
            # Its client got no answer (the actor seemed away) and sent it again while the
            # first still ran here: it gets the first's outcome. ("Already in use", which the
            # client took for placed, hung its stream when the first then failed.)
            if previous.placing is not None:
                await asyncio.shield(previous.placing)
            return previous
        elif previous is not None:
            raise ValueError(f"request_id {rid!r} is already in use")
        if request.sampling_params.n != 1:
            raise ValueError("sampling_params.n must be 1: clients fan out n > 1")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_tokens} tokens; max_model_len is {self.max_model_len}"
            )
        bound = self.config.serve.max_waiting_requests
        # A user request is admitted or refused as a whole: its first sample of its first
        # prompt is checked, the others of its ``n`` and of a batch of prompts follow it
        # (otherwise n, or a batch, above the bound would be refused forever, on an idle
        # cluster too).
        if bound is not None:
            first = not admitted_with_another(request)
            if first or self._refused.refused(client_id, request):
                waiting = sum(view.num_waiting for view in self.views.values() if view.alive)
                if not first or waiting >= bound:  # (a later part: its first was refused)
                    self._refused.remember(client_id, request)
                    raise OverloadedError(waiting, bound, self.config.serve.retry_after_s)
        # Arrival is stamped here: clients' clocks are not comparable (priority tie-breaks).
        request.arrival_time = time.monotonic()
        flight = Flight(request, queue, outbox, "", "decode")
        flight.submission = submission
        flight.client_id = client_id
        self.observe.arrived(flight, trace_context)
        self.flights[rid] = flight
        flight.placing = asyncio.get_running_loop().create_future()
        aborted = self._early_aborts.take(rid, (client_id, submission))
        if aborted or self._aborted_family(request):  # its abort came
            # first (by its own id, or its n > 1 request's): it ends at once
            self._end(flight, FinishReason.ABORT)
            _settle(flight.placing)
            return flight
        try:
            await self._place(flight)
        except BaseException as exc:
            if self.flights.get(rid) is flight:  # (not ended meanwhile: an abort ends it)
                del self.flights[rid]
                self._internal.pop(flight.internal_id, None)
                if flight.trace is not None:  # its root span ends (it was never exported)
                    flight.trace.finish("error", f"not placed: {exc}")
            _settle(flight.placing, exc)
            raise
        _settle(flight.placing)
        return flight

    def _aborted_family(self, request: Request) -> bool:
        family = family_of(request)
        if family is None:
            return False
        return self._early_aborts.take_sample(family, request.num_samples)

    def _ended_for_its_client(
        self, flight: Flight, client_id: str | None, submission: Submission | None
    ) -> bool:
        """A request its client no longer streams, whose id the client reuses: with engine
        actors the client has its final (or sent an abort) before the engine's report that
        ends it reaches this actor. A client never has two open requests under one id, so
        another submission of the same client means the earlier one is over for it -- unless
        that one was made after it: then this is a late copy of an earlier submit (the client
        had no answer, aborted it and went on), which must not replace the later one."""
        return (
            self.config.engine_actors
            and client_id is not None
            and flight.client_id == client_id
            and submission is not None
            and flight.submission != submission
            and not made_after(flight.submission, submission)
        )

    def abort(
        self,
        request_id: str,
        reason: FinishReason = FinishReason.ABORT,
        client_id: str | None = None,
        submission: Submission | None = None,
    ) -> bool:
        """End a request at whatever stage it is (queued, prefilling, transferring, decoding):
        its blocks are freed on every instance and its stream ends with ``reason`` (``stop``:
        its client found a stop string in its text). False if
        the request is unknown or already finished -- an unknown one may still be on its way
        (Ray can run an abort before the submit sent just before it): it is then aborted as
        soon as it arrives, within ``EarlyAborts.ttl_s``. ``submission`` (of ``client_id``):
        only that submit of the id ends (one its client got no answer for), never a later
        one under the same id."""
        flight = self.flights.get(request_id)
        if submission is not None and (
            flight is None or (flight.client_id, flight.submission) != (client_id, submission)
        ):
            replaced = self._replaced(request_id, client_id, submission)
            if replaced is not None:
                # Placed, then its id taken by a later submit of its client (``_submit``)
                # before this abort came: it runs on in its engine, which ends it now (a
                # move, or its engine's death, ends it by the flag).
                if replaced.aborting is None:
                    replaced.aborting = reason
                engine = self.engines.get(replaced.instance)
                if engine is not None and engine.remote and engine.dead is None:
                    engine.end(replaced.internal_id, reason)
                return True
            self._early_aborts.remember(request_id, aimed=(client_id, submission))
            return False
        if flight is None:
            # The user's id of an n > 1 request: its samples here end now, and the ones
            # still to come as they arrive.
            samples = [f for f in self.flights.values() if family_of(f.request) == request_id]
            count = samples[0].request.num_samples if samples else None
            self._early_aborts.remember_family(request_id, len(samples), count)
            for sample in samples:
                self.abort(sample.request.request_id, reason)
            return bool(samples)
        engine = self.engines.get(flight.instance)
        if engine is not None and engine.remote:
            if engine.dead is None:
                # Its engine answers (a final to the client, then ``finished`` in a report),
                # or, if it no longer holds the request, whoever takes it next sees the flag.
                if flight.aborting is None:  # (a client's stop, then its stream's abort:
                    flight.aborting = reason  # it stays a stop)
                engine.end(flight.internal_id, reason)
                return True
        elif engine is not None and engine.end(flight.internal_id, reason):
            self._forget(flight)
            return True
        # Between instances, or on an engine that died: the actor answers for it.
        self._end(flight, reason, tokens=flight.sent)
        return True

    def _replaced(
        self, request_id: str, client_id: str | None, submission: Submission
    ) -> Flight | None:
        """The flight of submit ``submission`` of ``request_id`` that a later submit of its
        client replaced (``_ended_for_its_client``): its engine still holds it (only its
        engine's report drops it). Looked for only by an aimed abort that missed: by its key,
        not a scan of every flight (misses are routine: a stop's later abort)."""
        if not self._superseded:
            return None
        key = (client_id, submission, request_id)
        flight = self._superseded.get(key)
        if flight is None:
            return None
        if self._runs_superseded(flight):
            return flight  # (kept: a second abort of it finds it too, until its report)
        del self._superseded[key]  # ended meanwhile
        return None

    def _supersede(self, flight: Flight) -> None:
        """Remember ``flight``, whose id a later submit took while its engine still runs it,
        for ``_replaced``. Entries of flights that ended go in a sweep once they outnumber the
        flights there are (valid ones are at most those): amortized O(1) per entry."""
        if self._superseded is None:
            self._superseded = {}
        superseded = self._superseded
        if flight.submission is not None:  # (an aimed abort names its submission)
            superseded[(flight.client_id, flight.submission, flight.request.request_id)] = flight
        if len(superseded) > 2 * len(self._internal) + 64:
            for key in [k for k, f in superseded.items() if not self._runs_superseded(f)]:
                del superseded[key]

    def _runs_superseded(self, flight: Flight) -> bool:
        """``flight`` (replaced under its id) is still here: its engine has not ended it."""
        return (
            self._internal.get(flight.internal_id) is flight
            and self.flights.get(flight.request.request_id) is not flight
        )

    def _client_dropped(self, client_id: str) -> None:
        """Engine actors keep an outbox per client: the dropped one's goes."""
        for engine in self.engines.values():
            if engine.remote:
                engine.drop_client(client_id)


def _sent_again(flight: Flight, client_id: str | None, submission: Submission | None) -> bool:
    """``flight`` is this very submit, sent again by its client (a submission is never
    reused: only a retry carries the same one)."""
    return (
        client_id is not None
        and submission is not None
        and flight.client_id == client_id
        and flight.submission == submission
    )


def _settle(placing: asyncio.Future[None] | None, exc: BaseException | None = None) -> None:
    """Give a submit's outcome to the copies of it that wait (``_sent_again``)."""
    if placing is None or placing.done():
        return
    if exc is None:
        placing.set_result(None)
        return
    placing.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
    placing.exception()  # (none may wait: not logged as never retrieved)
