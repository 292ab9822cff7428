"""What operators ask of the central scheduler besides requests: resize a pool while it
serves, serve LoRA adapters by name (what they read of it -- metrics, stats, where each
request is -- is ``control/introspection.py``). A mixin of ``SchedulerActor``
(``control/scheduler_actor``): it works on the actor's own state, declared here."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cluster.config import ClusterConfig
from cluster.control.adapters import LoRAAdapters
from cluster.control.engine_reports import Lost
from cluster.control.flights import Flight
from cluster.control.handoffs import HandOffs
from cluster.control.heap import refreeze_heap
from cluster.control.observer import RequestObserver
from cluster.control.placement import InstanceSpec
from cluster.control.summaries import InstanceView
from scheduler import LoRARequest

if TYPE_CHECKING:
    from collections.abc import Coroutine

logger = logging.getLogger(__name__)


class ClusterOperations:
    """Pool resizing and adapters over a ``SchedulerActor``'s state."""

    # The actor's state (set by SchedulerActor.__init__ and start).
    config: ClusterConfig
    declared: ClusterConfig  # as given (``config`` has ``transport: auto`` resolved)
    engines: dict[str, Any]  # InstanceEngine or RemoteEngine
    views: dict[str, InstanceView]
    roles: dict[str, str]
    specs: dict[str, InstanceSpec]
    flights: dict[str, Flight]
    max_model_len: int
    num_moves: int
    failures: list[dict[str, Any]]
    observe: RequestObserver
    lora: LoRAAdapters
    _resizing: asyncio.Lock
    _membership: asyncio.Lock  # instances joining or retiring (KV peers change)
    started: bool
    _start_instances: Any  # placement.StartInstances, or None: Ray's
    _last_index: dict[str, int]  # per pool, the highest instance index it has used
    autoscaler: Any  # control.autoscaler.Autoscaler
    _orphans: dict[tuple[str, Any], tuple[str, str, str]]
    _shrinking: set[str]  # instances whose drain and retire (``_shrink``) run now
    _lingering: dict[str, InstanceSpec]  # retired instances whose workers wait for a lease
    hand_offs: HandOffs
    _confirm: Callable[[dict[str, list[str]]], None]

    # ... and what of the actor this uses.
    async def _add_instances(self, specs: list[InstanceSpec]) -> None:
        raise NotImplementedError

    @property
    def kv_fallback(self) -> str | None:
        raise NotImplementedError

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        raise NotImplementedError

    async def _move(self, iid: str, lost: list[Lost], reason: str) -> None:
        raise NotImplementedError

    def _live(self, role: str) -> list[InstanceView]:
        raise NotImplementedError

    async def _ready(self) -> None:
        raise NotImplementedError

    def report(self, report: Any) -> None:
        raise NotImplementedError

    def _end_flight(self, flight: Flight, error: str) -> None:
        raise NotImplementedError

    # -- pools resized at run time -----------------------------------------------------------
    async def scale_pool(
        self,
        pool_name: str,
        replicas: int,
        drain_timeout_s: float | None = None,
        wait: bool = True,
    ) -> dict[str, Any]:
        """Resize pool ``pool_name`` to ``replicas`` instances while serving. New instances
        start (workers placed, model loaded, KV cache sized) and then join routing. Removed
        ones -- the newest first -- drain: they take no new request, and the ones they hold
        finish; what is still there after ``drain_timeout_s`` (default
        ``ClusterConfig.drain_timeout_s``) moves to live instances, as after a failure. Then
        their workers stop. The drain holds up no other resize (of this pool or another):
        only its final retire takes turns with a new instance's joining; ``wait=False``
        returns once it has begun (the autoscaler's way). Returns the pool's
        serving instances. ``ValueError``: unknown pool, fewer than one replica, workers that
        are not Ray actors (an in-process cluster)."""
        await self._ready()  # (a restarted actor's pools are what its rebuild finds)
        pool = next((p for p in self.config.pools if p.name == pool_name), None)
        if pool is None:
            names = ", ".join(p.name for p in self.config.pools)
            raise ValueError(f"no pool named {pool_name!r} (pools: {names})")
        if replicas < 1:
            raise ValueError(
                f"pool {pool_name!r} must keep at least one instance (replicas {replicas}): "
                "a pool with none could not serve its role"
            )
        if self._start_instances is None and not any(s.actors for s in self.specs.values()):
            raise ValueError("this cluster's workers are in-process: it cannot start more")
        async with self._resizing:  # one resize at a time
            live = self._pool_instances(pool_name)
            # Dead instances (failed, not back) count for nothing: the resize retires them.
            dead = [i for i in self._pool_instances(pool_name, alive=False) if i not in live]
            try:
                if dead and replicas > len(live):
                    # Before the grow, not after it: their workers may still hold what the
                    # new ones need (a worker whose step raised lives on with its GPU, and so
                    # do a pipeline's other stages). On a full cluster the grow would wait for
                    # that until its timeout, fail, and never reach their retire.
                    self._leave(dead)  # (one that fails to leave holds up no grow: logged)
                    await logged(self._shrink(dead, drain_timeout_s), f"retiring {', '.join(dead)}")
                    dead = []
                leaving = dead + live[replicas:]
                if replicas > len(live):
                    await self._grow(pool, replicas - len(live))
                self._leave(leaving)
            finally:
                self.autoscaler.resized(pool_name)
        drained = self._shrink(leaving, drain_timeout_s)
        if wait:
            await drained
        else:
            self._spawn(logged(drained, f"draining {', '.join(leaving)}"))
        return {"pool": pool_name, "instances": self._pool_instances(pool_name)}

    def _leave(self, instance_ids: list[str]) -> None:
        """Out of routing and of their pool's count at once (before their ``_shrink`` runs)."""
        for iid in instance_ids:
            self.views[iid].draining = True
            self.engines[iid].draining = True
            self._shrinking.add(iid)

    def _pool_instances(self, pool_name: str, alive: bool = True) -> list[str]:
        """The pool's instances that serve (alive, not draining; ``alive=False``: all but
        the draining ones), oldest first."""
        ids = [i for i, s in self.specs.items() if s.pool.name == pool_name]
        ids = [i for i in ids if not self.views[i].draining and (self.views[i].alive or not alive)]
        return sorted(ids, key=lambda i: int(i.rpartition("-")[2]))

    def _pool_draining(self, pool_name: str) -> bool:
        """Whether some of the pool's instances still drain (out of routing, their requests
        finishing): the load they carry is not in the pool's signals yet. Only while their
        shrink runs: one whose retire failed stays draining, but holds up nothing."""
        specs = self.specs
        return any(i in specs and specs[i].pool.name == pool_name for i in self._shrinking)

    def _index_used(self, iid: str) -> None:
        """``iid`` (``{pool}-{index}``) was used: ``_grow`` never gives its index again."""
        pool_name, _, index = iid.rpartition("-")
        if index.isdigit():
            self._last_index[pool_name] = max(self._last_index.get(pool_name, -1), int(index))

    async def _grow(self, pool: Any, count: int) -> None:
        from cluster.control.placement import start_instances

        start = self._start_instances or start_instances
        # By name: after a restart the specs' pools are copies (from the engines' snapshots).
        taken = [
            int(i.rpartition("-")[2]) for i, s in self.specs.items() if s.pool.name == pool.name
        ]
        # Never an index used before: a late report of a removed instance's engine must not
        # pass for its successor's.
        first = max([*taken, self._last_index.get(pool.name, -1)]) + 1
        self._last_index[pool.name] = first + count - 1
        wanted = [(f"{pool.name}-{first + k}", pool) for k in range(count)]
        specs = await start(self.config, wanted, self.config.startup_timeout_s, self.kv_fallback)
        for spec in specs:
            info = spec.info
            if min(info["max_context_len"], info["num_blocks"] * info["block_size"]) < (
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
        try:
            async with self._membership:  # not with a retire (KV peers are connected)
                await self._add_instances(specs)
        except BaseException:  # e.g. the nixl transport cannot reach them: none stays
            import ray

            for spec in specs:
                for actor in spec.actors:
                    ray.kill(actor)
            raise
        refreeze_heap()
        logger.info("pool %s grew: %s", pool.name, ", ".join(s.instance_id for s in specs))

    async def _shrink(self, instance_ids: list[str], drain_timeout_s: float | None) -> None:
        """Wait for the draining instances to hold nothing (at most the drain timeout), then
        retire them -- one membership change at a time (``_membership``): a retire changes
        the instances and KV peers that a growing pool's new instances are connected to. A
        grow waits for the lock only to join, not while its workers are placed and load (a
        retire may be what frees their GPU)."""
        if not instance_ids:
            return
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        deadline = time.monotonic() + timeout
        self._shrinking.update(instance_ids)
        try:
            while time.monotonic() < deadline and self.started:
                holding = [await self._holds_requests(i) for i in instance_ids]
                if not any(holding):
                    break
                await asyncio.sleep(0.05)
            async with self._membership:
                failed: Exception | None = None
                for iid in instance_ids:
                    if iid in self.engines and self.started:  # (not retired, nor shut down)
                        try:
                            await self._retire(iid)
                        except Exception as exc:  # the others leave all the same: left
                            # draining, nothing would ever retire them (resizes skip them)
                            logger.exception("instance %s could not be retired", iid)
                            failed = failed or exc
                if failed is not None:
                    raise failed
        finally:
            self._shrinking.difference_update(instance_ids)

    async def _stop_workers(self, spec: InstanceSpec, after_s: float) -> None:
        """Kill a retired instance's workers ``after_s`` from now, then have the others'
        transports forget them -- not before: a decode instance still reading the KV they
        sent (the lease) must find them. Cancelled (a shutdown), it kills them all the same;
        cancelled before it started, the shutdown does: they are ``_lingering`` until then."""
        import ray

        try:
            if after_s > 0:
                await asyncio.sleep(after_s)
                logger.info(
                    "instance %s: its workers stop (the reads' lease ended)", spec.instance_id
                )
        finally:
            for actor in spec.actors:
                ray.kill(actor)
            self._lingering.pop(spec.instance_id, None)
        if self.config.disaggregated:
            from cluster.control.placement import (
                disconnect_kv_peers,
                kv_peer_names,
                kv_peers_timeout_s,
            )

            wait = kv_peers_timeout_s(self.config.step_timeout_s)
            await disconnect_kv_peers(
                list(self.specs.values()), kv_peer_names(spec), timeout_s=wait
            )

    async def _holds_requests(self, iid: str) -> bool:
        """Requests still on the instance: queued, running, finished with KV still to send."""
        if any(f.instance == iid for f in self.flights.values()):
            return True
        engine = self.engines.get(iid)
        return engine is not None and bool(await answer(engine.holds_requests()))

    async def _retire(self, iid: str) -> None:
        """Take a drained instance out: stop its engine, move what it still holds, stop its
        workers and forget it."""
        engine = self.engines[iid]
        # Not drained (its drain timed out): decode instances may still read KV it sent.
        sending = (
            self.config.disaggregated
            and self.roles[iid] != "decode"
            and bool(await answer(engine.holds_requests()))
        )
        await engine.stop()
        # Taken after the stop: a step that was running may have finished (or handed off)
        # some of them.
        if engine.remote:  # its last reports first (they may finish or hand off some)
            reports, leftovers = await engine.take_all()
            for report in reports:
                self.report(report)
            await engine.wait_drained()  # its clients' last outputs
        else:
            leftovers = engine.take_all()
            # Hand-offs it held unread (queued or loading): their sources let the KV go now.
            for internal, source in engine.take_unread_kv():
                other = self.engines.get(source)
                if other is not None:
                    other.release_kv(internal)
        engine.close()
        if leftovers:
            logger.warning("instance %s left with %d requests; they move", iid, len(leftovers))
            self._spawn(self._move(iid, leftovers, f"instance {iid} was removed from its pool"))
        # A dead (or hung) engine's requests wait for their clients' tokens (``Migration``);
        # those it lost before are being placed elsewhere (``Flight.moving``).
        moving = {item.internal_id for item in leftovers} | {o[0] for o in self._orphans.values()}
        for flight in [f for f in self.flights.values() if f.instance == iid]:
            if flight.internal_id not in moving and not flight.moving:
                # (cannot happen in one process)
                self._end_flight(
                    flight, f"instance {iid} left with the request in an unknown state"
                )
        spec = self.specs.pop(iid)
        # Its index is never given again (``_grow`` reads only the instances there are and
        # the indexes it gave itself, not those of the instances the cluster started with):
        # a successor under its id would take its late reports, and, with engine actors,
        # its detached actors' names, which its workers keep for the reads' lease.
        self._index_used(iid)
        self.observe.remove_instance(iid, spec.pool.role)  # its series leave /metrics
        self._confirm(self.hand_offs.drop(iid))
        self.views[iid].alive = False  # a flight's decode_target may still point here
        del self.engines[iid], self.roles[iid], self.views[iid]
        self.lora.forget(iid)
        del engine
        refreeze_heap()  # its block pool is a cycle
        # Its workers stay for the reads' lease when it sent KV; the others' transports forget
        # them after that, in the background (a worker may be slow to answer).
        lease = self.config.kv_transfer.effective_lease_s if sending and spec.actors else 0.0
        self._lingering[iid] = spec
        self._spawn(self._stop_workers(spec, lease))
        logger.info("instance %s left the cluster", iid)

    # -- LoRA adapters by name (the API's /v1/load_lora_adapter) ------------------------------
    # Each waits for a restarted actor's rebuild (``_ready``), which sets the registry from
    # the engines': a change made before it would be undone, and a listing would miss the
    # adapters loaded at run time.
    async def lora_adapters(self) -> dict[str, LoRARequest]:
        await self._ready()
        return dict(self.lora.by_name)

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at ``path`` as model ``name`` (tried on a live instance first:
        a bad one is a ``ValueError`` here, not on a request)."""
        await self._ready()
        live = self._live("decode")
        return await self.lora.load(name, path, live[0].instance_id if live else None)

    async def unload_lora_adapter(self, name: str) -> None:
        await self._ready()
        self.lora.unload(name)


async def answer(value: Any) -> Any:
    """What an engine method answers: at once (an ``InstanceEngine``) or awaited (a
    ``RemoteEngine``'s coroutine)."""
    if inspect.isawaitable(value):
        return await value
    return value


async def logged(work: Coroutine[Any, Any, None], what: str) -> None:
    """``work`` in the background, its failure logged (nobody awaits it)."""
    try:
        await work
    except Exception:
        logger.exception("%s failed", what)
