"""``InstanceEngine``: one instance's engine -- its ``Scheduler``, its ``EngineLoop``, its
worker(s) -- and the requests it holds (DESIGN §2, the control-plane issue).

The central ``SchedulerActor`` decides *where* a request runs; the engine runs it there::

    SchedulerActor ── add([Placement]) / abort(ids) ──▶ InstanceEngine ── steps ──▶ worker(s)
          ▲                                                   │
          └──────── EngineReport, one per step ───────────────┤ outputs, per step, straight
                    (load, prefix-cache events, finished,      ▼ to the request's Sink
                     prefilled, lost on failure)               client

What the central scheduler learns of an instance is the ``EngineReport`` of each step (and
one at once when something ends outside a step, a failure, a rejoin): the ``EngineSummary``
(load, KV usage, prefix-cache events) and per request only its milestones (finished,
prefilled and waiting for its decode instance, lost with a failed worker) -- never its tokens.
The engine streams each step's tokens to the request's ``Sink`` itself, numbered (``index``:
the request's output position of the first token). In one process the sinks keep order by
themselves (one event loop); the numbers are what a client that receives one request from
engines in several processes (prefill, then decode; a move) will order them by.

The engine also watches its workers: a step that fails, a health check that finds a worker
dead, a step that hangs. Its requests are then reported ``lost`` with the tokens their client
already has (the central scheduler places them again), and a restartable instance is brought
back with a fresh scheduler (``rejoined``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from cluster.config import ClusterConfig
from cluster.control.engine_loop import EngineLoop
from cluster.control.engine_reports import EngineOutcome, EngineReport, Lost, Prefilled
from cluster.control.heap import refreeze_heap
from cluster.control.held import Held, Placement, RequestPlace
from cluster.control.placement import InstanceSpec
from cluster.control.recovery import check_workers, end_hung_workers, restore_workers
from cluster.control.summaries import EngineSummary
from kv_transfer.connector import PDConnector
from scheduler import CacheConfig, Scheduler
from scheduler.outputs import EngineCoreOutput
from scheduler.request import FinishReason, RequestStatus

logger = logging.getLogger(__name__)


def _keep_held(loop: EngineLoop, request_ids: list[str], reason: str) -> None:
    """A stopping engine's failure: its requests stay held (``InstanceEngine.stop``)."""


def _discard(loop: EngineLoop, outputs: list[EngineCoreOutput]) -> None:
    """The outputs of a closed engine's loop (none come after ``stop``)."""


class InstanceEngine:
    """One instance: builds its scheduler and loop, takes placements, streams their outputs,
    reports each step to ``on_report`` and recovers its workers."""

    remote = False  # in the caller's process (``RemoteEngine``: in an actor of its own)

    def __init__(
        self,
        config: ClusterConfig,
        spec: InstanceSpec,
        max_model_len: int,
        on_report: Callable[[EngineReport], None],
        observer: Any,
    ) -> None:
        self.config = config
        self.spec = spec
        self.instance_id = spec.instance_id
        self.role = spec.pool.role
        self.max_model_len = max_model_len
        self.on_report = on_report
        self.observe = observer
        self.held: dict[str, Held] = {}  # by internal id
        self.draining = False  # set by the owner: leaving the cluster
        self.failed: str | None = None  # why the current loop failed (until a rejoin)
        self._finished: list[str] = []  # since the last report
        self._outcomes: dict[str, EngineOutcome] = {}
        self._prefilled: list[Prefilled] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.loop = self._build_loop()

    # -- life cycle --------------------------------------------------------------------------
    def _build_loop(self) -> EngineLoop:
        spec, pool = self.spec, self.spec.pool
        sched_config = pool.scheduler_config(self.max_model_len)
        if pool.role != "prefill":  # the side that loads applies the failure policy
            sched_config = sched_config.model_copy(
                update={"kv_load_failure_policy": self.config.kv_transfer.failure_policy}
            )
        cache = CacheConfig(
            **{**pool.cache, "block_size": spec.info["block_size"]},
            num_blocks=spec.info["num_blocks"],
        )
        connector = None
        if self.config.disaggregated:
            connector = PDConnector(
                spec.instance_id, spec.info["block_size"], self.config.kv_transfer.timeout_s
            )
        scheduler = Scheduler(sched_config, cache, self.config.lora, connector)
        # Pipeline stages each hold one step; async scheduling overlaps two on one worker.
        in_flight = pool.pp_size if pool.pp_size > 1 else 2 if sched_config.async_scheduling else 1
        loop = EngineLoop(
            spec.instance_id,
            scheduler,
            spec.executor,
            self._on_outputs,
            admission_window_s=self.config.admission_window_s,
            max_in_flight=in_flight,
            on_failure=self._on_loop_failed,
            step_timeout_s=self.config.step_timeout_s if spec.actors else None,
        )
        loop.on_scheduled = self._on_scheduled
        loop.on_preempted = self._on_preempted
        loop.on_kv_loads = self._on_kv_loads
        loop.on_summary = self._on_summary
        loop.on_step = self._on_step
        return loop

    def start(self) -> None:
        self.loop.start()
        if self.spec.actors and self.config.health_check_interval_s > 0:
            self._spawn(self._monitor_health())

    async def stop(self) -> None:
        """Stop stepping (not a failure: nothing is reported lost) and the health checks. A
        step that fails meanwhile (its worker died in the drain's last moment) leaves its
        requests held, for the owner to take (``take_all``) and move: they ended with an
        error, the very requests a retire was to move."""
        for task in list(self._tasks):
            task.cancel()
        self.loop.on_failure = _keep_held
        await self.loop.stop()

    def close(self) -> None:
        """After ``stop``: let go of the loop (its scheduler holds the requests' KV handles):
        the loop's callbacks point back here; the cycle is cut so that reference counting
        frees the pair (what else is cyclic -- the block pool's free list -- needs the
        collector: the owner calls ``refreeze_heap`` after dropping the engine)."""
        loop = self.loop
        loop.on_outputs = _discard
        loop.on_failure = None
        loop.on_scheduled = loop.on_preempted = None
        loop.on_kv_loads = None
        loop.on_summary = None

    @property
    def alive(self) -> bool:
        return self.loop.alive

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # e.g. a recovery that
            exc = task.exception()  # could not reload a worker: the instance stays out
            name = getattr(task.get_coro(), "__qualname__", "a task")
            logger.error("instance %s: %s failed: %r", self.instance_id, name, exc)

    # -- requests ----------------------------------------------------------------------------
    def add(self, placements: list[Placement]) -> None:
        """Take requests; each is admitted before the next step. On a failed instance they
        are reported lost at once (the central scheduler places them elsewhere)."""
        for placement in placements:
            request = placement.request
            self.held[request.request_id] = Held(
                placement,
                list(request.output_token_ids),
                placement.num_cached_tokens,
                first_token_at=placement.first_token_at,
                last_token_at=placement.last_token_at,
            )
            self.loop.add_request(request)

    def abort(self, internal_ids: list[str]) -> None:
        """End requests wherever they are here, without an output (the caller answers their
        client); their blocks are freed (after a load in progress into them ends). An
        engine actor's part of a traced request ends its open spans (a restarted central
        scheduler drops a copy of a request that goes on elsewhere)."""
        for internal in internal_ids:
            held = self.held.pop(internal, None)
            if held is not None and held.trace is not None:
                held.trace.left("dropped here: the request goes on elsewhere")
        self.loop.abort(internal_ids)

    def end(self, internal_id: str, reason: FinishReason, error: str | None = None) -> bool:
        """End a request with a final output to its client (an abort): False if it is not
        here (finished, or never arrived)."""
        held = self.held.pop(internal_id, None)
        if held is None:
            return False
        self.loop.abort([internal_id])
        out = EngineCoreOutput(held.placement.client_request_id, [], reason, error=error)
        held.placement.sink(out, len(held.tokens))
        self.observe.finished(held, out, self)
        return True

    # -- outputs -----------------------------------------------------------------------------
    def _on_outputs(self, loop: EngineLoop, outputs: list[EngineCoreOutput]) -> None:
        if loop is not self.loop:
            return  # a stale output of a loop that failed
        held_by_id = self.held
        observe = self.observe
        for out in outputs:
            held = held_by_id.get(out.request_id)
            if held is None:
                continue  # aborted
            placement = held.placement
            if held.num_cached_tokens is None:
                held.num_cached_tokens = out.num_cached_tokens
            index = len(held.tokens)
            new = out.new_token_ids
            if out.finished and placement.hand_off and self._prefilled_now(held, out):
                continue
            if out.finished and out.kv_transfer_params and out.kv_transfer_params.get("handle"):
                # It ends here (its first token ended it, or it asked for one token only:
                # placed on a prefill instance with no hand-off): nobody will read its KV.
                self.release_kv(out.request_id)
            internal_id = out.request_id
            # The step's output becomes the client's (the scheduler keeps no reference to
            # it): the client's id, the prefix hit it was told, and no KV handle -- handles
            # never leave the control plane.
            out.request_id = placement.client_request_id
            out.num_cached_tokens = held.num_cached_tokens
            out.kv_transfer_params = None
            if new and held.made_here_from is None:
                held.made_here_from = (time.monotonic(), index)
            held.tokens.extend(new)
            observe.tokens_out(held, self, len(new))
            if out.finish_reason is not None:
                del held_by_id[internal_id]
                self._finished.append(internal_id)
                self._outcomes[internal_id] = (
                    out.finish_reason.value,
                    out.error,
                    len(held.tokens),
                    time.time_ns(),
                )
                observe.finished(held, out, self)
            placement.sink(out, index)

    def release_kv(self, internal_id: str) -> None:
        """A prefilled request will not be handed off (it ended at its first token, was
        aborted, or has no decode instance): the prefill worker ends the lease on its KV
        at the next step instead of at expiry, and its blocks are freed."""
        if self.failed is not None:  # its worker is gone, and its leases with it
            return
        connector = self.loop.scheduler.connector
        if isinstance(connector, PDConnector):
            connector.release(internal_id)
            self.loop.wake()

    def _prefilled_now(self, held: Held, out: EngineCoreOutput) -> bool:
        """The prefill part sampled the first token. Unless the request is complete with it,
        send the token to the client (not as its last) and report the request prefilled: it
        continues on a decode instance. False: it ends here as it is."""
        request = held.placement.request
        if out.finish_reason != FinishReason.LENGTH or out.error:
            return False
        if request.num_prompt_tokens + 1 >= self.max_model_len:
            return False
        first = EngineCoreOutput(
            held.placement.client_request_id,
            out.new_token_ids,
            None,
            None,
            held.num_cached_tokens or 0,
            None,
            out.new_logprobs,
            prompt_logprobs=out.prompt_logprobs,
        )
        index = len(held.tokens)
        held.tokens.extend(out.new_token_ids)
        self.observe.tokens_out(held, self, len(out.new_token_ids))
        del self.held[out.request_id]
        held.placement.sink(first, index)
        self._prefilled.append(
            Prefilled(
                out.request_id,
                first,
                out.kv_transfer_params,
                out.num_cached_tokens,
                held.first_token_at,
                held.first_scheduled_at,
            )
        )
        return True

    def _on_summary(self, loop: EngineLoop, summary: EngineSummary) -> None:
        if loop is not self.loop:
            return
        report = EngineReport(self.instance_id, summary, self._finished, self._prefilled)
        report.outcomes = self._outcomes
        connector = loop.scheduler.connector
        if isinstance(connector, PDConnector):
            report.kv_unread = connector.take_unread()
        self._finished, self._prefilled, self._outcomes = [], [], {}
        self.on_report(report)

    # -- metrics -----------------------------------------------------------------------------
    def _on_scheduled(self, loop: EngineLoop, internal_id: str) -> None:
        held = self.held.get(internal_id)
        if held is not None:
            self.observe.scheduled(self, held)

    def _on_preempted(self, loop: EngineLoop, internal_id: str) -> None:
        held = self.held.get(internal_id)
        if held is not None:
            self.observe.preempted(self, held)

    def _on_step(self, loop: EngineLoop, num_tokens: int) -> None:
        self.observe.step(self, num_tokens)

    def _on_kv_loads(self, loop: EngineLoop, loads: list[tuple[str, float, int, bool]]) -> None:
        self.observe.kv_loads(self, loads, self.held)

    # -- failures ----------------------------------------------------------------------------
    def _on_loop_failed(self, loop: EngineLoop, _ids: list[str], reason: str) -> None:
        """The loop stopped on a failure: report every request held lost -- the loop's and
        those placed that never reached it -- with the tokens their clients have, and bring
        the workers back if they restart."""
        if loop is not self.loop:
            return
        lost = self.take_all(reason)
        first_failure = self.failed is None
        self.failed = reason
        connector = loop.scheduler.connector
        if isinstance(connector, PDConnector):  # no step will send them: the leases died
            connector.drop_releases()  # with the worker
        summary = loop.summary()
        report = EngineReport(
            self.instance_id,
            summary,
            self._finished,
            self._prefilled,
            lost,
            failure=reason if first_failure else None,
            outcomes=self._outcomes,
        )
        if isinstance(connector, PDConnector):  # their sources may still let them go
            report.kv_unread = connector.take_unread()
        self._finished, self._prefilled, self._outcomes = [], [], {}
        if first_failure:
            logger.warning("instance %s failed: %s", self.instance_id, reason)
            pool = self.spec.pool
            if self.spec.actors and not self.draining and (loop.hung or pool.max_restarts > 0):
                self._spawn(self._recover(loop.hung))
        self.on_report(report)

    async def _monitor_health(self) -> None:
        """Find dead workers of an idle instance too (a step finds them on its own): every
        ``health_check_interval_s``, ask each worker; one that died fails the instance."""
        interval = self.config.health_check_interval_s
        while True:
            await asyncio.sleep(interval)
            if self.loop.alive:
                await check_workers(self.loop, self.spec, timeout_s=10 * interval)

    async def _recover(self, hung: bool) -> None:
        """End a hung worker (it still runs its step), then bring the instance back if Ray
        restarts its workers: a fresh scheduler, an empty cache."""
        if hung:
            await end_hung_workers(self.spec)
        if self.spec.pool.max_restarts <= 0:
            return
        if not await restore_workers(self.spec, self.config.startup_timeout_s):
            logger.error("instance %s did not come back; it stays out of routing", self.instance_id)
            return
        if self.draining:
            return  # it is leaving its pool
        self.close()  # the failed loop goes; its block pool is cyclic garbage
        self.loop = self._build_loop()
        refreeze_heap()
        self.failed = None
        self.loop.start()
        logger.info("instance %s rejoined with an empty cache", self.instance_id)
        report = EngineReport(self.instance_id, self.loop.summary(), rejoined=True)
        self.on_report(report)

    def take_all(self, reason: str | None = None) -> list[Lost]:
        """Every request still here, as lost -- the instance failed, or left its pool after
        its drain timeout: the central scheduler places them again."""
        lost = [h.lost(i) for i, h in self.held.items()]
        reason = reason or f"instance {self.instance_id} left its pool"
        for held in self.held.values():
            if held.trace is not None:  # an engine actor's part: its open spans end here
                held.trace.left(reason)  # (they were dropped unended, never exported)
        self.held.clear()
        return lost

    def take_unread_kv(self) -> list[tuple[str, str]]:
        """After ``stop`` (the instance leaves its pool): (internal id, source instance) of
        the hand-offs still here whose KV will not be read now -- queued, arriving, or
        loading (their reads end with the workers) -- and of unread ones not reported yet.
        Their sources let the KV go now rather than at the lease's expiry (as a failure's
        ``abandon_all`` does). The requests themselves move (``take_all``)."""
        connector = self.loop.scheduler.connector
        if not isinstance(connector, PDConnector):
            return []
        self.loop.abandon_all(RequestStatus.FINISHED_ABORTED)
        return connector.take_unread()

    def fail(self, reason: str, hung: bool = False) -> None:
        """Declare the instance failed from outside (tests, an operator; ``hung``: its
        workers did not answer, so they are ended, as after a step timeout)."""
        if hung and self.loop.alive:
            self.loop.hung = True
        self.loop.fail(reason)

    # -- introspection -----------------------------------------------------------------------
    def holds_requests(self) -> bool:
        """Requests still here: queued, running, or finished with KV still to send."""
        loop = self.loop
        return bool(self.held or loop.pending or loop.scheduler.holds_requests())

    def phase(self, internal_id: str) -> str | None:
        """Where a request is here: ``queued`` (arriving, waiting, preempted), ``transfer``
        (its KV loads), ``prefill`` / ``decode`` (running) -- None if it is not here."""
        held = self.held.get(internal_id)
        if held is None:
            return None
        request = self.loop.scheduler.requests.get(internal_id)
        if request is None or request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            return "queued"
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return "transfer"
        return "prefill" if self.role == "prefill" else "decode"

    def num_tokens(self, internal_id: str) -> int | None:
        """Output tokens a request held here has sent to its client so far."""
        held = self.held.get(internal_id)
        return None if held is None else len(held.tokens)

    def describe_requests(self, internal_ids: list[str]) -> dict[str, RequestPlace]:
        """``phase`` and ``num_tokens`` of each request."""
        return {i: (self.phase(i), self.num_tokens(i)) for i in internal_ids}

    def handed_off(self, internal_ids: list[str]) -> None:
        """The central scheduler took these prefilled requests on (nothing to forget in one
        process; an ``EngineActor`` keeps them until then)."""

    def stats(self) -> dict[str, Any]:
        scheduler = self.loop.scheduler
        kv = scheduler.kv_cache_manager
        stats = {
            "role": self.role,
            "engine_pid": os.getpid(),  # the process its scheduler and loop run in
            "block_size": kv.block_size,
            "enable_prefix_caching": kv.enable_caching,
            "draining": self.draining,  # leaving its pool (a shrink): takes no new request
            **self.loop.stats(),
        }
        if self.config.lora is not None:  # vLLM's lora_requests_info
            running: set[str] = set()
            waiting: set[str] = set()
            for request in scheduler.requests.values():
                if request.lora_request is not None and not request.is_finished:
                    into = running if request.status == RequestStatus.RUNNING else waiting
                    into.add(request.lora_request.lora_name)
            stats["max_loras"] = self.config.lora.max_loras
            stats["running_loras"] = sorted(running)
            stats["waiting_loras"] = sorted(waiting)
        return stats

    def check_integrity(self) -> None:
        self.loop.scheduler.check_integrity()

    def reset_prefix_cache(self) -> bool:
        done = self.loop.scheduler.reset_prefix_cache()
        if done:
            self.loop.summarize()  # the router's mirror forgets the prefixes now
        return done
