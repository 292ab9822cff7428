"""``EngineLoop``: drives one instance -- its ``Scheduler`` and its worker -- on an asyncio loop.

The step is the in-process engine's, with the worker call awaited::

    admit every pending arrival            (requests sent together are admitted together)
    out = scheduler.schedule()             } up to ``max_in_flight`` steps started (pipeline
    start executor.execute_model(out)      } stages, async scheduling), oldest first
    result = await the oldest step
    outputs = scheduler.update_from_output(out, result)
    on_outputs(self, outputs)              (its InstanceEngine streams them to clients)
    on_summary(self, summary)              (load and prefix-cache events, for the router)

The loop belongs to one ``InstanceEngine`` (``control/engine.py``). An idle loop sends a last
summary, then waits on an event (no polling); the first arrival after idleness waits
``admission_window_s`` so that a burst is admitted as one batch. Outputs that come outside a
step (a request the scheduler refuses, requests failed on a stopped loop) are followed by a
summary at once, so the owner never waits for a step that may not come.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.control.executors import Executor
from cluster.control.summaries import EngineSummary
from cluster.errors import failure_text, rejection
from kv_transfer.connector import KVConnectorReport, KVReadStuck, PDConnector
from scheduler import ModelRunnerOutput, Request, RequestStatus, Scheduler, SchedulerOutput
from scheduler.outputs import EngineCoreOutput
from scheduler.request import FinishReason, RequestRejected

logger = logging.getLogger(__name__)


class StepTimeoutError(RuntimeError):
    """A step did not return within ``step_timeout_s``."""


@dataclass
class LoopCounters:
    """Totals since the loop started (for tests, benchmarks and metrics)."""

    num_steps: int = 0
    num_idle_steps: int = 0  # steps that computed nothing (waiting for KV, for room)
    num_prompt_tokens_computed: int = 0  # prompt positions run through the model
    num_output_tokens_computed: int = 0  # positions of earlier outputs (decode inputs)
    num_generated_tokens: int = 0  # tokens sampled (vLLM's generation tokens)
    num_requests_added: int = 0
    max_in_flight: int = 0  # the most steps in flight at once
    in_flight_sum: int = 0  # steps in flight right after each start (mean = sum / num_steps)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    num_preemptions: int = 0
    kv_bytes_saved: int = 0
    kv_bytes_loaded: int = 0
    # Loads that ended, one per request's load (its pipeline stages' records are merged
    # first: actors.pipeline), and of those the ones that failed or timed out.
    num_kv_stage_loads_ended: int = 0
    num_kv_stage_load_failures: int = 0


OutputsCallback = Callable[["EngineLoop", list[EngineCoreOutput]], None]
# (loop, ids of the requests it held, why): the instance is gone; the owner re-homes what it
# holds (an InstanceEngine also the requests placed that never reached the loop).
FailureCallback = Callable[["EngineLoop", list[str], str], None]
KVLoadsCallback = Callable[["EngineLoop", list[tuple[str, float, int, bool]]], None]


class EngineLoop:
    """One instance's step loop. ``add_request`` / ``abort`` may be called at any time from the
    same event loop; ``run`` steps until ``stop`` (or until the worker fails)."""

    def __init__(
        self,
        instance_id: str,
        scheduler: Scheduler,
        executor: Executor,
        on_outputs: OutputsCallback,
        *,
        admission_window_s: float = 0.002,
        idle_sleep_s: float = 0.002,
        max_in_flight: int = 1,
        on_failure: FailureCallback | None = None,
        step_timeout_s: float | None = None,
    ) -> None:
        """``max_in_flight``: steps started before the oldest returns -- ``pp_size`` for a
        pipeline-parallel instance, 2 with async scheduling, else 1. ``on_failure``: when the
        instance fails, its unfinished requests go there (to move elsewhere) instead of ending
        with an error. ``step_timeout_s``: a step that has not returned by then fails the
        instance (``hung`` tells the owner why) -- counted from its start or, for a step
        started behind another one in flight (the worker runs them in turn), from when that
        one returned."""
        self.instance_id = instance_id
        self.scheduler = scheduler
        self.executor = executor
        self.on_outputs = on_outputs
        self.on_failure = on_failure
        # Set by the owner for metrics: (loop, [(req_id, seconds, bytes, ok)] of ended loads).
        self.on_kv_loads: KVLoadsCallback | None = None
        # ... and (loop, request id) when a request is first scheduled here (queue time).
        self.on_scheduled: Callable[[EngineLoop, str], None] | None = None
        # ... and (loop, request id) when a running request is preempted (its KV freed).
        self.on_preempted: Callable[[EngineLoop, str], None] | None = None
        # ... and (loop, summary) after every step: the instance's load and prefix-cache events
        # for the router (the only thing the central scheduler reads of an instance).
        self.on_summary: Callable[[EngineLoop, EngineSummary], None] | None = None
        # ... and (loop, tokens scheduled) for every step started (metrics).
        self.on_step: Callable[[EngineLoop, int], None] | None = None
        self._kv_events = scheduler.kv_cache_manager.block_pool.record_events()
        self.num_received = 0  # add_request calls so far
        self._failure: str | None = None  # why fail() stopped the loop
        self.admission_window_s = admission_window_s
        self.idle_sleep_s = idle_sleep_s
        self.pending: list[Request] = []  # arrived, not yet given to the scheduler
        self.counters = LoopCounters()
        self.error: str | None = None  # set when the worker failed; the loop has stopped
        self.max_in_flight = max_in_flight
        self.step_timeout_s = step_timeout_s
        # A step outlived step_timeout_s (the worker may still be running it), or a worker's
        # cache may still be written (``KVReadStuck``): the owner ends the worker's process.
        self.hung = False
        self._async = scheduler.scheduler_config.async_scheduling
        # Steps started and not yet applied, oldest first: (step, result, start time).
        self._in_flight: deque[tuple[SchedulerOutput, asyncio.Future[ModelRunnerOutput], float]] = (
            deque()
        )
        # When the last result came back (time.monotonic()): the step now oldest, if it was
        # started before that, queued behind the one that returned until then.
        self._last_result_at = 0.0
        self._wake = asyncio.Event()
        self._stopping = False
        self._task: asyncio.Task[None] | None = None

    # -- control -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name=self.instance_id)

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    @property
    def alive(self) -> bool:
        return self.error is None and not self._stopping

    def add_request(self, request: Request) -> None:
        """Queue a request; it is admitted before the next ``schedule()``. On a loop that has
        stopped, the request ends at once with an error (never silently queued)."""
        self.num_received += 1
        if not self.alive:
            reason = self.error or f"instance {self.instance_id} is stopped"
            self._drop_handles([request])
            self._lost([request.request_id], reason)
            return
        self.pending.append(request)
        self._wake.set()

    def abort(self, request_ids: list[str]) -> None:
        """End requests wherever they are; their blocks are freed (after a load in progress
        into them ends). Nothing is reported for them: the caller answers its client."""
        ids = set(request_ids)
        self._drop_handles([r for r in self.pending if r.request_id in ids])
        self.pending = [r for r in self.pending if r.request_id not in ids]
        self.scheduler.finish_requests(list(ids), RequestStatus.FINISHED_ABORTED)
        self._wake.set()  # a finished request still has blocks to free on the next step

    def _drop_handles(self, requests: list[Request]) -> None:
        """Hand-offs that will never be admitted here: their sources let their KV go (the
        connector reports them unread)."""
        connector = self.scheduler.connector
        if connector is not None:
            for request in requests:
                connector.remote_kv_dropped(request)

    def wake(self) -> None:
        """Step soon (e.g. the connector has instructions for the workers)."""
        self._wake.set()

    def queued_tokens(self) -> int:
        """Tokens this instance still has to compute for the requests it knows (its load)."""
        s = self.scheduler
        total = sum(r.num_tokens for r in self.pending)
        for queue in (s.running, s.holding, s.waiting):
            for r in queue:
                total += max(r.num_tokens - r.num_computed_tokens, 0)
        return total

    def num_waiting(self) -> int:
        """Requests not yet scheduled: still arriving, or in the scheduler's waiting queue."""
        return len(self.pending) + len(self.scheduler.waiting)

    def num_active(self) -> int:
        return len(self.pending) + self.scheduler.get_num_unfinished_requests()

    def summary(self) -> EngineSummary:
        """The instance now, and its prefix-cache events since the last summary."""
        return EngineSummary(
            self.instance_id,
            self.num_received,
            self.queued_tokens(),
            self.num_waiting(),
            self.num_active(),
            self.scheduler.kv_cache_manager.usage,
            self._kv_events.take(),
        )

    def summarize(self) -> None:
        """Send ``on_summary`` a summary now (the owner changed the cache, say)."""
        if self.on_summary is not None:
            self.on_summary(self, self.summary())

    def stats(self) -> dict[str, Any]:
        """State and counters of this instance (for tests, benchmarks and metrics)."""
        s, c = self.scheduler, self.counters
        connector = s.connector if isinstance(s.connector, PDConnector) else None
        return {
            "alive": self.alive,
            "error": self.error,
            "num_requests": len(s.requests),
            "num_unfinished": s.get_num_unfinished_requests(),
            "num_pending": len(self.pending),
            # vLLM's num_requests_waiting counts those loading their KV (the holding ones)
            # too: a decode instance busy loading read as idle to a gateway.
            "num_waiting": self.num_waiting() + len(s.holding),
            "num_running": len(s.running),
            "num_waiting_for_remote_kvs": sum(r.awaiting_remote_kvs for r in s.holding),
            "kv_cache_usage": s.kv_cache_manager.usage,
            "num_free_blocks": s.kv_cache_manager.block_pool.num_free_blocks,
            "num_blocks": s.cache_config.num_blocks,
            "num_steps": c.num_steps,
            "num_prompt_tokens_computed": c.num_prompt_tokens_computed,
            "num_output_tokens_computed": c.num_output_tokens_computed,
            "num_generated_tokens": c.num_generated_tokens,
            "num_requests_added": c.num_requests_added,
            "max_in_flight": c.max_in_flight,
            "mean_in_flight": c.in_flight_sum / c.num_steps if c.num_steps else 0.0,
            "prefix_cache_queries": c.prefix_cache_queries,
            "prefix_cache_hits": c.prefix_cache_hits,
            "num_preemptions": c.num_preemptions,
            "kv_bytes_saved": c.kv_bytes_saved,
            "kv_bytes_loaded": c.kv_bytes_loaded,
            "num_kv_stage_loads_ended": c.num_kv_stage_loads_ended,
            "num_kv_stage_load_failures": c.num_kv_stage_load_failures,
            "connector_pending": 0 if connector is None else connector.num_pending(),
            # Requests whose KV the connector asked the workers to save / to load.
            "num_kv_saves_started": 0 if connector is None else connector.num_saves,
            "num_kv_loads_started": 0 if connector is None else connector.num_loads,
        }

    # -- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Step until ``stop``. Any error -- the worker's, or a bug in scheduling -- ends the
        loop with every request it holds re-homed (``on_failure``) or failed, never with
        requests silently stranded."""
        try:
            await self._run()
        except asyncio.CancelledError:
            self._fail_all(self._failure or f"instance {self.instance_id} was cancelled")
            if self._failure is None:
                raise
        except BaseException as exc:
            logger.exception("engine loop %s failed", self.instance_id)
            if isinstance(exc, KVReadStuck) or isinstance(getattr(exc, "cause", None), KVReadStuck):
                # A copy may still land in its cache: its process must end, as a hung one's.
                self.hung = True
            # (The text ends its requests, and reaches their clients: no Ray internals.)
            self._fail_all(f"instance {self.instance_id} failed: {failure_text(exc)}")

    async def _run(self) -> None:
        scheduler = self.scheduler
        in_flight = self._in_flight
        while not self._stopping:
            if not in_flight and not self.pending and not scheduler.has_requests():
                self.summarize()  # what changed since the last step (aborts, arrivals)
                self._wake.clear()
                await self._wake.wait()
                if not self.alive:  # stop() woke us
                    break
                if self.admission_window_s > 0:
                    await asyncio.sleep(self.admission_window_s)
            self._admit_pending()
            self._fill_pipeline()
            if not in_flight:
                continue
            out, future, started = in_flight[0]
            # (Its clock starts when it reaches the worker: not before the previous returned.)
            since = max(started, self._last_result_at)
            result = await self._result(future, since)  # raises: the worker is gone or hangs
            in_flight.popleft()
            self._last_result_at = time.monotonic()
            outputs = scheduler.update_from_output(out, result)
            self._count_result(result)
            self.counters.num_generated_tokens += sum(len(o.new_token_ids) for o in outputs)
            if outputs:
                self.on_outputs(self, outputs)
            self.summarize()
            # Idle: this step computed nothing, nor will any step still in flight. (Counting
            # any step in flight as work kept the loop from ever pausing once an empty step
            # had been started beside the last real one: with waiting requests that cannot
            # be admitted, every result was followed at once by another empty step.)
            idle = out.total_num_scheduled_tokens == 0 and not any(
                step.total_num_scheduled_tokens for step, _, _ in in_flight
            )
            # The step's objects may hold KV handles (load specs, saved-KV reports): drop them
            # now, not when the next step replaces them, or an idle loop keeps them alive.
            del out, future, result, outputs
            if idle:
                # Nothing to compute: loads in flight (the worker already waited a little for
                # them) or no room yet. Yield rather than spin on the worker -- unless that
                # step only told the workers of finished requests and nothing is left: the
                # loop then waits for an arrival, which starts at once.
                self.counters.num_idle_steps += 1
                if self.pending or scheduler.has_requests():
                    await asyncio.sleep(self.idle_sleep_s)

    async def _result(self, future: asyncio.Future[ModelRunnerOutput], started: float) -> Any:
        """The step's result, or ``StepTimeoutError`` once it is ``step_timeout_s`` old."""
        if self.step_timeout_s is None:
            return await future
        remaining = started + self.step_timeout_s - time.monotonic()
        # asyncio.wait neither cancels the step on timeout nor wraps it in another task.
        done, _ = await asyncio.wait((future,), timeout=max(remaining, 0.0))
        if not done:
            self.hung = True
            raise StepTimeoutError(
                f"instance {self.instance_id}: a step has not returned in "
                f"{self.step_timeout_s:g} s (the worker hangs)"
            )
        return future.result()

    def _count_result(self, result: Any) -> None:
        c, stats = self.counters, self.scheduler.make_stats()
        c.prefix_cache_queries += stats.prefix_cache_queries
        c.prefix_cache_hits += stats.prefix_cache_hits
        c.num_preemptions += stats.num_preemptions
        report = getattr(result, "kv_connector_output", None)
        if isinstance(report, KVConnectorReport):
            c.kv_bytes_saved += report.bytes_saved
            c.kv_bytes_loaded += report.bytes_loaded
            c.num_kv_stage_loads_ended += len(report.loads)
            c.num_kv_stage_load_failures += sum(not ok for *_, ok in report.loads)
            if self.on_kv_loads is not None and report.loads:
                self.on_kv_loads(self, report.loads)

    def _fill_pipeline(self) -> None:
        """Start steps until ``max_in_flight`` are running or nothing more can overlap.

        Sync pipelining (``pp_size`` stages): a request is in at most one step in flight, and
        the running requests are split into ``max_in_flight`` micro-batches so every stage has
        work. Async scheduling: the next step is scheduled while this one runs, with output
        placeholders. A step that schedules nothing is still sent (it carries finished ids and
        KV instructions) but ends the filling."""
        scheduler, in_flight = self.scheduler, self._in_flight
        while len(in_flight) < self.max_in_flight and scheduler.has_requests():
            if in_flight and not self._can_overlap():
                break
            cap = None
            if self.max_in_flight > 1 and not self._async:
                cap = -(-len(scheduler.running) // self.max_in_flight) or None
            out = scheduler.schedule(cap)
            self._count(out)
            if self.on_step is not None:
                self.on_step(self, out.total_num_scheduled_tokens)
            future = asyncio.ensure_future(self.executor.execute_model(out))
            in_flight.append((out, future, time.monotonic()))
            c = self.counters
            c.max_in_flight = max(c.max_in_flight, len(in_flight))
            c.in_flight_sum += len(in_flight)
            if out.total_num_scheduled_tokens == 0:
                break

    def _can_overlap(self) -> bool:
        """Whether another step started now could compute something (steps are in flight)."""
        s = self.scheduler
        if s.waiting:
            return True
        if self._async:
            # Every remaining token already on its way -- by max_tokens or by max_model_len
            # (``max_num_tokens`` is the smaller): a step started now would compute nothing
            # (max_tokens beyond max_model_len sent the workers an empty step beside the
            # last decode of every such request).
            return any(
                len(r.all_token_ids) + r.num_output_placeholders < r.max_num_tokens
                for r in s.running
            )
        return any(r.num_in_flight_tokens == 0 for r in s.running)

    def _admit_pending(self) -> None:
        pending, self.pending = self.pending, []
        errors = []
        for request in pending:
            try:
                self.scheduler.add_request(request)
                self.counters.num_requests_added += 1
            except RequestRejected as exc:  # the client's fault: a 400 at the API
                self._drop_handles([request])  # never loads: its source lets the KV go
                errors.append(
                    EngineCoreOutput(
                        request.request_id, [], FinishReason.ERROR, error=rejection(str(exc))
                    )
                )
            except ValueError as exc:  # the cluster's (a moved request, an id in use): a 503
                if request.request_id not in self.scheduler.requests:
                    # (An id in use: the request admitted under it reads that same handle --
                    # its source must keep the blocks.)
                    self._drop_handles([request])
                errors.append(
                    EngineCoreOutput(request.request_id, [], FinishReason.ERROR, error=str(exc))
                )
        if errors:
            self.on_outputs(self, errors)
            self.summarize()

    def _count(self, out: SchedulerOutput) -> None:
        c = self.counters
        c.num_steps += 1
        if self.on_preempted is not None:
            for req_id in out.preempted_req_ids:
                self.on_preempted(self, req_id)
        n = out.num_scheduled_tokens
        for new in out.scheduled_new_reqs:
            if self.on_scheduled is not None:
                self.on_scheduled(self, new.req_id)
            prompt = len(new.prompt_token_ids)
            self._count_span(new.num_computed_tokens, n[new.req_id], prompt)
        cached = out.scheduled_cached_reqs
        requests = self.scheduler.requests
        for req_id, start in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self._count_span(start, n[req_id], requests[req_id].num_prompt_tokens)

    def _count_span(self, start: int, num: int, num_prompt: int) -> None:
        in_prompt = max(0, min(start + num, num_prompt) - start)
        self.counters.num_prompt_tokens_computed += in_prompt
        self.counters.num_output_tokens_computed += num - in_prompt

    def fail(self, reason: str) -> None:
        """Declare the instance failed from outside (its worker is known dead, e.g. by a
        health check): the loop stops and its requests go to ``on_failure``."""
        if not self.alive:
            return
        self._failure = reason
        if self._task is not None and not self._task.done():
            self._task.cancel()
        else:
            self._fail_all(reason)

    def _fail_all(self, message: str) -> None:
        """The instance is unusable: fail every request it holds and forget its KV state (its
        worker's cache is gone or untrusted), so no block, request or KV handle lingers."""
        logger.error(message)
        self.error = message
        for _, future, _ in self._in_flight:
            future.cancel()
        self._in_flight.clear()
        ids = [r.request_id for r in self.pending]
        try:
            ids = self.abandon_all(RequestStatus.FINISHED_ERROR)
        finally:
            self._lost(ids, message)

    def abandon_all(self, status: RequestStatus) -> list[str]:
        """The loop failed or stopped for good: end every request it holds with ``status``
        -- arrived ones and the scheduler's -- and forget their KV state. Hand-offs among them
        (not admitted yet, queued, loading) are reported unread by the connector, so their
        sources let the KV go (``PDConnector.take_unread``). Returns the requests' ids."""
        ids = [r.request_id for r in self.pending]
        self._drop_handles(self.pending)
        self.pending = []
        return ids + self.scheduler.abandon_all(status)

    def _lost(self, request_ids: list[str], message: str) -> None:
        """Requests this (dead) instance cannot serve: re-homed by ``on_failure`` (called even
        with none: the failure itself matters), or ended with the error."""
        if self.on_failure is not None:
            self.on_failure(self, request_ids, message)
            return
        self.on_outputs(
            self,
            [EngineCoreOutput(rid, [], FinishReason.ERROR, error=message) for rid in request_ids],
        )
        self.summarize()
