"""Starting an instance's workers on the Ray cluster (the Ray wiring of DESIGN §2).

Each instance of a pool is one ``ModelWorker`` actor, or ``pp_size`` of them (pipeline stages,
each holding a contiguous range of layers), placed by the pool's resources (custom node resources
such as ``{"prefill": 0.01}``, CPUs, GPUs; ``stage_resources`` adds per-stage ones). All workers
are created at once and load their weights in parallel; then each sizes its KV cache, and the
stages of an instance all allocate the smallest of their sizes (one block table serves them all).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.config import ClusterConfig, InstancePool
from cluster.control.placeable import check_placeable, launchable_node_groups

logger = logging.getLogger(__name__)

MONITOR = "monitor"  # the workers' concurrency group for health and history calls
# The workers' group for KV probes (``kv_probe``): one waits up to its timeout for a peer
# that cannot be reached, and on the default group (one thread: the steps') no step ran
# meanwhile. Several threads: a new instance probes every live one at once.
PROBE = "probe"
WORKER_GROUPS = {MONITOR: 1, PROBE: 4}


@dataclass
class InstanceSpec:
    """One started instance: its worker and what the scheduler needs to know about it."""

    instance_id: str
    pool: InstancePool
    executor: Any  # an ``Executor``
    handle: Any  # the Ray actor, the first stage's for a pipeline (None for in-process workers)
    info: dict[str, Any]  # the last stage's (for a pipeline; it holds the output head)
    stages: list[Any] = field(default_factory=list)  # every stage's actor, in order
    kv_peers: list[Any] = field(default_factory=list)  # the KV transport's per-worker info
    # Why its workers did not answer a KV-peer call of the last connection round in time
    # (``connect_kv_peers``): they hang. The caller fails the instance and clears it.
    unanswered: str | None = None

    @property
    def actors(self) -> list[Any]:
        """Every Ray actor of the instance (empty for in-process workers)."""
        return self.stages or ([] if self.handle is None else [self.handle])

    async def call_stages(
        self,
        method: str,
        *args: Any,
        group: str | None = None,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """``method(*args)`` on every stage's worker, in stage order: the Ray actors (in their
        concurrency ``group``, e.g. ``MONITOR``, which answers while a step runs) or the
        in-process workers. ``return_exceptions``: a stage's error is its result (a dead
        worker)."""
        if self.actors:
            calls = []
            for actor in self.actors:
                bound = getattr(actor, method)
                if group is not None:
                    bound = bound.options(concurrency_group=group)
                calls.append(bound.remote(*args))
            return list(await asyncio.gather(*calls, return_exceptions=return_exceptions))
        workers = getattr(self.executor, "workers", None) or [self.executor.worker]
        results: list[Any] = []
        for worker in workers:
            try:
                results.append(getattr(worker, method)(*args))
            except Exception as exc:
                if not return_exceptions:
                    raise
                results.append(exc)
        return results


def worker_actor_prefix(central_actor_id: str) -> str:
    """With engine actors, the names of a central scheduler's workers (detached) start with
    this: ``{prefix}{instance id}/{pp rank}``. A restarted central scheduler finds by them
    the workers of an instance whose start it did not finish (``orphan_workers``)."""
    return f"tandem-worker/{central_actor_id}/"


def named_actors(prefixes: tuple[str, ...], namespace: str | None = None) -> list[tuple[str, str]]:
    """(name, namespace) of each named actor whose name starts with one of ``prefixes`` (in
    ``namespace`` only, if given): a central scheduler's workers and engines."""
    import ray

    return [
        (entry["name"], entry["namespace"])
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["name"].startswith(prefixes) and namespace in (None, entry["namespace"])
    ]


def orphan_workers(central_actor_id: str, namespace: str, instances: set[str]) -> list[str]:
    """The names of the central scheduler's detached workers whose instance is not in
    ``instances`` (it died while they were starting, before their engine existed)."""
    prefix = worker_actor_prefix(central_actor_id)
    return [
        name
        for name, _ in named_actors((prefix,), namespace)
        if name[len(prefix) :].rpartition("/")[0] not in instances
    ]


def kill_orphan_workers(central_actor_id: str, namespace: str, instances: set[str]) -> set[str]:
    """Kill the central scheduler's named workers of instances not in ``instances``; returns
    those instances' ids."""
    import ray

    prefix = worker_actor_prefix(central_actor_id)
    killed = set()
    for name in orphan_workers(central_actor_id, namespace, instances):
        logger.warning("killing worker %s: its instance never started", name)
        killed.add(name[len(prefix) :].rpartition("/")[0])
        try:
            ray.kill(ray.get_actor(name, namespace=namespace))
        except ValueError:  # gone meanwhile
            continue
    return killed


def worker_options(pool: InstancePool, pp_rank: int = 0) -> dict[str, Any]:
    options: dict[str, Any] = {
        "num_cpus": pool.num_cpus,
        "num_gpus": pool.num_gpus,
        "resources": pool.resources_of_stage(pp_rank),
        # Steps always run on one thread (OpenMP teams and oneDNN caches are per thread:
        # alternating threads cost ~10% per step); health() answers from the MONITOR group's
        # thread while a step runs (see start_workers).
        "max_concurrency": 1,
        # A restarted worker comes back empty (the SchedulerActor reloads it); a step is never
        # retried on it: the requests move elsewhere instead.
        "max_restarts": pool.max_restarts,
        "max_task_retries": 0,
    }
    if pool.num_threads == "auto":
        # Shared cores (actors.cores): threads of a team that just lost its core to another
        # worker's step spin at most ~20k iterations at a barrier before sleeping (libgomp's
        # default, 300k, made two busy workers 10% slower than fixed single threads).
        env = {"GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "20000")}
        options["runtime_env"] = {"env_vars": env}
    elif pool.num_threads is not None:
        # Ray sets OMP_NUM_THREADS=1 for actors; threads other than the one that ran __init__
        # start their OpenMP teams from it, not from torch.set_num_threads: without this the
        # steps ran single-threaded (96 ms instead of 45 ms per SmolLM2 token).
        threads = str(pool.num_threads)
        options["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": threads}}
    return options


def worker_class() -> Any:
    """The model worker as a Ray actor class (``WorkerActor``: no torch where its handles
    go), with its concurrency groups."""
    import ray

    from actors.worker_actor import WorkerActor

    return ray.remote(concurrency_groups=WORKER_GROUPS)(WorkerActor)  # type: ignore[call-overload]


def worker_kwargs(
    config: ClusterConfig, pool: InstancePool, pp_rank: int = 0, kv_fallback: str | None = None
) -> dict[str, Any]:
    sched = pool.scheduler_config(config.max_model_len)  # the budget the engine will use
    budget: int | None = sched.max_num_batched_tokens
    unset = pool.scheduler.get("max_num_batched_tokens") is None  # (null: unset too)
    whole_prompt = not sched.enable_chunked_prefill and unset
    if whole_prompt and config.max_model_len is None:  # the worker's model says how long
        budget = None
    threads = pool.num_threads if pool.num_threads is not None else None
    return {
        "model": config.model,
        "dtype": config.dtype,
        "quantization": config.quantization,
        "quant_dense_min_rows": config.quantized_dense_min_rows,
        "enforce_eager": config.enforce_eager,
        "device": pool.device,
        "block_size": config.block_size,
        "lora_config": config.lora,
        "max_num_batched_tokens": budget,
        "max_num_seqs": sched.max_num_seqs,
        "progress": False,
        "kv_transfer": config.kv_transfer.transport if config.disaggregated else None,
        "kv_transfer_options": config.kv_transfer.connector_options(),
        "kv_transfer_fallback": kv_fallback,
        "num_threads": threads,
        "pp_rank": pp_rank,
        "pp_size": pool.pp_size,
        "tracing": config.tracing if config.tracing.enabled else None,
    }


async def start_workers(
    config: ClusterConfig, timeout_s: float, kv_fallback: str | None = None
) -> list[InstanceSpec]:
    """Every pool's ``replicas`` instances (``{pool}-{i}``), started by ``start_instances``."""
    wanted = [(f"{p.name}-{i}", p) for p in config.pools for i in range(p.replicas)]
    return await start_instances(config, wanted, timeout_s, kv_fallback)


# (config, wanted (instance id, pool), timeout_s, kv_fallback) -> the started instances
StartInstances = Callable[
    [ClusterConfig, list[tuple[str, InstancePool]], float, str | None],
    Awaitable[list["InstanceSpec"]],
]


async def start_instances(
    config: ClusterConfig,
    wanted: list[tuple[str, InstancePool]],
    timeout_s: float,
    kv_fallback: str | None = None,
) -> list[InstanceSpec]:
    """Create the workers of the ``wanted`` instances (id, pool), load the model everywhere in
    parallel, size and allocate the KV caches. Raises ``TimeoutError`` naming the pools whose
    workers could not be placed or loaded in time (usually: no node offers their resources);
    nothing is left running then. ``kv_fallback``: the KV transport a worker uses if the
    configured one cannot be set up on its node (``transport: auto``)."""
    import ray  # here, not at the top: what only reads an InstanceSpec needs no Ray or torch

    from cluster.control.executors import PipelineExecutor, RayExecutor
    from kv_transfer.registry import available_transports

    transport = config.kv_transfer.transport
    if config.disaggregated and transport not in available_transports():
        raise ValueError(
            f"kv_transfer.transport {transport!r} is not available; "
            f"available: {', '.join(available_transports())}"
        )
    # The pools of the instances wanted only: a pool whose nodes are gone (its instances
    # failed) must not stop another pool from growing.
    pools = list({pool.name: pool for _, pool in wanted}.values())
    nodes = ray.nodes()  # type: ignore[no-untyped-call]
    check_placeable(config, nodes, launchable_node_groups(), pools)
    remote_worker = worker_class()
    created: list[tuple[str, InstancePool, list[Any]]] = []
    # With engine actors the central scheduler may die and come back: the workers (like the
    # engines) must not die with it, their creator. Its shutdown kills them; named, they are
    # found again if it dies before their engines exist.
    prefix = worker_actor_prefix(ray.get_runtime_context().get_actor_id() or "")
    for instance_id, pool in wanted:
        stages = []
        for rank in range(pool.pp_size):
            options = worker_options(pool, rank)
            if config.engine_actors:
                options |= {"lifetime": "detached", "name": f"{prefix}{instance_id}/{rank}"}
            stages.append(
                remote_worker.options(**options).remote(
                    **worker_kwargs(config, pool, rank, kv_fallback)
                )
            )
        created.append((instance_id, pool, stages))
    workers = [(iid, pool, h) for iid, pool, stages in created for h in stages]
    try:
        await _wait_all(
            [h.load_model.remote() for _, _, h in workers], workers, "load the model", timeout_s
        )
        sizes = await _wait_all(
            [
                h.size_kv_cache.remote(
                    pool.num_blocks, pool.kv_cache_memory_bytes, pool.memory_budget_bytes
                )
                for _, pool, h in workers
            ],
            workers,
            "size the KV cache",
            timeout_s,
        )
        smallest: dict[str, int] = {}
        for (iid, _, _), n in zip(workers, sizes, strict=True):
            smallest[iid] = min(n, smallest.get(iid, n))
        await _wait_all(
            [h.init_kv_cache.remote(smallest[iid]) for iid, _, h in workers],
            workers,
            "allocate the KV cache",
            timeout_s,
        )
        infos = await _wait_all(
            [stages[-1].info.remote() for _, _, stages in created],
            [(iid, pool, stages[-1]) for iid, pool, stages in created],
            "report",
            timeout_s,
        )
    except BaseException:
        for _, _, handle in workers:
            ray.kill(handle)
        raise
    return [
        InstanceSpec(
            iid,
            pool,
            RayExecutor(stages[0]) if len(stages) == 1 else PipelineExecutor(stages),
            stages[0],
            info,
            stages,
        )
        for (iid, pool, stages), info in zip(created, infos, strict=True)
    ]


# A KV-peer call (``kv_peer``, ``add_kv_peers``, ``remove_kv_peers``) runs on a worker's
# steps' thread, under its step lock: a worker hung in a step, idle behind a stuck call, or
# one Ray cannot place again after a restart never answers it. A connection round waits this
# long for an instance's workers (``kv_peers_timeout_s``), then takes the instance for hung
# (``unanswered``): one such worker otherwise held the round -- and the ``_membership`` lock,
# every resize, a restarted central actor's rebuild -- for ever.
KV_PEERS_TIMEOUT_S = 60.0  # at least; a longer step_timeout_s lengthens it
STEP_MARGIN_S = 10.0  # past step_timeout_s: the call's own work, after the step it waited for


def kv_peers_timeout_s(step_timeout_s: float | None) -> float:
    """How long a connection round waits for an instance's workers: a call waits behind the
    step in progress, so a worker is taken for hung no sooner than its step would be
    (``step_timeout_s``), and never later than ``KV_PEERS_TIMEOUT_S`` when steps may run
    for ever (``step_timeout_s: null``: a round must end)."""
    if step_timeout_s is None:
        return KV_PEERS_TIMEOUT_S
    return max(KV_PEERS_TIMEOUT_S, step_timeout_s + STEP_MARGIN_S)


def _no_answer(spec: InstanceSpec, method: str, timeout_s: float, mark: bool = True) -> str:
    why = f"its workers did not answer {method} within {timeout_s:g} s"
    if mark:  # (only a connection round's caller consumes it: ``KVPeers._fail_unanswered``)
        spec.unanswered = why
    return why


async def _stages_within(
    spec: InstanceSpec, method: str, *args: Any, timeout_s: float, mark: bool = True
) -> list[Any]:
    """``spec.call_stages(method, *args, return_exceptions=True)`` for at most ``timeout_s``;
    past it, one ``TimeoutError`` (and, ``mark``, ``spec.unanswered``)."""
    try:
        return await asyncio.wait_for(
            spec.call_stages(method, *args, return_exceptions=True), timeout_s
        )
    except TimeoutError:
        return [TimeoutError(_no_answer(spec, method, timeout_s, mark))]


def kv_peer_names(spec: InstanceSpec) -> list[str]:
    """The names of ``spec``'s workers as KV peers (``nixl``: their agents)."""
    names = [getattr(peer, "agent", None) for peer in spec.kv_peers]
    return [name for name in names if isinstance(name, str)]


async def disconnect_kv_peers(
    specs: list[InstanceSpec], names: list[str], timeout_s: float | None = None
) -> None:
    """Tell every worker of ``specs`` to forget the KV peers ``names`` (workers that left:
    an instance removed, or a restarted worker's previous agent). Workers that do not answer
    are skipped: they are gone too (or hang: at most ``timeout_s``, default
    ``KV_PEERS_TIMEOUT_S``). Nothing is
    marked ``unanswered``: most callers (a retire's ``_stop_workers``, a refused round) never
    consume the mark, and a stale one would fail a healthy instance in a later round."""
    if not names:
        return
    wait = KV_PEERS_TIMEOUT_S if timeout_s is None else timeout_s
    answers = await asyncio.gather(
        *(
            _stages_within(spec, "remove_kv_peers", names, timeout_s=wait, mark=False)
            for spec in specs
        )
    )
    for spec, results in zip(specs, answers, strict=True):
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            logger.info("KV peers: %s did not forget: %s", spec.instance_id, failed[0])


async def connect_kv_peers(
    specs: list[InstanceSpec],
    new: list[InstanceSpec],
    probe: bool = False,
    timeout_s: float | None = None,
) -> list[str]:
    """Hand every worker of ``specs`` what the KV transport needs to read from the others
    (``nixl``: each worker's agent and pool layout, gathered from the workers of the ``new``
    instances and kept on their spec). Workers of instances that do not answer (dead) are
    skipped. ``probe``: also check, with a small read into scratch space (no cache is
    touched), that each new instance's workers reach every other instance's and are reached
    by them, and that every new worker has the transport at all. Returns what failed, one
    line each; a no-op for transports that publish nothing. Each instance's workers are
    waited for at most ``timeout_s`` (default ``KV_PEERS_TIMEOUT_S``) per call: one that does
    not answer in time is marked ``unanswered`` (a new one's is also an error), for the
    caller to fail it."""
    wait = KV_PEERS_TIMEOUT_S if timeout_s is None else timeout_s
    errors: list[str] = []

    async def peers_of(spec: InstanceSpec) -> list[Any] | None:
        try:
            return list(await asyncio.wait_for(spec.call_stages("kv_peer"), wait))
        except TimeoutError:
            return None

    # All at once: a rebuild asks every instance, and hung ones are not waited for in turn.
    for spec, found in zip(new, await asyncio.gather(*map(peers_of, new)), strict=True):
        if found is None:
            errors.append(f"{spec.instance_id}: {_no_answer(spec, 'kv_peer', wait)}")
            continue
        spec.kv_peers = [p for p in found if p is not None]
        if probe and len(spec.kv_peers) != len(found):
            errors.append(f"{spec.instance_id}: a worker has no NIXL (fell back to another)")
    peers = [p for spec in specs for p in spec.kv_peers]
    if not peers:
        return errors
    answers = await asyncio.gather(
        *(_stages_within(spec, "add_kv_peers", peers, timeout_s=wait) for spec in specs)
    )
    live = []
    for spec, results in zip(specs, answers, strict=True):
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            logger.warning("KV peers: %s did not take them: %s", spec.instance_id, failed[0])
            if spec in new:
                errors.append(f"{spec.instance_id}: {type(failed[0]).__name__}: {failed[0]}")
        else:
            live.append(spec)
    if not probe or errors:
        return errors
    # Each new instance reads from every live one and is read by it: every reader stage
    # probes every source stage (a few bytes into scratch space), all pairs at once.
    pairs = {
        (id(reader), id(source)): (reader, source)
        for spec in new
        for other in live
        if other is not spec
        for reader, source in ((spec, other), (other, spec))
        if source.kv_peers
    }

    async def probe_pair(reader: InstanceSpec, source: InstanceSpec) -> list[str]:
        found = []
        for s_stage, peer in enumerate(source.kv_peers):
            try:  # (the probe takes the step lock around each use of the agent)
                results = await asyncio.wait_for(
                    reader.call_stages("kv_probe", peer, 2.0, group=PROBE, return_exceptions=True),
                    wait,
                )
            except TimeoutError:
                results = [f"no answer within {wait:g} s"]
            for r_stage, error in enumerate(results):
                if error is not None:
                    found.append(
                        f"{reader.instance_id}[{r_stage}] -> {source.instance_id}[{s_stage}]: "
                        f"{error}"
                    )
        return found

    for found in await asyncio.gather(*(probe_pair(r, s) for r, s in pairs.values())):
        errors.extend(found)
    return errors


async def _wait_all(
    calls: list[Any], created: list[tuple[str, InstancePool, Any]], what: str, timeout_s: float
) -> list[Any]:
    tasks = [asyncio.ensure_future(c) for c in calls]
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    if pending:
        for task in pending:
            task.cancel()
        late = [created[i] for i, t in enumerate(tasks) if t in pending]
        names = ", ".join(f"{iid} (resources {pool.resources or 'none'})" for iid, pool, _ in late)
        raise TimeoutError(
            f"workers did not {what} within {timeout_s:.0f}s: {names}. Does a node offer "
            "those resources?"
        )
    return [t.result() for t in tasks]
