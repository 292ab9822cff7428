"""``EngineActor``: one instance's ``InstanceEngine`` in a Ray actor of its own, on the
instance's node (``ClusterConfig.engine_actors``; the control-plane issue)::

    SchedulerActor ── ops(seq, [...]) ──▶ EngineActor ── steps ──▶ worker(s)
          ▲                                 │  │
          └── report(EngineReport) ─────────┘  └── subscribe(client): one batch per step
              (one per step, coalesced while                 to each client, every one
               the last is on its way)                       of its requests' tokens

The central scheduler's calls arrive as numbered op batches and are applied in their order
(Ray runs an async actor's calls in any order; an abort must not overtake its request's
add). Each request's outputs go to its client's ``Outbox`` here, with the position of their
first token, and reach the client in the client's own stream from this actor: tokens never
pass through the central scheduler. What the central scheduler hears is the engine's
``EngineReport`` per step (milestones, load, prefix-cache events), as in one process.

Instants cross processes as ages (``rebase``): two nodes' ``time.monotonic()`` clocks are
not comparable, a duration is.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict, deque
from typing import Any

from cluster.config import ClusterConfig
from cluster.control.engine import InstanceEngine
from cluster.control.engine_reports import EndedTrace, EngineOutcome, EngineReport, Lost, Prefilled
from cluster.control.engine_sender import ReportSender
from cluster.control.engine_snapshot import Snapshots
from cluster.control.engine_streams import ClientStreams
from cluster.control.engine_wire import (
    Route,
    WirePlacement,
    rebase_placement,
    rebase_report,
    sequence_of,
)
from cluster.control.flights import Outbox
from cluster.control.held import Placement, RequestPlace
from cluster.control.placement import InstanceSpec
from cluster.control.refill import PastRequests
from scheduler import Request
from scheduler.outputs import EngineCoreOutput
from scheduler.request import FinishReason

logger = logging.getLogger(__name__)

CENTRAL_WATCH_S = 5.0  # how often an engine asks whether its central actor still exists


class _EndedPrefilled:
    """What the observer reads of a prefilled request ended before its hand-off."""

    trace = None  # (its spans are the engine's, ended at its first token)

    def __init__(self, route: Route, prefilled: Prefilled) -> None:
        self.request: Request = route.request
        self.placement = route  # (its ``client_params``)
        self.sent = list(prefilled.first.new_token_ids)
        self.first_token_at = prefilled.first_token_at
        # Its one token is its last: decode and inference times end there, as vLLM's do,
        # not at an abort long after (``RequestTimes.of``: without it they ran to the end).
        self.last_token_at = prefilled.first_token_at
        self.first_scheduled_at = prefilled.scheduled_at


class EngineActor(ClientStreams, ReportSender, Snapshots):
    """The engine of instance ``spec`` (an async Ray actor, ``num_cpus=0``): started by
    ``RemoteEngine`` (``control/remote_engine.py``) for the central ``SchedulerActor``,
    whose handle is ``central``."""

    def __init__(
        self, config: ClusterConfig, spec: InstanceSpec, max_model_len: int, central: Any
    ) -> None:
        from cluster.control.observer import RequestObserver

        self.config = config
        self.spec = spec
        self.instance_id = spec.instance_id
        self.max_model_len = max_model_len
        self.central = central
        iid, role = spec.instance_id, spec.pool.role
        self.observe = RequestObserver(config, {iid: role}, {iid: spec})
        self.observe.add_instance(iid, role)
        self._latencies: list[tuple[str, float, float]] = []  # for the next report
        self.observe.latency_sink = lambda _iid, kind, seconds, span: self._latencies.append(
            (kind, seconds, span)
        )
        self.engine: InstanceEngine | None = None
        self._outboxes: dict[str, Outbox] = {}
        # Clients the central actor dropped (their outputs go nowhere), the latest
        # DROPPED_REMEMBERED (client ids are unique: an older one never comes back).
        self._dropped: OrderedDict[str, None] = OrderedDict()
        # Per client: the number of its latest stream from here (a client whose stream broke
        # subscribes again; the stream it left stops taking its outputs).
        self._streams: dict[str, int] = {}
        self._past = PastRequests()  # requests that left, for a refill
        self._break: dict[str | None, bool] = {}  # fault injection: streams to break
        self._unreachable_until = 0.0  # fault injection: pings go unanswered until then
        self.num_refilled = 0  # requests whose outputs were sent again (``refill``)
        self.num_report_retries = 0  # reports sent again: the central actor was not reached
        self._incarnation = os.urandom(8).hex()  # of ``EngineReport.sequence``
        self._num_reports = 0
        # Ended traces of reports the central actor did not get (it was away): sent with the
        # next report, so that a restarted one can end their roots.
        self._unsent_traces: dict[str, EndedTrace] = {}
        self._max_seq = 0  # of the internal ids placed here (for a restarted central actor)
        self._routes: dict[str, Route] = {}  # by internal id: the requests placed here
        # Prefilled requests whose hand-off the central scheduler has not confirmed yet: an
        # abort that reaches them here still ends them (their client gets the final).
        self._awaiting: dict[str, Prefilled] = {}
        # Op batches are numbered per epoch: each central scheduler that takes the engine on
        # (after a restart, ``snapshot``) starts a new one, and late batches of an earlier one
        # are dropped (its numbers would collide with the new one's).
        self._epoch = 0
        self._next_op = 0
        self._adapters: Any = None  # the central actor's LoRA registry, kept for its restart
        self._autoscaler: Any = None  # the central actor's autoscaler memo, kept alike
        self._early_ops: dict[int, list[tuple[Any, ...]]] = {}
        self._outgoing: deque[EngineReport] = deque()
        self._wake = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None
        self._stopped = False  # (``stop``: the instance leaves)
        self._watchdog: asyncio.Task[None] | None = None

    # -- life cycle --------------------------------------------------------------------------
    async def start(self) -> str:
        """Build the engine (its scheduler and loop) and start stepping; returns the
        instance id once it serves."""
        if self.engine is None:
            from cluster.control.heap import freeze_heap

            self.engine = InstanceEngine(
                self.config, self.spec, self.max_model_len, self._on_report, self.observe
            )
            self.engine.start()
            self._sender = asyncio.ensure_future(self._send_reports())
            self._watchdog = asyncio.ensure_future(self._watch_central())
            freeze_heap()
        return self.instance_id

    async def _watch_central(self) -> None:
        """The engine and its workers are detached (they outlive a central actor that Ray
        restarts); one whose central actor is dead for good -- not restarting: its owner
        went, or it was killed without a restart -- takes its workers and itself down."""
        from ray.exceptions import ActorDiedError

        while True:
            await asyncio.sleep(CENTRAL_WATCH_S)
            try:
                await self.central.__ray_ready__.remote()
            except ActorDiedError:
                logger.warning(
                    "instance %s: the central scheduler is gone: exiting", self.instance_id
                )
                import ray

                for actor in self.spec.actors:
                    ray.kill(actor)
                ray.actor.exit_actor()  # type: ignore[no-untyped-call]
            except Exception:  # restarting, or slow: ask again later
                continue

    def _engine(self) -> InstanceEngine:
        if self.engine is None:
            raise RuntimeError(f"the engine of instance {self.instance_id} is not started")
        return self.engine

    async def stop(self) -> None:
        """Stop stepping (``InstanceEngine.stop``); the clients' streams end after their last
        outputs."""
        self._stopped = True
        if self.engine is not None:
            await self.engine.stop()
        for outbox in self._outboxes.values():
            outbox.close()

    def take_all(self) -> tuple[list[EngineReport], list[Lost]]:
        """After ``stop`` (the instance leaves): the reports not sent yet (the caller applies
        them) and every request still here as lost -- held ones, and prefilled ones whose
        hand-off was not confirmed (with their first token) -- instants as ages."""
        engine = self._engine()
        lost = engine.take_all()
        unread = engine.take_unread_kv()  # (hand-offs held unread: their sources let go)
        for internal, p in self._awaiting.items():
            tokens = list(p.first.new_token_ids)
            lost.append(
                Lost(
                    internal,
                    tokens,
                    p.first_token_at,
                    p.first_token_at,
                    p.scheduled_at,
                    p.num_cached_tokens,
                )
            )
        self._awaiting.clear()
        if self._sender is not None:
            self._sender.cancel()
        now = time.monotonic()
        reports = list(self._outgoing)
        self._outgoing.clear()
        if unread:
            reports.append(EngineReport(self.instance_id, engine.loop.summary(), kv_unread=unread))
        for report in reports:
            rebase_report(report, -now)
        leftovers = EngineReport(self.instance_id, engine.loop.summary(), lost=lost)
        rebase_report(leftovers, -now)
        return reports, leftovers.lost

    def drained(self) -> bool:
        """No output waits for a client any more (after ``stop``), and no client stream's
        generator still runs (its last batch may be yielded and not yet delivered; Ray ends
        the task once the caller has every item, a moment after the generator returns, so
        this is best effort: the central actor's replay at a move fills what was lost)."""
        return not any(o.pending or o.apart or o.streams for o in self._outboxes.values())

    async def ping(self) -> str:
        silent = self._unreachable_until - time.monotonic()
        if silent > 0:
            await asyncio.sleep(silent)
        return self.instance_id

    # -- the central scheduler's ops, in its order ---------------------------------------------
    def ops(self, epoch: int, seq: int, items: list[tuple[Any, ...]]) -> None:
        """Apply op batch number ``seq`` of ``epoch`` once every earlier batch is applied."""
        if epoch != self._epoch:
            logger.warning("instance %s: ops of an earlier central scheduler", self.instance_id)
            return
        self._early_ops[seq] = items
        while self._next_op in self._early_ops:
            batch = self._early_ops.pop(self._next_op)
            self._next_op += 1
            for item in batch:
                try:
                    self._apply(item)
                except Exception:  # one bad op must not stop the ones after it
                    logger.exception("instance %s: op %s failed", self.instance_id, item[0])

    def _apply(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        engine = self._engine()
        if kind == "add":
            placements = [self._placement(p) for p in item[1]]
            engine.add(placements)
            for placement in placements:  # each route shares its request's token list
                internal = placement.request.request_id
                held, route = engine.held.get(internal), self._routes.get(internal)
                if held is not None and route is not None:
                    route.tokens = held.tokens
        elif kind == "end":
            # Once stopped, the clients' streams are closed: a final made here would reach
            # nobody. The request stays for ``take_all``; the central scheduler, which sent
            # the end, ends it where it moves it (``Flight.aborting``).
            if not self._stopped:
                self._end(item[1], FinishReason(item[2]), item[3])
        elif kind == "abort":
            # (A restarted central scheduler drops a prefilled copy whose decode part runs
            # elsewhere: its KV stays leased, as that part may be reading it; the read's
            # notification, or the lease's expiry, ends it.)
            for internal in item[1]:
                self._routes.pop(internal, None)
                self._awaiting.pop(internal, None)
            engine.abort(item[1])
        elif kind == "release_kv":
            self._engine().release_kv(item[1])
        elif kind == "handed_off":
            for internal in item[1]:
                self._awaiting.pop(internal, None)
                route = self._routes.pop(internal, None)
                if route is not None:  # its first token, should the client have lost it
                    self._past.remember(route, None, len(route.tokens))
        elif kind == "drop_client":
            self._drop_client(item[1])
        elif kind == "draining":
            engine.draining = bool(item[1])
        elif kind == "fail":  # (a batch of an older central actor may have no ``hung``)
            engine.fail(item[1], hung=len(item) > 2 and bool(item[2]))
        elif kind == "adapters":
            self._adapters = item[1]
        elif kind == "autoscaler":
            self._autoscaler = item[1]
        else:
            raise ValueError(f"unknown op {kind!r}")

    def _placement(self, wire: WirePlacement) -> Placement:
        rebase_placement(wire, time.monotonic())
        internal = wire.request.request_id
        self._max_seq = max(self._max_seq, sequence_of(internal))
        trace = None
        if self.observe.tracer is not None and wire.trace_context:
            trace = self._part_trace(wire)
        route = self._routes[internal] = Route(
            wire.client_id,
            wire.submission,
            wire.client_request_id,
            wire.request,
            wire.client_params,
            wire.trace_context,
            wire.arrival_time,
        )
        return Placement(
            wire.request,
            wire.client_request_id,
            self._sink(route),
            hand_off=wire.hand_off,
            num_cached_tokens=wire.num_cached_tokens,
            arrival_time=wire.arrival_time,
            scheduled_at=wire.scheduled_at,
            first_token_at=wire.first_token_at,
            last_token_at=wire.last_token_at,
            trace=trace,
        )

    def _part_trace(self, wire: WirePlacement) -> Any:
        """This engine's spans of a traced request: children of its root (``part``); a
        decode part after a hand-off opens the transfer and decode spans now, and its KV load
        joins the transfer span."""
        from cluster.observability.request_trace import RequestTrace
        from kv_transfer.tracing import extract, inject

        request = wire.request
        trace = RequestTrace(
            self.observe.tracer,  # type: ignore[arg-type]
            extract(wire.trace_context),
            wire.client_request_id,
            request.num_prompt_tokens,
            wire.arrival_time,
            part=True,
            output_tokens=len(request.output_token_ids),
        )
        trace.hand_off = wire.hand_off
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            block_size = self.spec.info["block_size"]
            trace.handed_off(
                self.instance_id,
                self.spec.info.get("node_id"),
                self.config.kv_transfer.transport,
                -(-request.num_prompt_tokens // block_size),
            )
            assert trace.transfer is not None
            request.kv_transfer_params = {**params, "trace_context": inject(trace.transfer)}
        return trace

    def _sink(self, route: Route) -> Any:
        def sink(out: EngineCoreOutput, index: int) -> None:
            outbox = self._outbox(route.client_id)
            if outbox is not None:
                outbox.put(route.submission, out, index)
                if out.finish_reason is not None:
                    self._past.remember(route, out, index)

        return sink

    def _end(self, internal: str, reason: FinishReason, error: str | None) -> None:
        """End a request with a final output to its client: held here (the engine ends
        it), or prefilled and not handed off yet (its first token went out; its KV, kept
        for the decode side, is freed). Either way the central scheduler hears it finished.
        Nothing for a request that already finished here."""
        engine = self._engine()
        held = engine.held.get(internal)
        num_tokens = 0 if held is None else len(held.tokens)
        # (Its route goes with the report that says it finished -- ``_on_report`` drops it --
        # which keeps its root span's carrier in ``ended_traces``: a central actor restarted
        # before that report came ends the span with it, as for a request that ran out.)
        if engine.end(internal, reason, error):
            self._report_finished(internal, (reason.value, error, num_tokens, time.time_ns()))
            return
        prefilled = self._awaiting.pop(internal, None)
        route = self._routes.get(internal)
        if prefilled is None or route is None:
            self._routes.pop(internal, None)
            return
        engine.abort([internal])
        engine.release_kv(internal)  # prefilled, never handed off: nobody will read its KV
        final = EngineCoreOutput(route.client_request_id, [], reason, error=error)
        num_tokens = len(prefilled.first.new_token_ids)
        self._sink(route)(final, num_tokens)
        # Counted here (its engine no longer holds it, and the central scheduler counts
        # nothing of an engine actor's requests): it was missing from the finished ones.
        self.observe.finished(_EndedPrefilled(route, prefilled), final, engine)
        self._report_finished(internal, (reason.value, error, num_tokens, time.time_ns()))

    def _report_finished(self, internal: str, outcome: EngineOutcome) -> None:
        summary = self._engine().loop.summary()
        report = EngineReport(self.instance_id, summary, finished=[internal])
        report.outcomes[internal] = outcome
        self._on_report(report)

    # -- introspection ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return {
            **self._engine().stats(),
            "num_refilled": self.num_refilled,
            "num_report_retries": self.num_report_retries,
            # prefilled, their hand-off not confirmed yet (kept for a central restart)
            "num_awaiting_hand_off": len(self._awaiting),
        }

    def describe_requests(self, internal_ids: list[str]) -> dict[str, RequestPlace]:
        return self._engine().describe_requests(internal_ids)

    def holds_requests(self) -> bool:
        return self._engine().holds_requests() or bool(self._awaiting)

    def check_integrity(self) -> None:
        self._engine().check_integrity()

    def reset_prefix_cache(self) -> bool:
        return self._engine().reset_prefix_cache()

    def metrics_text(self) -> str:
        """This engine's request metrics (its registry; the central scheduler merges every
        engine's into ``/metrics``)."""
        return self.observe.metrics.render_registry()

    async def flush_traces(self) -> None:
        await self.observe.flush()
