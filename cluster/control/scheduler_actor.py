"""``SchedulerActor``: the central coordinator of a Tandem cluster (DESIGN §2).

It owns one ``Scheduler`` + ``EngineLoop`` per instance, the Router, and every request in
flight. ``generate`` is a streaming method: token ids flow back as they are produced -- the
first from the prefill instance (TTFT), the rest from the decode instance::

    generate(req) ─▶ Router ─▶ P? ──────────────────────────────▶ D
                              prefill, 1st token ─▶ client     decode tokens ─▶ client
                              KV saved (handle) ─▶ D request (do_remote_prefill, [1st token])

A plain class: ``build_cluster`` (``cluster.control.launch``) starts it as a named async Ray
actor (``scheduler_actor_class``); tests may inject in-process instances instead of Ray
workers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from cluster.config import ClusterConfig
from cluster.control.adapters import LoRAAdapters
from cluster.control.clients import Clients
from cluster.control.engine_loop import EngineLoop
from cluster.control.flights import (
    EarlyAborts,
    Flight,
    Outbox,
    Submission,
    WireOutput,
    clone_request,
    merge_outputs,
    pack_batch,
    prefill_request,
)
from cluster.control.heap import freeze_heap
from cluster.control.observer import RequestObserver
from cluster.control.placement import InstanceSpec
from cluster.control.recovery import check_workers, end_hung_workers, restore_workers
from cluster.control.router import Route, Router
from cluster.control.summaries import EngineSummary, InstanceView
from cluster.errors import OverloadedError
from kv_transfer.connector import PDConnector
from scheduler import CacheConfig, LoRARequest, Request, Scheduler
from scheduler.outputs import EngineCoreOutput
from scheduler.request import FinishReason, RequestStatus

logger = logging.getLogger(__name__)


class SchedulerActor:
    """Routes requests to instances, drives their loops and streams their tokens."""

    def __init__(self, config: ClusterConfig, instances: list[InstanceSpec] | None = None) -> None:
        self.config = config
        self._specs = instances
        self.router = Router(config.router)
        self.loops: dict[str, EngineLoop] = {}
        # What routing and admission read of each instance: its engine's per-step summaries.
        self.views: dict[str, InstanceView] = {}
        self.roles: dict[str, str] = {}
        self.specs: dict[str, InstanceSpec] = {}
        self.flights: dict[str, Flight] = {}  # by the client's request id
        # The clients streaming in batches (submit / subscribe), and their liveness.
        self.clients = Clients(self.flights, self.abort, config.client_timeout_s)
        self._internal: dict[str, Flight] = {}  # by the schedulers' id
        self._early_aborts = EarlyAborts()  # aborts that overtook their submit
        self._seq = itertools.count()
        self.max_model_len = 0
        self.started = False
        self.num_moves = 0  # requests moved off failed instances
        self.failures: list[dict[str, Any]] = []  # instance failures and rejoins, in order
        self._tasks: set[asyncio.Task[None]] = set()  # moves, rejoins, the health monitor
        self._resizing = asyncio.Lock()  # scale_pool: one resize at a time
        self.observe = RequestObserver(config, self.roles, self.specs)
        self.lora = LoRAAdapters(config, self.specs)  # served by name, loaded per instance

    # -- life cycle --------------------------------------------------------------------------
    async def start(self) -> dict[str, Any]:
        """Start the workers (unless injected), build each instance's scheduler and loop."""
        if self.started:
            return self.describe()
        if self._specs is None:
            from cluster.control.placement import start_workers

            self._specs = await start_workers(self.config, self.config.startup_timeout_s)
        specs = self._specs
        self.max_model_len = self._common_max_model_len(specs)
        for spec in specs:
            self._add_instance(spec)
        if any(spec.actors for spec in specs) and self.config.health_check_interval_s > 0:
            self._spawn(self._monitor_health())
        self._spawn(self.clients.reap_silent())
        self.started = True
        freeze_heap()  # the block pools and the rest of start-up: never garbage
        logger.info("cluster started: %s", ", ".join(f"{i} ({r})" for i, r in self.roles.items()))
        return self.describe()

    def _add_instance(self, spec: InstanceSpec) -> None:
        """Build a started instance's scheduler and loop and let it serve."""
        self.specs[spec.instance_id] = spec
        self.roles[spec.instance_id] = spec.pool.role
        self._install(spec, self._build_loop(spec))
        self.lora.reset(spec.instance_id)
        self.observe.add_instance(spec.instance_id, spec.pool.role)

    def _install(self, spec: InstanceSpec, loop: EngineLoop) -> None:
        """Make ``loop`` the instance's engine, with a fresh view of it, and start it."""
        iid = spec.instance_id
        caching = spec.pool.cache.get("enable_prefix_caching", True)
        self.views[iid] = InstanceView(iid, spec.pool.role, spec.info["block_size"], caching)
        self.loops[iid] = loop
        loop.on_summary = self._on_summary
        loop.start()

    def _common_max_model_len(self, specs: list[InstanceSpec]) -> int:
        """One context length for the whole cluster: a request may land anywhere."""
        limits = [
            min(s.info["max_position_embeddings"], s.info["num_blocks"] * s.info["block_size"])
            for s in specs
        ]
        cap = min(limits)
        wanted = self.config.max_model_len
        if wanted is not None and wanted > cap:
            raise ValueError(
                f"max_model_len ({wanted}) exceeds what the smallest instance holds ({cap} "
                "tokens: its KV cache or the model's max_position_embeddings)"
            )
        return wanted or cap

    def _build_loop(self, spec: InstanceSpec) -> EngineLoop:
        pool = spec.pool
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
            on_failure=self._on_instance_failed,
            step_timeout_s=self.config.step_timeout_s if spec.actors else None,
        )
        loop.on_scheduled = self._on_scheduled
        loop.on_preempted = self._on_preempted
        loop.on_kv_loads = self._on_kv_loads
        return loop

    async def shutdown(self) -> None:
        """Stop every loop, fail what is in flight, release the workers."""
        for task in list(self._tasks):
            task.cancel()
        for loop in self.loops.values():
            loop.on_failure = None  # stopping is not a failure to recover from
            await loop.stop()
        for rid, flight in list(self.flights.items()):
            self._finish(flight, EngineCoreOutput(rid, [], FinishReason.ABORT, error="shutdown"))
        self.clients.close_all()  # their last batches go out, then their streams end
        await self.observe.flush()
        for spec in self.specs.values():
            for actor in spec.actors:
                import ray

                ray.kill(actor)

    # -- requests ----------------------------------------------------------------------------
    async def generate(
        self, request: Request, trace_context: dict[str, str] | None = None
    ) -> AsyncIterator[EngineCoreOutput]:
        """Stream ``request``'s progress: one ``EngineCoreOutput`` per step that produced
        tokens for it (several steps' worth merged when the consumer lags), the last one with
        ``finish_reason`` set. Raises ``ValueError`` before the first output for a request that
        can never be served. A consumer that goes away aborts the request. ``trace_context``:
        the caller's span (a W3C carrier) when tracing is on."""
        queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
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
        outbox = self.clients.outbox(client_id)
        await self._submit(request, trace_context, outbox=outbox, submission=submission)

    async def submit_many(
        self,
        client_id: str,
        items: list[tuple[Request, dict[str, str] | None, Submission | None]],
    ) -> list[Exception | None]:
        """``submit`` for several requests of client ``client_id`` in one call: (request,
        trace context, submission) each, placed in order. Each gets its own outcome -- None
        (placed) or the exception that refused it, as a value: one refusal does not fail the
        others. A client sends what it has to submit at once this way, so a burst of
        requests costs a few Ray calls instead of one each."""
        outcomes: list[Exception | None] = []
        for request, trace_context, submission in items:
            try:
                await self.submit(request, client_id, trace_context, submission)
            except Exception as exc:
                outcomes.append(exc)
            else:
                outcomes.append(None)
        return outcomes

    async def subscribe(self, client_id: str) -> AsyncIterator[list[WireOutput]]:
        """The outputs of every request ``client_id`` submitted, as they come: one batch per
        wake-up (a step's outputs of every instance at once), one merged output per request
        with its submission tag, each request's last with ``finish_reason`` set, packed as
        plain tuples (``flights.unpack_batch`` restores them). Tokens cross to the client in
        one Ray message per batch, not one per token or per request. When the
        stream ends (the client left, ``unsubscribe``, or it fell silent) its unfinished
        requests are aborted. (A generator function itself: Ray streams only those.)"""
        async with aclosing(self.clients.stream(client_id)) as batches:
            async for batch in batches:
                yield pack_batch(batch)

    def keepalive(self, client_id: str) -> None:
        """Client ``client_id`` lives (its ``Subscription`` says so every second); one that
        then stays silent for ``client_timeout_s`` is taken for dead (``control/clients.py``)."""
        self.clients.keepalive(client_id)

    def unsubscribe(self, client_id: str) -> None:
        """Forget client ``client_id``: its stream ends and its unfinished requests are
        aborted."""
        self.clients.drop(client_id)

    async def _submit(
        self,
        request: Request,
        trace_context: dict[str, str] | None = None,
        queue: asyncio.Queue[EngineCoreOutput] | None = None,
        outbox: Outbox | None = None,
        submission: Submission | None = None,
    ) -> Flight:
        if not self.started:
            raise RuntimeError("the cluster is not started")
        rid = request.request_id
        if rid in self.flights:
            raise ValueError(f"request_id {rid!r} is already in use")
        if request.sampling_params.n != 1:
            raise ValueError("sampling_params.n must be 1: clients fan out n > 1")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_tokens} tokens; max_model_len is {self.max_model_len}"
            )
        bound = self.config.serve.max_waiting_requests
        # A user request is admitted or refused as a whole: its first sample is checked, the
        # others of its ``n`` ("{id}#{i}", i > 0) follow it (otherwise n above the bound
        # would be refused forever, on an idle cluster too).
        if bound is not None and not _later_sample(rid):
            waiting = sum(view.num_waiting for view in self.views.values() if view.alive)
            if waiting >= bound:
                raise OverloadedError(waiting, bound, self.config.serve.retry_after_s)
        # Arrival is stamped here: clients' clocks are not comparable (priority tie-breaks).
        request.arrival_time = time.monotonic()
        flight = Flight(request, queue, outbox, next(iter(self.loops.values())), "decode")
        flight.submission = submission
        self.observe.arrived(flight, trace_context)
        self.flights[rid] = flight
        if self._early_aborts.take(rid):  # its abort came first: it ends at once
            self._finish(flight, EngineCoreOutput(rid, [], FinishReason.ABORT))
            return flight
        try:
            await self._place(flight)
        except BaseException:
            if self.flights.get(rid) is flight:
                del self.flights[rid]
                self._internal.pop(flight.internal_id, None)
            raise
        return flight

    async def _place(self, flight: Flight) -> None:
        """Route the flight and give its request to the chosen instance(s), under a fresh
        internal id. Tokens already sent travel with it (a move after a failure): the new
        instance recomputes prompt + those tokens and continues after them."""
        request = flight.request
        for _ in range(3):  # an instance may fail while an adapter loads: route again
            prefill, decode = self._live("prefill"), self._live("decode")
            if not decode:
                raise RuntimeError(self._none_left("decode"))
            if flight.sent:  # moving mid-stream: straight to a decode instance
                route = Route(None, self.router.best_decode(decode))
            else:
                route = self.router.route(request, prefill, decode)
            target = route.prefill or route.decode
            if request.lora_request is not None:
                try:
                    for view in {route.decode, target}:
                        await self.lora.ensure(view.instance_id, request.lora_request)
                except KeyError:
                    continue  # the instance left its pool meanwhile
            if target.serves and route.decode.serves:
                break
        else:
            raise RuntimeError("instances kept failing while the request was being routed")
        if self.flights.get(request.request_id) is not flight:
            return  # aborted while an adapter loaded
        # Schedulers see a unique internal id: an aborted request may linger in one (its
        # blocks wait for a load to end) while the client already reuses its id.
        self._internal.pop(flight.internal_id, None)
        flight.internal_id = internal = f"{request.request_id}@{next(self._seq)}"
        self._internal[internal] = flight
        if route.prefill is None:
            flight.stage = "decode"
            part = clone_request(request, request_id=internal, output_token_ids=list(flight.sent))
        else:
            flight.stage = "prefill"
            flight.decode_target = route.decode
            part = prefill_request(request, internal)
            if flight.trace is not None:  # the prefill worker's save joins the trace
                from kv_transfer.tracing import inject

                assert part.kv_transfer_params is not None
                part.kv_transfer_params["trace_context"] = inject(flight.trace.root)
        flight.loop = self._send(target, part)

    def _send(self, view: InstanceView, request: Request) -> EngineLoop:
        """Give ``request`` to ``view``'s instance (counted in its view at once)."""
        view.sent(max(request.num_tokens - request.num_computed_tokens, 0))
        loop = self.loops[view.instance_id]
        loop.add_request(request)
        return loop

    def _on_summary(self, loop: EngineLoop, summary: EngineSummary) -> None:
        view = self.views.get(loop.instance_id)
        if view is not None and self.loops.get(loop.instance_id) is loop:
            view.update(summary)

    def _none_left(self, role: str) -> str:
        roles = ("decode", "both") if role == "decode" else ("prefill",)
        ids = [i for i, r in self.roles.items() if r in roles]
        failed = [f for f in self.failures if f["instance_id"] in ids and f["event"] == "failed"]
        last = f"; last failure: {failed[-1]['reason']}" if failed else ""
        return (
            f"no live {role}-capable instance (role {' or '.join(roles)}): "
            f"{len(ids)} configured, none alive{last}"
        )

    def abort(self, request_id: str) -> bool:
        """End a request at whatever stage it is (queued, prefilling, transferring, decoding):
        its blocks are freed on every instance and its stream ends with ``abort``. False if
        the request is unknown or already finished -- an unknown one may still be on its way
        (Ray can run an abort before the submit sent just before it): it is then aborted as
        soon as it arrives, within ``EarlyAborts.ttl_s``."""
        flight = self.flights.get(request_id)
        if flight is None:
            self._early_aborts.remember(request_id)
            return False
        flight.loop.abort([flight.internal_id])
        self._finish(flight, EngineCoreOutput(request_id, [], FinishReason.ABORT))
        return True

    # -- failures ----------------------------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _on_instance_failed(self, loop: EngineLoop, internal_ids: list[str], reason: str) -> None:
        """An instance failed: its requests move to live instances (re-prefilled there from
        prompt + tokens already sent), and a restartable worker is brought back."""
        iid = loop.instance_id
        if self.loops.get(iid) is loop and not loop.failure_handled:
            loop.failure_handled = True
            self.views[iid].alive = False
            logger.warning("instance %s failed: %s", iid, reason)
            self.failures.append(
                {"instance_id": iid, "event": "failed", "reason": reason, "time": time.time()}
            )
            spec = self.specs[iid]
            restarts = loop.hung or spec.pool.max_restarts > 0
            if spec.actors and not self.views[iid].draining and restarts:
                self._spawn(self._recover(spec, loop.hung))
        flights = []
        for internal in internal_ids:
            flight = self._internal.get(internal)
            if flight is not None and flight.loop is loop:
                flights.append(flight)
        if flights:
            self._spawn(self._move(flights, reason))

    async def _move(self, flights: list[Flight], reason: str) -> None:
        for flight in flights:
            if self.flights.get(flight.request.request_id) is not flight:
                continue  # aborted meanwhile
            flight.num_moves += 1
            self.num_moves += 1
            self.observe.moved(flight, reason)
            try:
                await self._place(flight)
            except Exception as exc:
                error = f"{reason}; the request could not move: {exc}"
                rid = flight.request.request_id
                self._finish(flight, EngineCoreOutput(rid, [], FinishReason.ERROR, error=error))

    async def _monitor_health(self) -> None:
        """Find dead workers of idle instances too (a step finds them on its own): every
        ``health_check_interval_s``, ask each worker; one that died fails its instance."""
        interval = self.config.health_check_interval_s
        while True:
            await asyncio.sleep(interval)
            for iid, loop in list(self.loops.items()):
                spec = self.specs.get(iid)  # None: it left its pool during an earlier check
                if spec is not None and loop.alive and spec.actors:
                    await check_workers(loop, spec, timeout_s=10 * interval)

    async def _recover(self, spec: InstanceSpec, hung: bool) -> None:
        """End a hung worker (it still runs its step), then bring the instance back if Ray
        restarts its workers."""
        if hung:
            await end_hung_workers(spec)
        if spec.pool.max_restarts > 0:
            await self._rejoin(spec)

    async def _rejoin(self, spec: InstanceSpec) -> None:
        """Bring a restarted instance back (Ray ``max_restarts``) with a fresh scheduler: it
        rejoins routing with an empty cache."""
        iid = spec.instance_id
        if not await restore_workers(spec, self.config.startup_timeout_s):
            logger.error("instance %s did not come back; it stays out of routing", iid)
            return
        if self.specs.get(iid) is not spec or self.views[iid].draining:
            return  # it left its pool (or is leaving) while its workers restarted
        self._install(spec, self._build_loop(spec))
        self.lora.reset(iid)
        logger.info("instance %s rejoined with an empty cache", iid)
        self.failures.append(
            {"instance_id": iid, "event": "rejoined", "reason": "", "time": time.time()}
        )

    def _live(self, role: str) -> list[InstanceView]:
        """Live instances that can take ``role`` work (decode: roles decode and both); not
        the ones draining to leave."""
        prefill = role == "prefill"
        return [v for v in self.views.values() if (v.role == "prefill") == prefill and v.serves]

    # -- pools resized at run time -----------------------------------------------------------
    async def scale_pool(
        self, pool_name: str, replicas: int, drain_timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Resize pool ``pool_name`` to ``replicas`` instances while serving. New instances
        start (workers placed, model loaded, KV cache sized) and then join routing. Removed
        ones -- the newest first -- drain: they take no new request, and the ones they hold
        finish; what is still there after ``drain_timeout_s`` (default
        ``ClusterConfig.drain_timeout_s``) moves to live instances, as after a failure. Then
        their workers stop. Returns the pool's instances. ``ValueError``: unknown pool, fewer
        than one replica, workers that are not Ray actors (an in-process cluster)."""
        pool = next((p for p in self.config.pools if p.name == pool_name), None)
        if pool is None:
            names = ", ".join(p.name for p in self.config.pools)
            raise ValueError(f"no pool named {pool_name!r} (pools: {names})")
        if replicas < 1:
            raise ValueError(
                f"pool {pool_name!r} must keep at least one instance (replicas {replicas}): "
                "a pool with none could not serve its role"
            )
        if not any(spec.actors for spec in self.specs.values()):
            raise ValueError("this cluster's workers are in-process: it cannot start more")
        async with self._resizing:  # one resize at a time
            live = self._pool_instances(pool_name)
            # Dead instances (failed, not back) count for nothing: the resize retires them.
            dead = [i for i in self._pool_instances(pool_name, alive=False) if i not in live]
            if replicas > len(live):
                await self._grow(pool, replicas - len(live))
            await self._shrink(dead + live[replicas:], drain_timeout_s)
            return {"pool": pool_name, "instances": self._pool_instances(pool_name)}

    def _pool_instances(self, pool_name: str, alive: bool = True) -> list[str]:
        """The pool's instances that serve (alive, not draining; ``alive=False``: all but
        the draining ones), oldest first."""
        ids = [i for i, s in self.specs.items() if s.pool.name == pool_name]
        ids = [i for i in ids if not self.views[i].draining and (self.views[i].alive or not alive)]
        return sorted(ids, key=lambda i: int(i.rpartition("-")[2]))

    async def _grow(self, pool: Any, count: int) -> None:
        from cluster.control.placement import start_instances

        taken = [int(i.rpartition("-")[2]) for i, s in self.specs.items() if s.pool is pool]
        first = max(taken, default=-1) + 1
        wanted = [(f"{pool.name}-{first + k}", pool) for k in range(count)]
        specs = await start_instances(self.config, wanted, self.config.startup_timeout_s)
        for spec in specs:
            info = spec.info
            if min(info["max_position_embeddings"], info["num_blocks"] * info["block_size"]) < (
                self.max_model_len
            ):
                for s in specs:
                    for actor in s.actors:
                        import ray

                        ray.kill(actor)
                raise ValueError(
                    f"pool {pool.name!r}: a new instance holds {info['num_blocks']} KV blocks, "
                    f"fewer than the cluster's max_model_len ({self.max_model_len}) needs"
                )
        for spec in specs:
            self._add_instance(spec)
        freeze_heap()
        logger.info("pool %s grew: %s", pool.name, ", ".join(s.instance_id for s in specs))

    async def _shrink(self, instance_ids: list[str], drain_timeout_s: float | None) -> None:
        if not instance_ids:
            return
        loops = [self.loops[i] for i in instance_ids]
        for loop in loops:
            self.views[loop.instance_id].draining = True
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        deadline = time.monotonic() + timeout
        while any(self._holds_requests(lp) for lp in loops) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for loop in loops:
            await self._retire(loop)

    def _holds_requests(self, loop: EngineLoop) -> bool:
        """Requests still on ``loop``: queued, running, or finished with KV still to send."""
        if loop.pending or loop.scheduler.has_requests():
            return True
        return any(f.loop is loop for f in self.flights.values())

    async def _retire(self, loop: EngineLoop) -> None:
        """Take a drained instance out: stop its loop, move what it still holds, stop its
        workers and forget it."""
        iid = loop.instance_id
        loops = {loop, self.loops.get(iid, loop)}  # and one a rejoin installed meanwhile
        for each in loops:
            each.on_failure = None
            await each.stop()
        # Listed after the stops: a step that was running may have finished (or handed off)
        # some of them.
        leftovers = [f for f in self.flights.values() if f.loop in loops]
        if leftovers:
            logger.warning("instance %s left with %d requests; they move", iid, len(leftovers))
            self._spawn(self._move(leftovers, f"instance {iid} was removed from its pool"))
        spec = self.specs.pop(iid)
        self.views[iid].alive = False  # a flight's decode_target may still point here
        del self.loops[iid], self.roles[iid], self.views[iid]
        self.lora.forget(iid)
        for actor in spec.actors:
            import ray

            ray.kill(actor)
        logger.info("instance %s left the cluster", iid)

    # -- LoRA adapters by name (the API's /v1/load_lora_adapter) ------------------------------
    def lora_adapters(self) -> dict[str, LoRARequest]:
        return dict(self.lora.by_name)

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at ``path`` as model ``name`` (tried on a live instance first:
        a bad one is a ``ValueError`` here, not on a request)."""
        live = self._live("decode")
        return await self.lora.load(name, path, live[0].instance_id if live else None)

    def unload_lora_adapter(self, name: str) -> None:
        self.lora.unload(name)

    # -- outputs -----------------------------------------------------------------------------
    def _on_outputs(self, loop: EngineLoop, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            flight = self._internal.get(out.request_id)
            if flight is None or flight.loop is not loop:
                continue  # aborted, or a stale output of an earlier stage
            if flight.stage == "prefill" and out.finished and self._hand_off(flight, out):
                continue
            if flight.num_cached_tokens is None:
                flight.num_cached_tokens = out.num_cached_tokens
            client_out = EngineCoreOutput(
                flight.request.request_id,
                out.new_token_ids,
                out.finish_reason,
                out.stop_reason,
                flight.num_cached_tokens,
                None,  # kv_transfer_params (handles) never leave the actor
                out.new_logprobs,
                out.error,
            )
            flight.sent.extend(out.new_token_ids)
            self.observe.tokens_out(flight, loop, len(out.new_token_ids))
            if out.finished:
                self._finish(flight, client_out)
            else:
                flight.deliver(client_out)

    def _hand_off(self, flight: Flight, out: EngineCoreOutput) -> bool:
        """The prefill instance sampled the first token. Send the request on to its decode
        instance with that token and the KV handle; False if it is already complete."""
        request = flight.request
        wanted = request.sampling_params.max_tokens
        if out.finish_reason != FinishReason.LENGTH or (wanted is not None and wanted <= 1):
            return False
        if request.num_prompt_tokens + 1 >= self.max_model_len or out.error:
            return False
        rid = request.request_id
        first = EngineCoreOutput(
            rid, out.new_token_ids, None, None, out.num_cached_tokens, None, out.new_logprobs
        )
        decode = flight.decode_target
        if decode is None or not decode.serves:
            alive = self._live("decode")
            if not alive:
                flight.deliver(first)  # the client keeps the token it was owed
                self._finish(
                    flight,
                    EngineCoreOutput(
                        rid, [], FinishReason.ERROR, error="no live decode instance to continue"
                    ),
                )
                return True
            decode = self.router.best_decode(alive)
        params = out.kv_transfer_params
        flight.num_cached_tokens = out.num_cached_tokens
        self.observe.handed_off(flight, decode, self.config.kv_transfer.transport)
        self.observe.tokens_out(flight, flight.loop, len(first.new_token_ids))
        flight.stage = "decode"
        flight.sent.extend(first.new_token_ids)
        flight.deliver(first)
        part = clone_request(
            request,
            request_id=flight.internal_id,
            output_token_ids=list(out.new_token_ids),
            kv_transfer_params=self.observe.decode_params(flight, params),
        )
        flight.loop = self._send(decode, part)
        return True

    def _finish(self, flight: Flight, final: EngineCoreOutput) -> None:
        if self.flights.get(flight.request.request_id) is flight:
            del self.flights[flight.request.request_id]
            self._early_aborts.finished(flight.request.request_id)
            self._internal.pop(flight.internal_id, None)
            flight.deliver(final)
            self.observe.finished(flight, final)

    # -- metrics ----------------------------------------------------------------------------
    def _on_scheduled(self, loop: EngineLoop, internal_id: str) -> None:
        flight = self._internal.get(internal_id)
        if flight is not None:
            self.observe.scheduled(loop, flight)

    def _on_preempted(self, loop: EngineLoop, internal_id: str) -> None:
        flight = self._internal.get(internal_id)
        if flight is not None:
            self.observe.preempted(loop, flight)

    def _on_kv_loads(self, loop: EngineLoop, loads: list[tuple[str, float, int, bool]]) -> None:
        self.observe.kv_loads(loop, loads, self._internal)

    def metrics_text(self) -> str:
        """Prometheus exposition text of the whole cluster (``/metrics``)."""
        return self.observe.render(self.stats())

    # -- introspection -----------------------------------------------------------------------
    def live_request_ids(self) -> list[str]:
        """Ids of the requests in flight (for operators and tests)."""
        return sorted(self.flights)

    def requests(self) -> dict[str, dict[str, Any]]:
        """Where each request in flight is: its ``instance``, its ``phase`` (``queued``: not
        scheduled there yet, or preempted; ``prefill``; ``transfer``: its KV is being loaded
        on the decode instance; ``decode``), the tokens sent to its client so far and how
        often it moved off a failed instance."""
        return {
            rid: {
                "instance": flight.loop.instance_id,
                "phase": _phase(flight),
                "num_tokens_sent": len(flight.sent),
                "num_moves": flight.num_moves,
            }
            for rid, flight in sorted(self.flights.items())
        }

    def settings(self) -> dict[str, Any]:
        """What the cluster was built from (``ClusterConfig.cluster_settings``), to tell
        whether a new deployment may reuse it."""
        return self.config.cluster_settings()

    def model_info(self) -> dict[str, Any]:
        """What a client needs to tokenize and validate: the model and the context length."""
        first = next(iter(self.specs.values())).info
        return {**first, "max_model_len": self.max_model_len}

    def describe(self) -> dict[str, Any]:
        return {
            "instances": {
                iid: {
                    "role": self.roles[iid],
                    "pool": spec.pool.name,
                    "node_id": spec.info.get("node_id"),
                    "num_blocks": spec.info["num_blocks"],
                }
                for iid, spec in self.specs.items()
            },
            "max_model_len": self.max_model_len,
        }

    def stats(self) -> dict[str, Any]:
        """Per-instance state: requests held, KV usage, counters (for tests and metrics)."""
        result: dict[str, Any] = {
            "num_flights": len(self.flights),
            "num_moves": self.num_moves,
            "failures": list(self.failures),
            "instances": {},
        }
        for iid, loop in self.loops.items():
            result["instances"][iid] = {"role": self.roles[iid], **loop.stats()}
        return result

    async def transfer_history(self) -> dict[str, list[Any]]:
        """Every instance's finished KV loads (``TransferRecord``s), for benchmarks: every
        stage's records (each moves its own layers); a dead worker's died with it."""
        result: dict[str, list[Any]] = {}
        for iid, spec in self.specs.items():
            stages = await spec.call_stages(
                "transfer_history", monitor=True, return_exceptions=True
            )
            result[iid] = [r for stage in stages if isinstance(stage, list) for r in stage]
        return result

    async def worker_health(self) -> dict[str, dict[str, Any]]:
        """Each instance's ``health()`` (node id, pid, state): its first worker's, with every
        pipeline stage's under ``stages``."""
        result: dict[str, dict[str, Any]] = {}
        for iid, spec in self.specs.items():
            stages = [
                s if isinstance(s, dict) else {"ok": False, "error": f"{type(s).__name__}"}
                for s in await spec.call_stages("health", monitor=True, return_exceptions=True)
            ]
            result[iid] = {**stages[0], "stages": stages}
        return result

    async def set_fault_injection(
        self, instance_id: str, load_delay_s: float = 0.0, step_delay_s: float = 0.0
    ) -> None:
        """Testing: slow one instance's worker down (``ModelWorker.set_fault_injection``)."""
        await self.specs[instance_id].call_stages("set_fault_injection", load_delay_s, step_delay_s)

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if any instance's scheduler is inconsistent."""
        for loop in self.loops.values():
            loop.scheduler.check_integrity()

    def reset_prefix_cache(self) -> bool:
        return all(loop.scheduler.reset_prefix_cache() for loop in self.loops.values())


def _phase(flight: Flight) -> str:
    request = flight.loop.scheduler.requests.get(flight.internal_id)
    if request is None or request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
        return "queued"  # still arriving at the instance, or waiting in its queue
    if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        return "transfer"
    return flight.stage


def _later_sample(request_id: str) -> bool:
    """True for sample i > 0 of a request fanned out into n (``cluster.engine.outputs`` names)."""
    _, sep, index = request_id.rpartition("#")
    return bool(sep) and index.isdigit() and index != "0"
