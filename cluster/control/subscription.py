"""``Subscription``: one event loop's batched stream to and from a running cluster (the
``ClusterClient``'s connection, ``cluster.control.client``): its submits and aborts in one
Ray call per turn of the loop, its outputs from the SchedulerActor's stream and, with engine
actors, from every engine's, delivered to each request in output order (``delivery.py``);
keep-alives; and what it does while a restartable central actor comes back (its open requests
reconciled with the actor's: ``lost_requests.py``)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator
from typing import Any

from cluster.control.delivery import Delivery
from cluster.control.flights import Abort, Outcome, Stopped
from cluster.control.lost_requests import LostRequests, _op_id
from cluster.engine.streams import Mailbox
from cluster.errors import StreamLostError
from scheduler import Request
from scheduler.outputs import EngineCoreOutput
from scheduler.request import FinishReason

# How often a Subscription tells the SchedulerActor that its client lives.
KEEPALIVE_S = 1.0
# How long a client waits for a restarting central actor (engine actors) before its open
# requests fail.
CENTRAL_RESTART_S = 60.0
# How many ended requests' outcomes a client keeps after their consumers leave, for such a
# resume: the central actor ends their traces with them.
RECENT_FINALS = 4096

logger = logging.getLogger(__name__)


class Subscription(LostRequests, Delivery):
    """One event loop's end of ``SchedulerActor.subscribe``: a task reads the client's batched
    stream (one Ray message per batch, whatever the number of requests) and hands each output
    to its request's queue, by submission: every ``submit`` carries a number of this
    subscription's own, so the late outputs of an earlier request with the same id (aborted,
    say) never reach a new one. When the stream ends -- broken (the actor is gone) or closed
    (the actor dropped this client) -- every open request gets an error and ``ClusterClient``
    opens a new subscription for the next request. A thread tells the actor every second that
    the process lives (a busy event loop does not count as dead). Token ids only:
    ``ClusterClient`` adds detokenization, stop strings and ``n``."""

    def __init__(self, handle: Any, client_id: str) -> None:
        self.handle = handle
        self.client_id = client_id
        self.loop = asyncio.get_running_loop()
        self.queues: dict[int, Mailbox[EngineCoreOutput | BaseException]] = {}
        self.request_ids: dict[str, int] = {}  # open requests: id -> submission
        # A request's outputs may come from several processes (its prefill engine, then its
        # decode engine): each is delivered in the order of its position in the request's
        # output. Per submission: the next position, and outputs that came early.
        self._next_index: dict[int, int] = {}
        self._early: dict[int, dict[int, EngineCoreOutput]] = {}
        # The tokens delivered so far, per submission: what a request on an engine that
        # died resumes after (``_resume``; engine actors).
        self._tokens: dict[int, list[int]] = {}
        # Submissions whose final output is delivered: how they ended. Kept for the last
        # ``RECENT_FINALS`` after their consumer leaves, for a resume that asks (``_resume``).
        self._ended: dict[int, Outcome] = {}
        self._finals: OrderedDict[int, Outcome] = OrderedDict()
        self._engines: dict[str, asyncio.Task[None]] = {}  # engine actors streamed from
        self._actors: dict[str, Any] = {}  # their handles
        self._gap_watch: asyncio.Task[None] | None = None  # after a broken stream
        self._generation = 0  # how often the central actor came back from a restart
        self._central_away = False  # its process died: the client waits for its restart
        # Submitted, not finished: what a restarted central actor may have to be sent again.
        self._open: dict[int, tuple[Request, dict[str, str] | None]] = {}
        self._submissions = itertools.count()
        # Submits and aborts not sent yet, in order: (a submit's (request, trace context,
        # submission) and its future) or (an abort's request id, None). What one turn of the
        # event loop queues goes in one submit_many call; the actor runs a call's items in
        # order, but two calls of one caller may run out of order (an async actor), so the
        # ops of a request id wait while a call carrying that id is on its way -- an abort
        # overtaken by a later submit of the same id would refuse or end the new one.
        self._ops: list[tuple[Any, asyncio.Future[None] | None]] = []
        self._flush_scheduled = False
        self._in_flight: Counter[str] = Counter()  # request ids of the calls on their way
        self._submitting: set[asyncio.Task[None]] = set()
        self._stop = threading.Event()
        self._keepalive = threading.Thread(
            target=self._keep_alive, name=f"keepalive {client_id}", daemon=True
        )
        self._keepalive.start()
        self.task = self.loop.create_task(self._run(), name=f"subscription {client_id}")

    async def stream(
        self, request: Request, trace_context: dict[str, str] | None = None
    ) -> AsyncGenerator[EngineCoreOutput, None]:
        """Submit ``request`` and yield its outputs, the last one finished. Raises the
        cluster's ``ValueError`` for a request it refuses (an id already streaming here
        included), before any output."""
        rid = request.request_id
        if rid in self.request_ids:
            raise ValueError(f"request_id {rid!r} is already in use")
        if self.task.done():
            # (Ended between ``ClusterClient._subscription`` and here -- the central actor
            # dropped this client, or its stream broke: retryable, a 503, not a bug's 500.)
            raise StreamLostError(f"the subscription of client {self.client_id} has ended")
        submission = next(self._submissions)
        queue: Mailbox[EngineCoreOutput | BaseException] = Mailbox()
        # Registered before submitting: outputs may come before submit returns.
        self.queues[submission] = queue
        self.request_ids[rid] = submission
        self._open[submission] = (request, trace_context)
        running = False
        try:
            future = self._submit(request, trace_context, submission)
            try:
                await future
            except (ValueError, RuntimeError):  # refused (or the actor is gone): nothing runs
                raise
            except BaseException:  # cancelled mid-submit: one that never left is taken back;
                self._withdraw(future)  # one on its way is aborted if placed (_send_batch);
                if future.done() and not future.cancelled() and future.exception() is None:
                    self.abort(rid)  # one placed just before the cancel is aborted here
                raise
            running = True
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    running = False  # the stream (or the actor) is gone
                    raise item
                running = not item.finished  # a consumer may leave at the last yield
                yield item
                if item.finished:
                    return
        finally:
            self.queues.pop(submission, None)
            self._next_index.pop(submission, None)
            self._early.pop(submission, None)
            self._tokens.pop(submission, None)
            outcome = self._ended.pop(submission, None)
            if outcome is not None:
                self._finals[submission] = outcome
                if len(self._finals) > RECENT_FINALS:
                    self._finals.popitem(last=False)
            self._open.pop(submission, None)
            if running:  # left before the end: nothing may keep running for nobody
                self.abort(rid)  # (this submit: the id is still its own here)
            self.request_ids.pop(rid, None)

    def abort(self, request_id: str, stopped: bool = False) -> None:
        """Abort ``request_id`` on the cluster, after whatever this subscription submitted
        before (from this event loop); ``stopped``: it met a stop string (it ends as
        ``stop``). An id open here is aborted as its submit, never a later one of the id:
        a batch sent again after the central actor's restart carries the abort again,
        after a submit that reused the id (in the same batch, or taken on by the restarted
        actor); by its id alone, it ended that new request."""
        submission = self.request_ids.get(request_id)
        item: Any
        if submission is not None:
            item = Abort(request_id, submission, stopped)
        else:  # not streamed here (yet): by its id (``EarlyAborts``)
            item = Stopped(request_id) if stopped else request_id
        self._ops.append((item, None))
        self._schedule()

    def _abort_remote(self, item: Any) -> None:
        """Abort the request of a queued op on its own (a stop stays a stop); a submit's only
        as that submit: this call may overtake a later submit of its id (queued here since),
        which it must not end, on arrival or as an abort remembered for it."""
        stopped = isinstance(item, Stopped) or (isinstance(item, Abort) and item.stopped)
        reason = FinishReason.STOP if stopped else FinishReason.ABORT
        if isinstance(item, tuple):
            request, _, submission = item
            self.handle.abort.remote(request.request_id, reason, self.client_id, submission)
        elif isinstance(item, Abort):
            self.handle.abort.remote(item.request_id, reason, self.client_id, item.submission)
        else:
            self.handle.abort.remote(_op_id(item), reason)

    def _submit(
        self, request: Request, trace_context: dict[str, str] | None, submission: int
    ) -> asyncio.Future[None]:
        """Submit ``request`` with the others of this turn of the event loop (one
        ``submit_many`` call). The future fails with the cluster's reason when the request
        is refused."""
        future: asyncio.Future[None] = self.loop.create_future()
        self._ops.append(((request, trace_context, submission), future))
        self._schedule()
        return future

    def _withdraw(self, future: asyncio.Future[None]) -> bool:
        """Take back a submit that has not been sent (True), so nothing needs aborting."""
        for i, (_, pending) in enumerate(self._ops):
            if pending is future:
                del self._ops[i]
                return True
        return False

    def _schedule(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._send_ops)

    def _send_ops(self) -> None:
        """Send what is queued, but for the ops of a request id that a call still on its way
        carries (they wait for it: one id's ops stay in order, and a slow submit -- an
        adapter loading -- holds back only its own id)."""
        self._flush_scheduled = False
        ready: list[tuple[Any, asyncio.Future[None] | None]] = []
        waiting: list[tuple[Any, asyncio.Future[None] | None]] = []
        held: set[str] = set()
        for op in self._ops:
            rid = _op_id(op[0])
            if rid in self._in_flight or rid in held:
                held.add(rid)
                waiting.append(op)
            else:
                ready.append(op)
        self._ops = waiting
        if not ready:
            return
        ids = [_op_id(item) for item, _ in ready]
        self._in_flight.update(ids)
        task = self.loop.create_task(self._send_batch(ready, ids))
        self._submitting.add(task)
        task.add_done_callback(self._submitting.discard)

    async def _send_batch(
        self, ops: list[tuple[Any, asyncio.Future[None] | None]], ids: list[str]
    ) -> None:
        outcomes: list[Exception | None] = []
        deadline = time.monotonic() + CENTRAL_RESTART_S
        try:
            try:
                while True:
                    generation = self._generation
                    try:
                        answer = await self._answer_or_restart(
                            self.handle.submit_many.remote(
                                self.client_id, [item for item, _ in ops]
                            ),
                            generation,
                        )
                    except Exception as exc:
                        # The central actor restarts (engine actors): send again once it is
                        # back; what it placed before it died is in its rebuilt state. One
                        # back that has not rebuilt within its RECOVERY_WAIT_S said so
                        # (UnavailableError): that is the answer, not tried again.
                        if not send_again(exc, bool(self._engines)):
                            raise
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.2)
                        continue
                    if answer is not None:
                        outcomes = answer
                        break
                    # Sent to the actor that died: it may never answer. (The actor answers a
                    # submit sent again with the first try's outcome: ``Intake._submit``.)
            except BaseException as exc:
                # No answer (the actor died, the reply was lost): some may have been placed,
                # so each is aborted -- an abort before its submit is remembered by the actor.
                for item, _ in ops:
                    self._abort_remote(item)
                cause = unwrap_cause(exc, ValueError, RuntimeError)
                error = cause if isinstance(cause, Exception) else RuntimeError(str(cause))
                outcomes = [error] * len(ops)
        finally:
            self._in_flight.subtract(ids)
            self._in_flight += Counter()  # (drops the ids at zero)
            for (item, future), outcome in zip(ops, outcomes or [None] * len(ops), strict=True):
                if future is None:  # an abort: the actor answers None
                    if outcome is not None and outcomes:  # an actor that takes no abort here
                        logger.warning("abort of %s failed: %r", item, outcome)
                        self._abort_remote(item)
                    continue
                if future.cancelled():  # its stream left while it was on its way
                    if outcome is None and outcomes:  # placed: nothing may run for nobody --
                        # ahead of the ops of its id queued since (a new request of the id
                        # reused at once: the abort would end that one instead)
                        self._ops.insert(0, (Abort(item[0].request_id, item[2]), None))
                elif not future.done():
                    if outcome is None and outcomes:
                        future.set_result(None)
                    else:
                        future.set_exception(outcome or RuntimeError("the submit was lost"))
            if self._ops:  # what waited for this call goes now
                self._schedule()

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._submitting.add(task)
        task.add_done_callback(self._submitting.discard)

    async def _answer_or_restart(self, ref: Any, generation: int) -> Any:
        """The answer of the call ``ref``, or None when the central actor came back from a
        restart meanwhile (a call sent to the process that died may never be answered)."""
        call = asyncio.ensure_future(ref)
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(call), 0.5)
            except TimeoutError:
                if self._generation != generation:
                    call.cancel()
                    return None

    async def _run(self) -> None:
        queues = self.queues
        ended: BaseException = StreamLostError(
            f"the SchedulerActor ended the stream of client {self.client_id} (it timed out "
            "or was unsubscribed)"
        )
        try:
            lost_at: float | None = None
            while True:
                try:
                    async for ref in self.handle.subscribe.remote(self.client_id):
                        batch = await ref
                        if lost_at is not None:  # a restarted central actor answers
                            lost_at = None
                            self._central_away = False
                            self._generation += 1
                            self._spawn(self._resubmit_lost())
                        if isinstance(batch, dict):  # a notice: the engine actors to stream
                            self._follow(batch.get("engines", {}))  # from, or an engine died
                            for iid, submissions in batch.get("resume", []):
                                self._spawn(self._resume(iid, submissions))
                            continue
                        self._deliver_batch(batch)
                    return  # the actor ended it (dropped this client)
                except Exception as exc:
                    # The central actor died: with engine actors the requests go on streaming
                    # from the engines while Ray restarts it; subscribe again when it is back.
                    if not (self._engines and _central_gone(exc)):
                        raise
                    if lost_at is None:
                        lost_at = time.monotonic()
                        self._central_away = True
                        logger.warning("client %s: the central scheduler is away", self.client_id)
                    if time.monotonic() - lost_at > CENTRAL_RESTART_S:
                        raise
                    await asyncio.sleep(0.2)
        except BaseException as exc:
            # What the open requests end with: the client's error (HTTP 503), naming why --
            # the kind only: Ray's text of it (an actor's node IP address, process id) is
            # the log's.
            if not isinstance(exc, asyncio.CancelledError):
                logger.warning("client %s: the stream broke: %r", self.client_id, exc)
            ended = StreamLostError(f"the stream from the cluster broke ({type(exc).__name__})")
            raise
        finally:
            self._stop.set()
            for task in self._engines.values():
                task.cancel()
            for queue in queues.values():  # requests still open get the end, never a hang
                queue.put_nowait(ended)
            # The actor's end of the stream may outlive this task (a loop that closed):
            # say goodbye so it forgets this client and aborts whatever is left.
            self.handle.unsubscribe.remote(self.client_id)

    def _keep_alive(self) -> None:
        """(A thread.) Tell the actor every second that this client lives: if the process
        dies, the actor aborts its requests after ``client_timeout_s`` of silence."""
        while not self._stop.is_set():
            try:
                self.handle.keepalive.remote(self.client_id)
            except Exception as exc:  # one failed send must not end them all (the actor
                # would drop this client after its timeout, failing every stream it has)
                logger.warning("client %s: keep-alive not sent: %s", self.client_id, exc)
            self._stop.wait(KEEPALIVE_S)


def _central_gone(exc: BaseException) -> bool:
    """The central actor's process died or is restarting (not an error it raised), or it
    restarted and has not rebuilt its state yet."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    from cluster.errors import UnavailableError

    if isinstance(unwrap_cause(exc, UnavailableError), UnavailableError):
        return True
    return isinstance(exc, (RayActorError, ActorUnavailableError))


def send_again(exc: BaseException, engine_actors: bool) -> bool:
    """Whether submits that failed with ``exc`` are sent again: the central actor's process
    died or restarts (with engine actors, which outlive it). Not when a restarted one said
    it could not rebuild in time (``UnavailableError``): that answer is passed on."""
    from cluster.errors import UnavailableError

    if isinstance(unwrap_cause(exc, UnavailableError), UnavailableError):
        return False
    return engine_actors and _central_gone(exc)


def unwrap_cause(exc: BaseException, *kinds: type[BaseException]) -> BaseException:
    """The actor's own exception inside a ``RayTaskError`` when it is one of ``kinds`` (so
    callers see the ``ValueError`` the cluster raised), else the ``RayTaskError`` itself."""
    inner = getattr(exc, "cause", None)
    return inner if isinstance(inner, kinds) else exc
