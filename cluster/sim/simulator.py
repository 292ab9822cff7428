"""The simulator: Tandem's own control plane -- the ``SchedulerActor`` with its ``Router``,
admission and P/D hand-off, each instance's ``InstanceEngine``, ``EngineLoop`` and
``Scheduler`` -- run in one process on a virtual clock (``cluster/sim/clock.py``), with each
instance's worker replaced by a ``SimExecutor`` whose steps and KV transfers take the time a
cost model says. No Ray, no model, no copy of the scheduling code: what the real cluster would
decide, at the time it would decide it.

    sim = Simulation(config, cost)            # the ClusterConfig you would serve with
    result = sim.run(poisson(rate=4, num_requests=500, shape="chat"), SLO(0.5, 0.05))
    result.summary()                          # TTFT / TPOT / e2e percentiles, throughput,
                                              # SLO attainment and goodput
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from cluster.config import ClusterConfig, InstancePool
from cluster.control.placement import InstanceSpec
from cluster.sim.clock import SimulationStalled, run_virtual
from cluster.sim.cost import CostModel, RooflineCostModel
from cluster.sim.executor import Machine, SimExecutor
from cluster.sim.workload import WorkItem
from scheduler import LoRARequest, Request, SamplingParams

SIM_VOCAB = 32000
CLIENT = "sim"  # the one client (an ingress replica) every simulated request comes from


@dataclass(frozen=True)
class SLO:
    """Latency targets: a request meets them when its TTFT and its mean time per output token
    (after the first) are both within (DistServe's definition of goodput)."""

    ttft_s: float
    tpot_s: float


@dataclass
class RequestRecord:
    arrival_s: float
    prompt_len: int
    output_len: int
    first_token_s: float | None = None  # virtual time of its first token
    end_s: float | None = None
    num_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot(self) -> float | None:
        if self.first_token_s is None or self.end_s is None or self.num_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.num_tokens - 1)

    @property
    def e2e(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.arrival_s

    def meets(self, slo: SLO) -> bool:
        if self.error is not None or self.ttft is None or self.ttft > slo.ttft_s:
            return False
        tpot = self.tpot
        return tpot is None or tpot <= slo.tpot_s


def percentile(values: list[float], q: float) -> float:
    """The ``q``-quantile (0-1), linear between order statistics; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float  # virtual: the first arrival to the last end
    wall_s: float  # real seconds the simulation took
    slo: SLO | None
    # Per instance: its role, virtual seconds in steps (busy_s), and the engine loop's
    # counters at the end (steps, preemptions, prefix-cache hits, KV bytes moved).
    instances: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The autoscaler's decisions (``control/autoscaler.Decision``, time from the start).
    decisions: list[dict[str, Any]] = field(default_factory=list)
    autoscaling: dict[str, Any] = field(default_factory=dict)  # Autoscaler.stats() at the end

    def summary(self, offered_rate: float | None = None) -> dict[str, Any]:
        """TTFT / TPOT / e2e percentiles, throughput and, with an SLO, attainment and goodput.
        ``offered_rate``: the rate the workload was generated at; goodput is then attainment x
        that rate, comparable with it. Without it, per second of the arrivals' own span: a
        Poisson sample's span is off its rate's by a few % (one seed, the same factor at every
        rate), so it is not the offered rate's goodput."""
        done = [r for r in self.records if r.error is None and r.end_s is not None]
        ttft = [r.ttft for r in done if r.ttft is not None]
        tpot = [t for r in done if (t := r.tpot) is not None]
        tokens = sum(r.num_tokens for r in done)
        out: dict[str, Any] = {
            "requests": len(self.records),
            "finished": len(done),
            "errors": sum(r.error is not None for r in self.records),
            "duration_s": self.duration_s,
            "wall_s": self.wall_s,
            "speedup": self.duration_s / self.wall_s if self.wall_s else math.inf,
            "throughput_tokens_s": tokens / self.duration_s if self.duration_s else 0.0,
            "throughput_requests_s": len(done) / self.duration_s if self.duration_s else 0.0,
        }
        for name, values in (("ttft", ttft), ("tpot", tpot)):
            for q in (50, 90, 99):
                out[f"{name}_p{q}_s"] = percentile(values, q / 100)
        out["e2e_p50_s"] = percentile([r.e2e for r in done if r.e2e is not None], 0.5)
        if self.slo is not None:
            met = sum(r.meets(self.slo) for r in self.records)
            out["slo_attainment"] = met / len(self.records) if self.records else math.nan
            if offered_rate is not None:
                out["goodput_requests_s"] = offered_rate * met / len(self.records) if met else 0.0
                return out
            # Per second of arrivals (the offered load's span, not the tail that drains
            # after it): at full attainment, the offered rate.
            arrivals = [r.arrival_s for r in self.records]
            span = max(arrivals) - min(arrivals) if len(arrivals) > 1 else 0.0
            if span > 0:
                out["goodput_requests_s"] = met * (len(arrivals) - 1) / len(arrivals) / span
            else:  # a burst (or one request): per second of the run
                duration = self.duration_s
                out["goodput_requests_s"] = met / duration if duration else 0.0
        return out


class Simulation:
    """``config``: the cluster as it would be served (pools, their schedulers, the router,
    the KV hand-off's timeout); ``cost``: one cost model for every pool, or one per pool name.
    Each instance's KV cache has its pool's ``num_blocks``, or what the cost model says fits."""

    def __init__(
        self,
        config: ClusterConfig,
        cost: CostModel | dict[str, CostModel],
        instance_start_s: float = 0.0,
    ) -> None:
        """``instance_start_s``: how long an instance added while the cluster runs (a pool
        grown by ``scale_pool`` or the autoscaler) takes to serve -- its workers placed, the
        model loaded (tens of seconds on GPUs; 0: at once)."""
        self.instance_start_s = instance_start_s
        self.config = config.model_copy(
            update={
                "kv_transfer": config.kv_transfer.model_copy(update={"transport": "ray"}),
                "engine_actors": False,
                "health_check_interval_s": 0,
                "client_timeout_s": 1e9,  # the simulated client sends no keep-alives
            }
        )
        self.costs = cost if isinstance(cost, dict) else {p.name: cost for p in config.pools}
        # A request still open this long (simulated) after the last arrival is stuck.
        self.stall_after_s = 86400.0
        missing = [p.name for p in config.pools if p.name not in self.costs]
        if missing:
            raise ValueError(f"no cost model for pool(s) {', '.join(missing)}")

    def _instance(self, iid: str, pool: InstancePool) -> InstanceSpec:
        block_size = self.config.block_size
        cost = self.costs[pool.name]
        num_blocks = pool.num_blocks
        if num_blocks is None and pool.kv_cache_memory_bytes is not None:
            # Per worker, as the workers take it: a pipeline stage's block holds its own
            # layers only, so the same bytes hold pp_size times more blocks.
            per_block = block_size * cost.kv_bytes_per_token()
            num_blocks = pool.kv_cache_memory_bytes * pool.pp_size // per_block
        if num_blocks is None and pool.memory_budget_bytes is not None:
            if not isinstance(cost, RooflineCostModel):
                raise ValueError(
                    f"pool {pool.name!r}: memory_budget_bytes needs a cost model that knows "
                    f"the weights' size ({cost.name!r} does not): set num_blocks"
                )
            # Per GPU (a worker's), as the workers take it: its share of the weights, and
            # of each token's KV (tensor parallel: heads; pipeline stages: layers).
            m, gpus = cost.model, cost.tp * pool.pp_size
            kv_bytes = (pool.memory_budget_bytes - m.num_params * m.bytes_per_param // gpus) * gpus
            num_blocks = max(0, kv_bytes) // (block_size * cost.kv_bytes_per_token())
            if num_blocks < 1:
                raise ValueError(f"pool {pool.name!r}: memory_budget_bytes leaves no room for KV")
        if num_blocks is None:
            capacity = cost.kv_capacity_tokens()
            if pool.pp_size > 1 and isinstance(cost, RooflineCostModel):
                # Its stages' GPUs hold the weights once between them: more room for KV.
                capacity = dataclasses.replace(cost, tp=cost.tp * pool.pp_size).kv_capacity_tokens()
            if capacity is None:
                raise ValueError(
                    f"pool {pool.name!r}: set num_blocks (the cost model {cost.name!r} "
                    "does not size the KV cache)"
                )
            num_blocks = capacity // block_size
        info = {
            "max_position_embeddings": 1 << 17,
            "max_context_len": 1 << 17,
            "num_blocks": num_blocks,
            "block_size": block_size,
            "bytes_per_block": block_size * cost.kv_bytes_per_token(),
            "model_path": "sim",
            "vocab_size": SIM_VOCAB,
            "eos_token_ids": [2],
            "num_layers": 1,
            "layers": [0, 1],
            "pp_rank": 0,
            "pp_size": 1,
            "dtype": "bfloat16",
            "node_id": None,
        }
        machine = None
        cores = getattr(cost, "machine_cores", None)
        if cores is not None:  # instances fill machines of the cost model's size in turn
            per_machine = max(1, int(getattr(cost, "instances_per_machine", 1)))
            key = (cost.name, len(self._started) // per_machine)
            machine = self._machines.setdefault(
                key, Machine(cores, getattr(cost, "background_cores", 0.0))
            )
        speedup = 1.0
        if pool.num_threads == "auto":  # the worker spreads over the cores it finds free
            speedup = float(getattr(cost, "spare_core_speedup", 1.0))
        executor = SimExecutor(iid, cost, block_size, machine, speedup, pool.pp_size)
        spec = InstanceSpec(iid, pool, executor, None, info)
        self._started.append(spec)
        return spec

    def _specs(self) -> list[InstanceSpec]:
        self._started: list[InstanceSpec] = []
        self._machines: dict[tuple[str, int], Machine] = {}
        return [
            self._instance(f"{pool.name}-{i}", pool)
            for pool in self.config.pools
            for i in range(pool.replicas)
        ]

    async def _start_instances(
        self,
        _config: ClusterConfig,
        wanted: list[tuple[str, InstancePool]],
        _timeout_s: float,
        _fallback: str | None,
    ) -> list[InstanceSpec]:
        """A pool grows (``scale_pool``, the autoscaler): simulated instances, once they have
        started (``instance_start_s``)."""
        if self.instance_start_s > 0:
            await asyncio.sleep(self.instance_start_s)
        return [self._instance(iid, pool) for iid, pool in wanted]

    def run(self, workload: list[WorkItem], slo: SLO | None = None, seed: int = 0) -> SimResult:
        """Serve ``workload`` (its prompts drawn from ``seed``); deterministic for a seed."""
        from cluster.control.scheduler_actor import SchedulerActor

        started = time.perf_counter()
        records = [RequestRecord(w.arrival_s, w.prompt_len, w.output_len) for w in workload]
        specs = self._specs()
        loras = {
            name: LoRARequest(lora_name=name, lora_int_id=i + 1, lora_path=name)
            for i, name in enumerate(sorted({w.lora for w in workload if w.lora}))
        }
        logging.getLogger("cluster").setLevel(logging.WARNING)

        def request(index: int, item: WorkItem, now: float) -> Request:
            params = SamplingParams(max_tokens=item.output_len, ignore_eos=True, temperature=0.0)
            return Request(
                f"sim-{index}",
                item.prompt(seed, index, SIM_VOCAB),
                params,
                eos_token_id=2,
                arrival_time=now,
                lora_request=loras.get(item.lora) if item.lora else None,
            )

        async def submit(actor: Any, index: int, item: WorkItem, now: float) -> None:
            try:
                await actor.submit(request(index, item, now), CLIENT, submission=index)
            except Exception as exc:  # refused (the waiting bound), or no instance left
                records[index].error = f"{type(exc).__name__}: {exc}"
                records[index].end_s = now
                open_requests.discard(index)

        async def receive(actor: Any, done: asyncio.Event) -> None:
            # One client, as an ingress replica: a batch of every request's new tokens per
            # wake-up (the product's batched path), not a stream per request.
            loop = asyncio.get_running_loop()
            async for batch in actor.subscribe(CLIENT):
                now = loop.time()
                for wire in batch:
                    index, tokens, reason, error = wire[0], wire[2], wire[3], wire[7]
                    record = records[index]
                    if tokens:
                        if record.first_token_s is None:
                            record.first_token_s = now
                        record.num_tokens += len(tokens)
                    if reason is not None:
                        record.end_s, record.error = now, error
                        open_requests.discard(index)
                if arrived.is_set() and not open_requests:
                    done.set()
                    return

        stats: dict[str, dict[str, Any]] = {}
        decisions: list[dict[str, Any]] = []
        autoscaling: dict[str, Any] = {}
        open_requests = set(range(len(workload)))
        arrived = asyncio.Event()

        async def main() -> tuple[float, float]:
            loop = asyncio.get_running_loop()
            actor = SchedulerActor(self.config, specs, self._start_instances)
            await actor.start()
            done = asyncio.Event()
            receiver = asyncio.ensure_future(receive(actor, done))
            origin = loop.time()
            tasks = []
            for index, item in enumerate(workload):
                delay = origin + item.arrival_s - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.ensure_future(submit(actor, index, item, loop.time())))
            await asyncio.gather(*tasks)
            arrived.set()
            if open_requests:
                try:
                    await asyncio.wait_for(done.wait(), self.stall_after_s)
                except TimeoutError:
                    raise SimulationStalled(
                        f"{len(open_requests)} requests still open {self.stall_after_s:g} "
                        "simulated seconds after the last arrival"
                    ) from None
            end = loop.time()
            receiver.cancel()
            everything = await actor.stats()
            stats.update(everything["instances"])
            autoscaling.update(everything.get("autoscaling") or {})
            for d in actor.autoscaler.decisions:
                decisions.append({**asdict(d), "time": d.time - origin})
            await actor.shutdown()
            return origin, end

        origin, end = run_virtual(main())
        for record in records:  # times from the run's start, as the workload's
            if record.first_token_s is not None:
                record.first_token_s -= origin
            if record.end_s is not None:
                record.end_s -= origin
        first = min((w.arrival_s for w in workload), default=0.0)
        instances = {
            spec.instance_id: {
                **stats.get(spec.instance_id, {}),
                "role": spec.pool.role,
                "busy_s": spec.executor.busy_s,
            }
            for spec in self._started
        }
        return SimResult(
            records,
            end - origin - first,
            time.perf_counter() - started,
            slo,
            instances,
            decisions,
            autoscaling,
        )
