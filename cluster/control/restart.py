"""A central scheduler that comes back: with ``engine_actors`` the ``SchedulerActor`` is
restartable (``max_restarts``), and a restarted one rebuilds its state from the engines.

The engines, their workers and the clients' streams from the engines do not depend on the
central actor's process (the engines and workers are detached actors, the clients stream from
the engines directly): while it is away, requests already placed keep running and streaming.
When Ray restarts it, its constructor runs again on a fresh process; the first call that needs
its state -- an engine's report, a client's keep-alive or submit -- starts the rebuild:

    find its engine actors (named after its actor id, which a restart keeps)
    ask each for a snapshot: the instance, its load and prefix cache, the requests it holds
      (one dead, hung or never started is killed; the workers of instances not taken on too)
    rebuild the instances' views, the flights (by client and submission), the id sequence
    hand off what was prefilled and not yet handed off (unless it ended on its decode engine)
    apply the reports that came meanwhile; go on draining what was draining; serve

Calls that arrive meanwhile wait for it (``submit`` at most ``RECOVERY_WAIT_S``, then a clear
``UnavailableError``: HTTP 503). A rebuild that fails leaves 503s naming why, and the
process ends ``REBUILD_RETRY_S`` later for Ray to start a fresh one that tries again (with
no engine left at all, the actor ends for good: a fresh one would fail alike). The
LoRA registry, adapters loaded at run time included, comes from the engines, which keep the
central actor's copy. So do the root spans of traced
requests in flight (made again with the same ids: the engines' spans name them as their
parent; ``tandem.remade`` marks them). What is not rebuilt: the failure
history and move count, requests an engine reported lost while the central actor was away (a
worker failing during its restart: a double fault), and requests of a dead engine that were
waiting for their clients' tokens (``control/migration.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import time
from typing import Any

from cluster.control.engine_wire import EngineSnapshot, sequence_of, shift
from cluster.control.flights import Flight, clone_request
from cluster.control.restart_triage import end_remade_root, remade_trace, triage
from cluster.errors import UnavailableError

logger = logging.getLogger(__name__)

RECOVERY_WAIT_S = 30.0  # how long a call waits for a restarted central actor's rebuild
# A rebuild that failed: the process ends this long after (its calls answer 503 meanwhile),
# for Ray to start a fresh one (max_restarts) that tries again on a clean state.
REBUILD_RETRY_S = 10.0


def was_restarted() -> bool:
    """True in a central actor that Ray restarted (its constructor runs again)."""
    try:
        import ray

        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not in a Ray actor
        return False


class Restart:
    """The ``SchedulerActor``'s rebuild after a restart (a mixin: its state is the actor's)."""

    recovering: bool
    _recovery: asyncio.Task[None] | None
    _held_reports: list[Any]
    _first_own_seq: int
    _taken_on: set[str]
    _ended_submits: frozenset[tuple[str, Any]]
    observe: Any

    def _on_report(self, report: Any) -> None:  # the actor's
        raise NotImplementedError

    def _kick_recovery(self) -> None:
        if self.recovering and self._recovery is None:
            self._recovery = asyncio.ensure_future(self._recover())

    async def _ready(self) -> None:
        """Return once the actor serves: at once, or after a restart's rebuild (at most
        ``RECOVERY_WAIT_S``, else ``UnavailableError``)."""
        if not self.recovering:
            task = self._recovery  # a rebuild that failed failed for good (no new restart)
            failed = task is not None and task.done() and not task.cancelled()
            if failed and task is not None and task.exception() is not None:
                raise _rebuild_failed(task.exception())
            return
        self._kick_recovery()
        assert self._recovery is not None
        try:
            await asyncio.wait_for(asyncio.shield(self._recovery), RECOVERY_WAIT_S)
        except TimeoutError:
            raise UnavailableError(
                "the central scheduler is restarting and has not recovered yet; retry"
            ) from None
        except Exception as exc:  # (logged once, where it failed)
            raise _rebuild_failed(exc) from None

    def _lost_root(self, internal_id: str) -> bool:
        """A traced request of the previous process that this one did not take on: it
        finished while the central actor was away, and its root span died unexported."""
        return (
            self.observe.tracer is not None
            and sequence_of(internal_id) < self._first_own_seq
            and internal_id not in self._taken_on
        )

    async def _recover(self) -> None:
        try:
            await rebuild(self)
        except Exception:
            # Its state is half rebuilt: another try here could count things twice. A fresh
            # process tries again (a transient failure -- engines unavailable for a moment,
            # the GCS slow -- left the cluster answering 503 for good, its engines and
            # workers kept alive by this one answering their watch).
            # With no engine left at all a fresh process would fail alike, for ever: this
            # actor ends for good instead, and Serve's health check of the app's cluster
            # (``TandemCluster``) fails and builds a new one.
            final = isinstance(sys.exc_info()[1], NothingToRebuild)
            logger.exception(
                "the central scheduler could not rebuild its state; in %g s its %s",
                REBUILD_RETRY_S,
                "actor ends for good" if final else "process ends for Ray to start a fresh one",
            )
            end = _end_for_good if final else _end_process
            asyncio.get_running_loop().call_later(REBUILD_RETRY_S, end)
            raise
        finally:
            self.recovering = False
            held, self._held_reports = self._held_reports, []
            for report in held:  # what the engines said meanwhile
                self._on_report(report)


class NothingToRebuild(RuntimeError):
    """No engine actor is left: the cluster cannot come back (a new one must be built)."""


def _end_for_good() -> None:
    """End this actor without a restart."""
    import ray

    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def _end_process() -> None:
    """End this process at once (Ray restarts the actor: ``max_restarts``)."""
    logging.shutdown()
    os._exit(1)


def _rebuild_failed(exc: BaseException | None) -> UnavailableError:
    return UnavailableError(
        f"the central scheduler restarted and could not rebuild its state: {exc}"
    )


SNAPSHOT_TIMEOUT_S = 30.0  # an engine that takes longer to give its snapshot is hung


def _unusable(exc: BaseException) -> bool:
    """An engine's snapshot failed because the engine is dead, hung or was never started --
    not a passing fault (Ray's ActorUnavailableError: restarting, or briefly unreachable)."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    if isinstance(exc, ActorUnavailableError):
        return False
    if isinstance(exc, (RayActorError, TimeoutError)):
        return True
    return "is not started" in str(exc)


SNAPSHOT_RETRY_WAITS_S = (0.5, 1.0, 2.0)  # between asks of an engine that gave a passing fault


async def gather_snapshots(
    handles: list[Any], waits: tuple[float, ...] = SNAPSHOT_RETRY_WAITS_S
) -> list[Any]:
    """Each engine's snapshot, or the exception it gave. One that gave a passing fault is
    asked again after each of ``waits``: left untaken, nothing would ever end its requests
    or free its resources (its reports go unheard, and it sees a central actor that lives)."""

    def ask(handle: Any) -> Any:
        return asyncio.wait_for(handle.snapshot.remote(), SNAPSHOT_TIMEOUT_S)

    answers: list[Any] = await asyncio.gather(*(ask(h) for h in handles), return_exceptions=True)
    for wait_s in waits:
        again = [
            i for i, a in enumerate(answers) if isinstance(a, BaseException) and not _unusable(a)
        ]
        if not again:
            break
        await asyncio.sleep(wait_s)
        asked = await asyncio.gather(*(ask(handles[i]) for i in again), return_exceptions=True)
        for i, answer in zip(again, asked, strict=True):
            answers[i] = answer
    return answers


def resume_drains(actor: Any, snaps: list[EngineSnapshot]) -> None:
    """Instances the previous process was draining out of their pools: their drain went with
    it; it goes on (otherwise nothing would ever retire them: resizes skip draining ones).
    One whose engine it had stopped already (it died in the retire) never steps again: it is
    retired at once -- its requests waited the whole drain timeout before they moved."""
    from cluster.control.operations import logged

    draining = [s.spec.instance_id for s in snaps if s.draining and not s.stopped]
    stopped = [s.spec.instance_id for s in snaps if s.stopped]
    for ids, timeout_s in ((draining, None), (stopped, 0.0)):
        if ids:
            actor._spawn(logged(actor._shrink(ids, timeout_s), f"draining {', '.join(ids)}"))


async def rebuild(actor: Any) -> None:
    """Rebuild ``actor``'s instances and flights from its engine actors' snapshots
    (``actor``: the ``SchedulerActor``, not imported here: it imports this module)."""
    import ray

    from cluster.control.placement import kill_orphan_workers, named_actors
    from cluster.control.remote_engine import RemoteEngine, engine_actor_prefix

    context = ray.get_runtime_context()
    prefix = engine_actor_prefix(context.get_actor_id() or "")
    namespace = context.namespace
    names = [name for name, _ in named_actors((prefix,), namespace)]
    listed = list(names)  # (their indexes are never given again, reached or not)
    handles = []
    for name in listed:
        try:
            handles.append(ray.get_actor(name, namespace=namespace))
        except ValueError:  # gone since it was listed (killed, or a name released late)
            logger.warning("engine %s left before the rebuild reached it", name)
            names.remove(name)
    answers = await gather_snapshots(handles)
    now = time.monotonic()  # the snapshots' ages are as of (about) now
    found: list[tuple[Any, EngineSnapshot]] = []
    spared: set[str] = set()  # engines that did not answer but may live: their workers too
    unanswered: list[tuple[str, Any, BaseException]] = []
    for name, handle, answer in zip(names, handles, answers, strict=True):
        if isinstance(answer, BaseException) and _unusable(answer):
            # Dead, hung, or never started (the previous process died first): nobody could
            # take it on, so it and its workers go (they would hold their resources for ever).
            logger.warning("engine %s cannot be taken on: %s; killed", name, answer)
            ray.kill(handle)
        elif isinstance(answer, BaseException):  # (a passing fault, asked again: still)
            spared.add(name[len(prefix) :])
            unanswered.append((name, handle, answer))
        else:
            found.append((handle, answer))
    if found:  # (else the rebuild fails, and they may answer a fresh process)
        for name, handle, answer in unanswered:
            # Untaken, it would run its requests for nobody and hold its resources for as
            # long as the cluster runs: it goes with its workers, as a dead one.
            logger.warning("engine %s did not answer after the restart: %s; killed", name, answer)
            ray.kill(handle)
            spared.discard(name[len(prefix) :])
    # Workers of an instance whose engine the previous process never created (it died while
    # they loaded) or that was just killed: nobody else knows of them.
    taken = {snap.spec.instance_id for _, snap in found}
    orphans = kill_orphan_workers(context.get_actor_id() or "", namespace, taken | spared)
    # No index used before is given again (a late report, a name Ray still releases).
    for iid in orphans | {name[len(prefix) :] for name in listed}:
        actor._index_used(iid)
    if not found and not spared:
        raise NothingToRebuild("no engine actor left to rebuild the cluster from")
    if not found:  # (they may answer a fresh process)
        raise RuntimeError(f"no engine actor answered ({len(spared)} did not, for now)")
    found.sort(key=lambda pair: pair[1].spec.instance_id)
    actor.max_model_len = found[0][1].max_model_len
    if actor.config.disaggregated:
        specs = [snap.spec for _, snap in found if snap.failed is None]
        if actor._kv_auto:
            await _kv_transport_in_use(actor, specs)
        # The snapshots' peer lists may be older than a worker's last restart: gather them
        # afresh and hand every worker every other's (a no-op for the ray transport).
        from cluster.control.placement import connect_kv_peers

        try:
            await connect_kv_peers(specs, specs, timeout_s=actor._kv_peers_wait_s())
        except Exception as exc:
            logger.warning("KV peers not reconnected after the restart: %s", exc)
    me = context.current_actor
    for handle, snap in found:
        spec = snap.spec
        iid = spec.instance_id
        engine = RemoteEngine(
            actor.config,
            spec,
            snap.max_model_len,
            me,
            actor._engine_died,
            attach=(handle, snap.epoch),
        )
        engine.failed = snap.failed
        engine._draining = snap.draining
        actor.specs[iid] = spec
        actor.roles[iid] = spec.pool.role
        view = actor.views[iid] = actor._new_view(spec)
        view.draining = snap.draining
        view.alive = snap.failed is None
        view.received_so_far(snap.summary.num_received)
        view.update(snap.summary)
        actor.lora.reset(iid)
        actor.observe.add_instance(iid, spec.pool.role)
        actor.engines[iid] = engine
        engine.start()
    if actor.config.disaggregated:  # workers that did not answer the reconnection hang
        actor._fail_unanswered([snap.spec for _, snap in found])
    # Every id the previous process gave, held here or not: this one's come after them.
    last = max(snap.max_seq for _, snap in found)
    handoffs = []
    held = [(snap.spec.instance_id, h) for _, snap in found for h in snap.held]
    ended_here = {key for _, snap in found for key in snap.ended}
    actor._ended_submits = frozenset(ended_here)  # (a submit of them sent again is done)
    for iid, h, take in triage(held, ended_here):
        last = max(last, sequence_of(h.internal_id))
        actor._taken_on.add(h.internal_id)
        if not take:
            actor.engines[iid].abort([h.internal_id])
            continue
        params = h.route.client_params or h.route.request.sampling_params
        request = clone_request(
            h.route.request,
            request_id=h.route.client_request_id,
            sampling_params=params,
            output_token_ids=[],
            arrival_time=h.arrival_time + now,
        )
        outbox = actor.clients.outbox(h.route.client_id)
        flight = Flight(request, None, outbox, iid, "prefill" if h.hand_off else "decode")
        flight.internal_id = h.internal_id
        flight.submission = h.route.submission
        flight.client_id = h.route.client_id
        flight.sent = list(h.tokens)
        flight.num_cached_tokens = h.num_cached_tokens
        flight.scheduled_at = shift(h.scheduled_at, now)
        flight.first_token_at = shift(h.first_token_at, now)
        flight.last_token_at = shift(h.last_token_at, now)
        flight.trace = remade_trace(actor, h.route.trace_context, request)
        other = actor.flights.get(h.route.client_request_id)
        if other is not None:  # (another client's request under the id: it runs on too)
            actor._supersede(other)
        actor.flights[h.route.client_request_id] = flight
        actor._internal[h.internal_id] = flight
        if h.prefilled is not None:
            prefilled = h.prefilled
            prefilled.first_token_at = shift(prefilled.first_token_at, now)
            prefilled.scheduled_at = shift(prefilled.scheduled_at, now)
            handoffs.append((iid, flight, prefilled))
    actor.lora.restore([snap.adapters for _, snap in found if snap.adapters is not None])
    # The autoscaler's memo: the loads that broke SLOs, and a grow the restart cut short.
    actor.autoscaler.restore([getattr(snap, "autoscaler", None) for _, snap in found])
    actor._seq = itertools.count(last + 1)
    actor._first_own_seq = last + 1
    for _, snap in found:  # traced requests that ended while no central actor heard it
        for internal, ended in snap.ended_traces.items():
            if actor._lost_root(internal):
                actor._taken_on.add(internal)
                end_remade_root(actor, ended)
    actor.started = True
    actor._spawn(actor.clients.reap_silent())
    resume_drains(actor, [snap for _, snap in found])
    if actor.autoscaler.enabled:
        actor._spawn(actor.autoscaler.run())
    actor.clients.notify_engines(actor.engine_handles())
    for iid, flight, prefilled in handoffs:
        actor._hand_off(flight, prefilled)
        actor._handed_off(iid, flight, prefilled.internal_id)
    for rid, flight in list(actor.flights.items()):  # aborts that came during the rebuild
        submit = (flight.client_id, flight.submission)
        if actor._early_aborts.take(rid, submit) or actor._aborted_family(flight.request):
            actor.abort(rid)
    logger.warning(
        "central scheduler restarted: %d instances, %d requests in flight taken on",
        len(found),
        len(actor.flights),
    )


async def _kv_transport_in_use(actor: Any, specs: list[Any]) -> None:
    """``transport: auto`` is resolved again by a restarted actor's ``__init__``; the workers
    know what the cluster chose (it may have fallen back): take theirs."""
    from cluster.control.placement import KV_PEERS_TIMEOUT_S, MONITOR

    async def health_of(spec: Any) -> list[Any]:  # (a worker Ray cannot place again: none)
        call = spec.call_stages("health", group=MONITOR, return_exceptions=True)
        try:  # (the monitor's thread: no step to wait behind)
            return list(await asyncio.wait_for(call, KV_PEERS_TIMEOUT_S))
        except TimeoutError:
            return []

    counts: dict[str, int] = {}
    for health in await asyncio.gather(*(health_of(spec) for spec in specs)):
        for h in health:
            if isinstance(h, dict) and h.get("kv_transport"):
                counts[h["kv_transport"]] = counts.get(h["kv_transport"], 0) + 1
    if counts:  # what most workers use (a straggler that fell back does not decide)
        used = max(counts, key=lambda t: counts[t])
        if used != actor.config.kv_transfer.transport:
            actor.config = actor.config.with_kv_transport(used)
