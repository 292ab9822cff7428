"""``SchedulerActor``: the central scheduler of a Tandem cluster (DESIGN §2).

It decides where each request runs -- admission (the waiting bound), routing (load, prefix
affinity, LoRA, conditional disaggregation), the P/D hand-off, moves after a failure -- and
each instance's ``InstanceEngine`` runs it there (``cluster.control.engine``)::

    submit(req) ─▶ Router ─▶ P engine: prefill, 1st token ─▶ client
                               │ report: prefilled (KV handle)
                               ▼
                  hand-off ─▶ D engine: [1st token] + KV ─▶ decode tokens ─▶ client

What the actor knows of an instance is the engine's report of each step: its load, KV usage
and prefix-cache events (an ``InstanceView`` for the router) and per request only its
milestones -- finished, prefilled, lost -- never its tokens: the engines stream those to the
clients' outboxes themselves.

A plain class: ``build_cluster`` (``cluster.control.launch``) starts it as a named async Ray
actor (``scheduler_actor_class``); tests may inject in-process instances instead of Ray
workers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

from cluster.config import ClusterConfig
from cluster.control.adapters import LoRAAdapters
from cluster.control.autoscaler import Autoscaler
from cluster.control.clients import Clients
from cluster.control.dispatch import Dispatch
from cluster.control.engine import InstanceEngine
from cluster.control.engine_reports import EngineReport
from cluster.control.flights import Flight
from cluster.control.handoffs import HandOffs
from cluster.control.heap import freeze_heap
from cluster.control.intake import Intake
from cluster.control.introspection import Introspection
from cluster.control.kv_peers import KVPeers
from cluster.control.migration import Migration, _replay
from cluster.control.observer import RequestObserver
from cluster.control.operations import ClusterOperations
from cluster.control.placement import InstanceSpec, StartInstances, kill_orphan_workers
from cluster.control.remembered import EarlyAborts, RefusedRequests
from cluster.control.report_intake import ReportIntake
from cluster.control.restart import Restart, was_restarted
from cluster.control.router import Router, family_of
from cluster.control.summaries import InstanceView
from scheduler.outputs import EngineCoreOutput
from scheduler.request import FinishReason

logger = logging.getLogger(__name__)


class SchedulerActor(
    Intake, ReportIntake, Dispatch, KVPeers, Migration, Restart, ClusterOperations, Introspection
):
    """Admits and routes requests, hands them off between instances, moves them off failed
    ones; the instances' engines run them and stream their tokens. Routing a request and
    giving it to an instance is ``Dispatch`` (``control/dispatch.py``). What operators call --
    pool resizing, adapters -- is ``ClusterOperations`` (``control/operations.py``), what
    they read -- metrics, introspection -- ``Introspection`` (``control/introspection.py``);
    the rebuild after a restart is ``Restart`` (``control/restart.py``); moves off failed
    instances, and the requests of an engine process that died moving on with their
    clients' tokens, are ``Migration`` (``control/migration.py``); what clients call --
    submit, subscribe, abort -- is ``Intake`` (``control/intake.py``); the KV transport's
    connections between workers are ``KVPeers`` (``control/kv_peers.py``)."""

    def __init__(
        self,
        config: ClusterConfig,
        instances: list[InstanceSpec] | None = None,
        start_instances: StartInstances | None = None,
    ) -> None:
        """``instances``: started already (in-process workers; else the actor starts them on
        Ray); ``start_instances``: how a pool grows (default ``placement.start_instances``,
        workers on Ray; the simulator gives its own)."""
        # ``transport: auto``: nixl if it imports here, checked against the workers at start.
        # ``declared``: the config as given (what a redeployment is compared with).
        self.declared = config
        self._kv_auto = config.kv_transfer.auto
        if self._kv_auto:
            config = config.with_kv_transport(config.kv_transfer.resolved().transport)
        self.config = config
        self._specs = instances
        self.router = Router(config.router)
        self.engines: dict[str, Any] = {}  # InstanceEngine, or RemoteEngine (engine_actors)
        # What routing and admission read of each instance: its engine's per-step reports.
        self.views: dict[str, InstanceView] = {}
        self.roles: dict[str, str] = {}
        self.specs: dict[str, InstanceSpec] = {}
        self.flights: dict[str, Flight] = {}  # by the client's request id
        # The clients streaming in batches (submit / subscribe), and their liveness.
        self.clients = Clients(
            self.flights,
            self.abort,
            config.client_timeout_s,
            on_drop=self._client_dropped,
            on_resubscribe=self._ask_again,
        )
        self._internal: dict[str, Flight] = {}  # by the schedulers' id
        self._early_aborts = EarlyAborts()  # aborts that overtook their submit
        self._refused = RefusedRequests()  # user requests refused by their first part
        self.hand_offs = HandOffs()  # hand-offs no decode engine has confirmed yet
        self._seq = itertools.count()
        self.max_model_len = 0
        self.started = False
        self._starting: asyncio.Future[None] | None = None  # ``start`` under way (or done)
        self.stopped = False  # shut down for good
        self.num_moves = 0  # requests moved off failed instances
        self.failures: list[dict[str, Any]] = []  # instance failures and rejoins, in order
        self._tasks: set[asyncio.Task[None]] = set()  # moves, the client reaper
        self._resizing = asyncio.Lock()  # scale_pool: one resize at a time
        self._shrinking: set[str] = set()  # instances draining to leave (``_shrink``)
        self._lingering: dict[str, InstanceSpec] = {}  # retired; workers kept for a lease
        self._membership = asyncio.Lock()  # instances joining or retiring, one at a time
        self.observe = RequestObserver(config, self.roles, self.specs)
        self.lora = LoRAAdapters(config, self.specs)  # served by name, loaded per instance
        self.lora.on_change = self._share_adapters
        self.observe.latency_sink = self._latency
        # Restarted by Ray (engine_actors): rebuilt from the engines before serving again.
        self.recovering = config.engine_actors and was_restarted()
        self._recovery: asyncio.Task[None] | None = None
        self._held_reports: list[EngineReport] = []  # reports that came during the rebuild
        # Per instance: the ``EngineReport.sequence`` of its latest report (one sent again
        # after a lost answer is not applied twice). One entry per instance ever: small.
        self._report_sequences: dict[str, tuple[str, int]] = {}
        # After a restart: internal ids below this sequence number were given by the previous
        # process; of those, the ones this process took on (``restart.rebuild``).
        self._first_own_seq = 0
        self._taken_on: set[str] = set()
        self._orphans = {}  # a dead engine's requests, waiting for their clients' tokens
        self._start_instances = start_instances
        self._last_index: dict[str, int] = {}
        self.autoscaler = Autoscaler(self)  # pools with an autoscaling section follow the load

    # -- life cycle --------------------------------------------------------------------------
    async def start(self) -> dict[str, Any]:
        """Start the workers (unless injected), then each instance's engine. Callers at the
        same time wait for the one start (a second would start a second set of workers); one
        after a failed start tries again; one after it started gets its description."""
        if self.recovering:
            await self._ready()
        if self.stopped:
            raise RuntimeError("the cluster was shut down; build it again")
        if self.started:
            return self.describe()
        if self._starting is None or self._starting.done():
            self._starting = asyncio.ensure_future(self._start())
        await asyncio.shield(self._starting)
        return self.describe()

    async def _start(self) -> None:
        if self._specs is None:
            from cluster.control.placement import start_workers

            self._specs = await start_workers(
                self.config, self.config.startup_timeout_s, self.kv_fallback
            )
        specs = self._specs
        try:
            self.max_model_len = self._common_max_model_len(specs)
            await self._add_instances(specs)
        except BaseException:  # nothing started is left behind (workers may be detached)
            import ray

            for engine in self.engines.values():
                if engine.remote:
                    engine.close()
            for spec in specs:
                for actor in spec.actors:
                    ray.kill(actor)
            if any(spec.actors for spec in specs):
                self._specs = None  # killed: a start again starts new ones
            raise
        self._spawn(self.clients.reap_silent())
        self.started = True
        if self.autoscaler.enabled:
            self._spawn(self.autoscaler.run())
        freeze_heap()  # the block pools and the rest of start-up: never garbage
        logger.info("cluster started: %s", ", ".join(f"{i} ({r})" for i, r in self.roles.items()))

    async def _add_instances(self, specs: list[InstanceSpec]) -> None:
        """Start the engines of started instances and let them serve: in this process, or
        each in an ``EngineActor`` of its own (``engine_actors``; they start in parallel)."""
        # What it connects (by view: one that fails and rejoins meanwhile has new agents).
        connected = {i: view for i, view in self.views.items() if view.alive}
        await self._connect_kv_peers(specs)
        engines: list[Any] = []
        for spec in specs:
            if self.config.engine_actors:
                import ray

                from cluster.control.remote_engine import RemoteEngine

                me = ray.get_runtime_context().current_actor
                engines.append(
                    RemoteEngine(self.config, spec, self.max_model_len, me, self._engine_died)
                )
            else:
                engines.append(
                    InstanceEngine(
                        self.config, spec, self.max_model_len, self._on_report, self.observe
                    )
                )
        if self.config.engine_actors:
            try:  # bounded: a grow holds ``_membership`` (and ``_resizing``) meanwhile
                await asyncio.wait_for(
                    asyncio.gather(*(engine.ready() for engine in engines)),
                    self.config.startup_timeout_s,
                )
            except BaseException as exc:
                for engine in engines:
                    engine.close()
                self._forget_kv_peers(specs)
                if isinstance(exc, TimeoutError):  # (its str is empty: the 503 said nothing)
                    names = ", ".join(spec.instance_id for spec in specs)
                    raise TimeoutError(
                        f"the engine actors of {names} were not ready within "
                        f"{self.config.startup_timeout_s:g} s"
                    ) from None
                raise
        try:  # (instances that rejoined while these started did not connect with them)
            await self._connect_serving_since(specs, connected)
        except BaseException:
            for engine in engines:
                engine.close()
            raise
        for spec, engine in zip(specs, engines, strict=True):
            iid = spec.instance_id
            self.specs[iid] = spec
            self.roles[iid] = spec.pool.role
            self.views[iid] = self._new_view(spec)
            self.lora.reset(iid)
            self.observe.add_instance(iid, spec.pool.role)
            self.engines[iid] = engine
            engine.start()
            if engine.remote:
                engine.keep_adapters(self.lora.registry())
                if self.autoscaler.enabled:
                    engine.keep_autoscaler(self.autoscaler.memo())
        if self.config.engine_actors:  # clients stream from the new engines too
            self.clients.notify_engines(self.engine_handles())

    def _forget_kv_peers(self, specs: list[InstanceSpec]) -> None:
        """New instances refused after ``_connect_kv_peers`` told every live worker of their
        workers (``nixl``: agents added, same-host sources attached): the live workers forget
        them again, in the background (the caller kills their workers). Otherwise each
        failed grow -- the autoscaler asks again after its delay -- left some behind for as
        long as the live workers ran."""
        from cluster.control.placement import disconnect_kv_peers, kv_peer_names

        names = [name for spec in specs for name in kv_peer_names(spec)]
        if names and self.specs:
            wait = self._kv_peers_wait_s()
            self._spawn(disconnect_kv_peers(list(self.specs.values()), names, wait))

    def _latency(self, iid: str, kind: str, seconds: float, span_s: float) -> None:
        view = self.views.get(iid)
        if view is not None:
            view.latency(time.monotonic(), kind, seconds, span_s)

    def _share_adapters(self) -> None:
        """The engine actors keep the LoRA registry for a restarted central actor."""
        registry = self.lora.registry()
        for engine in self.engines.values():
            if engine.remote:
                engine.keep_adapters(registry)

    def _share_autoscaler(self, memo: Any) -> None:
        """The engine actors keep the autoscaler's memo for a restarted central actor."""
        for engine in self.engines.values():
            if engine.remote and engine.dead is None:
                engine.keep_autoscaler(memo)

    def engine_handles(self) -> dict[str, Any]:
        """The engine actors clients stream from, by instance (``engine_actors``)."""
        return {iid: e.actor for iid, e in self.engines.items() if e.remote and e.dead is None}

    @staticmethod
    def _new_view(spec: InstanceSpec) -> InstanceView:
        caching = spec.pool.cache.get("enable_prefix_caching", True)
        return InstanceView(spec.instance_id, spec.pool.role, spec.info["block_size"], caching)

    def _common_max_model_len(self, specs: list[InstanceSpec]) -> int:
        """One context length for the whole cluster: a request may land anywhere."""
        limits = [
            min(s.info["max_context_len"], s.info["num_blocks"] * s.info["block_size"])
            for s in specs
        ]
        cap = min(limits)
        wanted = self.config.max_model_len
        if wanted is not None and wanted > cap:
            raise ValueError(
                f"max_model_len ({wanted}) exceeds what the smallest instance holds ({cap} "
                "tokens: its KV cache, or the model's positions -- max_position_embeddings, "
                "stretched by rope scaling -- or its sliding window when smaller)"
            )
        return wanted or cap

    async def shutdown(self) -> None:
        """Stop every engine, end what is in flight (abort), release the workers. For good:
        a ``start`` after it (a Serve replica adopting the cluster while ``tandem down``
        takes it down) is refused, not run again on the workers killed here."""
        self.started = False  # no submit from now on
        self.stopped = True
        for view in self.views.values():
            view.alive = False  # no hand-off or move either
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(engine.stop() for engine in list(self.engines.values())))
        for flight in list(self.flights.values()):
            self._end(flight, FinishReason.ABORT, "shutdown")
        self.clients.close_all()  # their last batches go out, then their streams end
        await self.observe.flush()
        for engine in list(self.engines.values()):  # (a drain awaited elsewhere ends)
            if engine.remote:
                try:
                    await engine.flush_traces()
                finally:
                    engine.close()
        import ray

        for spec in [*self.specs.values(), *self._lingering.values()]:
            for actor in spec.actors:
                ray.kill(actor)
        if self.config.engine_actors and ray.is_initialized():  # a start cut short, too
            context = ray.get_runtime_context()
            kill_orphan_workers(context.get_actor_id() or "", context.namespace, set())

    # -- requests ----------------------------------------------------------------------------
    def _forget(self, flight: Flight) -> None:
        """The flight ended (its engine sent the last output): drop it."""
        rid = flight.request.request_id
        if self.flights.get(rid) is flight:
            del self.flights[rid]
            self._early_aborts.finished(rid)
            family = family_of(flight.request)
            if family is not None:  # a late abort by the user's id is not kept either
                self._early_aborts.finished(family)
        self._internal.pop(flight.internal_id, None)

    def _end(
        self,
        flight: Flight,
        reason: FinishReason,
        error: str | None = None,
        tokens: list[int] | None = None,
    ) -> None:
        """End a flight that no engine holds, with a last output from the actor (``tokens``:
        the tokens its client should have, when the actor knows them: ``_replay``)."""
        if self.flights.get(flight.request.request_id) is not flight:
            # Ended already, or its id taken by a later submit of its client (``_submit``):
            # what its engine would have reported ending it never comes now.
            self._internal.pop(flight.internal_id, None)
            return
        final = EngineCoreOutput(flight.request.request_id, [], reason, error=error)
        self._forget(flight)
        _replay(flight, final, tokens, self.config.engine_actors)
        # Counted on its last instance in one process; else (never placed, its instance
        # gone, or engine actors) on no instance's series. An engine actor's registry has
        # its instance's series, and ``/metrics`` adds this process's to them: a count of
        # this one's there would drop with a restart of either -- a counter reset to
        # Prometheus, whose rate() would then count every request again.
        where = None if self.config.engine_actors else self.views.get(flight.instance)
        self.observe.finished(flight, final, where)

    # -- failures ----------------------------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _live(self, role: str) -> list[InstanceView]:
        """Live instances that can take ``role`` work (decode: roles decode and both); not
        the ones draining to leave."""
        prefill = role == "prefill"
        return [v for v in self.views.values() if (v.role == "prefill") == prefill and v.serves]
