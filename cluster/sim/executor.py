"""The simulated worker: it takes the real ``SchedulerOutput`` of a step, prices it with a cost
model, sleeps that long in virtual time, and answers as a worker would -- a token for each
request that reached the end of what it knows, the KV hand-offs saved and loaded.

It computes nothing: every request samples ``TOKEN`` (not an end-of-sequence id) and runs to
its ``max_tokens``. A step runs alone on its instance (one device); KV loads proceed beside the
steps and are reported, like a worker's, in the first step's output after they end (failed
past their ``timeout_s``).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from cluster.sim.cost import CostModel, StepShape
from kv_transfer.connector import KVConnectorReport, KVSegment
from scheduler import ModelRunnerOutput, SchedulerOutput

TOKEN = 7  # what every simulated request samples (not an EOS id)


@dataclass(frozen=True)
class SimHandle:
    """Where a simulated hand-off's KV is: only its size matters."""

    source: str
    num_bytes: int


def step_shape(
    scheduled: dict[str, int], starts: dict[str, int], lora: set[str], num_sampled: int
) -> StepShape:
    """The shape of a step that computes ``scheduled[r]`` positions of each request ``r``
    from position ``starts[r]`` (``lora``: the requests with an adapter). One position
    after others is a decode; anything else is a (chunk of a) prefill."""
    prefill_tokens = num_decodes = decode_context = lora_tokens = prefill_context = 0
    prefill_pairs = 0.0
    for req_id, n in scheduled.items():
        start = starts[req_id]
        if n == 1 and start > 0:
            num_decodes += 1
            decode_context += start + 1
        else:
            prefill_tokens += n
            prefill_pairs += n * (start + (n + 1) / 2)
            prefill_context += start
        if req_id in lora:
            lora_tokens += n
    return StepShape(
        prefill_tokens,
        prefill_pairs,
        num_decodes,
        decode_context,
        num_sampled,
        lora_tokens,
        prefill_context,
    )


# Steps of fewer tokens run on one thread even in a pool of ``num_threads: auto``: waking a
# thread team costs more than it gains there (``actors.cores.MIN_STEP_TOKENS``; a test holds
# the two equal -- the simulator imports no torch).
MIN_SHARED_STEP_TOKENS = 64
IDLE_LOAD_WAIT_S = 0.05  # an idle step waits this long at most for a KV load (as the worker)


class Machine:
    """Cores that several instances' workers share (processor sharing): while ``n`` of them
    step, each has ``share = cores / (n + background)`` cores, ``background`` being the cores
    the serving processes keep busy, and runs at ``min(1, share)`` of its one-thread speed.
    A worker that spreads over the cores it finds free (``num_threads: auto``) runs a large
    step faster when its share is above one core: up to ``speedup`` times, with two cores to
    itself (``speed``). A step's remaining work is rescaled whenever another starts or ends.
    (The real core sharing hands out whole threads and ignores the serving processes; this is
    the continuous version of it.)"""

    def __init__(self, cores: float, background: float = 0.0) -> None:
        self.cores = cores
        self.background = background
        self._busy = 0
        self._changed = asyncio.Event()

    def speed(self, speedup: float = 1.0) -> float:
        """A busy worker's speed, relative to its one-thread step; ``speedup``: what a second
        core to itself gives it (1: it runs one thread)."""
        share = self.cores / (self._busy + self.background)
        if share <= 1.0:
            return share
        return 1.0 + (speedup - 1.0) * min(1.0, share - 1.0)

    def _change(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def run(self, work: float, speedup: float = 1.0) -> float:
        """Take ``work`` seconds of one core's time (``speedup``: see ``speed``); returns the
        seconds it took."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        self._busy += 1
        self._change()
        try:
            while work > 1e-12:
                speed, changed, since = self.speed(speedup), self._changed, loop.time()
                waiter = asyncio.ensure_future(changed.wait())
                done, _ = await asyncio.wait((waiter,), timeout=work / speed)
                if not done:
                    waiter.cancel()
                    break
                work -= (loop.time() - since) * speed
        finally:
            self._busy -= 1
            self._change()
        return loop.time() - started


class ShapeTracker:
    """Follows a worker's requests through its steps, as a worker does: which ones sample
    (their positions reach what is known of them) and the shape of each step."""

    def __init__(self) -> None:
        self._lengths: dict[str, int] = {}  # request id -> tokens known (prompt + sampled)
        self._lora: set[str] = set()  # requests with an adapter

    def observe(self, out: SchedulerOutput) -> tuple[StepShape, list[bool]]:
        """The step's shape, and per scheduled request (in ``num_scheduled_tokens`` order)
        whether it samples a token."""
        lengths = self._lengths
        for req_id in out.finished_req_ids:
            lengths.pop(req_id, None)
            self._lora.discard(req_id)
        starts: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            lengths[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            starts[new.req_id] = new.num_computed_tokens
            if new.lora_request is not None:
                self._lora.add(new.req_id)
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, tokens in cached.resumed_token_ids.items():
            lengths[req_id] = len(tokens)
        samples = []
        for req_id, n in out.num_scheduled_tokens.items():
            sample = starts[req_id] + n >= lengths[req_id]
            if sample:
                lengths[req_id] += 1
            samples.append(sample)
        shape = step_shape(out.num_scheduled_tokens, starts, self._lora, sum(samples))
        return shape, samples


class SimWorker:
    """What the control plane asks an in-process worker outside steps."""

    def health(self) -> dict[str, Any]:
        return {"ok": True, "node_id": None, "num_loading": 0, "kv_transport": "sim"}

    def kv_peer(self) -> None:
        return None  # nothing to connect: transfers are priced, not made

    def add_lora(self, lora: Any) -> bool:
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        return True


@dataclass
class _Load:
    req_id: str
    started: float
    done_at: float
    num_bytes: int
    ok: bool


class SimExecutor:
    """One instance's simulated worker (an ``Executor``)."""

    def __init__(
        self,
        instance_id: str,
        cost: CostModel,
        block_size: int,
        machine: Machine | None = None,
        speedup: float = 1.0,
        stages: int = 1,
    ) -> None:
        """``machine``: the cores this instance shares with others (None: its own device);
        ``speedup``: how much faster its worker steps with a second core to itself (a pool of
        ``num_threads: auto``; ``Machine.speed``), for steps of ``MIN_SHARED_STEP_TOKENS`` or
        more (smaller ones run on one thread). ``stages``: pipeline stages (``pp_size``),
        each a device of its own holding an equal share of the layers: a step passes through
        them in turn, a stage's share of its time on each, and the engine loop keeps one
        step per stage in flight, so a stage works on the next step while the later stages
        work on this one."""
        self.instance_id = instance_id
        self.cost = cost
        self.block_size = block_size
        self.machine = machine
        self.speedup = speedup
        self.worker = SimWorker()
        self._stages = [asyncio.Lock() for _ in range(max(1, stages))]
        self.tracker = ShapeTracker()
        self._loads: list[_Load] = []
        self._link_free_at = 0.0  # when the loads' bytes so far have all come in
        self.busy_s = 0.0  # virtual seconds spent in steps
        self.num_steps = 0

    async def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if len(self._stages) == 1:  # one device: steps in flight (async scheduling) queue
            async with self._stages[0]:
                return await self._execute(out)
        return await self._execute(out)

    async def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        loop = asyncio.get_running_loop()
        meta = out.kv_connector_metadata
        if meta is not None:
            for load in meta.loads:
                self._start_load(load, loop.time())
        shape, samples = self.tracker.observe(out)  # (in the order the steps were started)
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[TOKEN] if sample else [] for sample in samples]
        shared = shape.tokens >= MIN_SHARED_STEP_TOKENS
        speedup = self.speedup if shared else 1.0
        # A worker writes the loads that have landed before it computes (``start_load_kv``,
        # on the first stage) and reports them at the step's end: one that lands during the
        # step waits for the next step's end, as on a real worker.
        applied_at = loop.time()
        seconds = 0.0
        if shape.tokens == 0:
            if self._loads:
                # Nothing to compute while KV comes in: the worker waits for the first
                # load to land (at most IDLE_LOAD_WAIT_S), on no core (kv_transfer/base).
                soonest = min(load.done_at for load in self._loads)
                await asyncio.sleep(min(IDLE_LOAD_WAIT_S, max(0.0, soonest - loop.time())))
            else:
                # Only finished requests to forget (an instance going idle): the worker
                # returns at once, on no core; the step costs the hop there and back.
                await asyncio.sleep(self.cost.step_time(shape))
            applied_at = loop.time()
        elif len(self._stages) == 1:
            seconds = await self._run(self.cost.step_time(shape), speedup)
        else:  # each stage in turn (asyncio's locks are FIFO: steps keep their order)
            share = self.cost.step_time(shape) / len(self._stages)
            for i, stage in enumerate(self._stages):
                async with stage:
                    if i == 0:
                        applied_at = loop.time()
                    seconds += await self._run(share, speedup)
        self.busy_s += seconds
        self.num_steps += 1
        output = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)
        report = KVConnectorReport()
        if meta is not None:
            per_token = self.cost.kv_bytes_per_token()
            for save in meta.saves:
                num_bytes = save.num_tokens * per_token
                handle = SimHandle(self.instance_id, num_bytes)
                report.saved[save.req_id] = [KVSegment(0, 1, handle)]
                report.bytes_saved += num_bytes
        self._finish_loads(output, report, applied_at)
        output.kv_connector_output = report
        return output

    async def _run(self, seconds: float, speedup: float) -> float:
        if self.machine is None:
            await asyncio.sleep(seconds)
            return seconds
        return await self.machine.run(seconds, speedup)

    def _start_load(self, load: Any, now: float) -> None:
        """A KV load into this instance: its bytes share the instance's link with the loads
        before it (one after another, at the link's bandwidth), and its latency overlaps
        them."""
        num_bytes = len(load.block_ids) * self.block_size * self.cost.kv_bytes_per_token()
        latency = self.cost.transfer_time(0)
        begin = max(now, self._link_free_at)
        # Each pipeline stage fetches its own layers over its own link, side by side.
        per_link = num_bytes // len(self._stages)
        self._link_free_at = begin + self.cost.transfer_time(per_link) - latency
        took = self._link_free_at + latency - now
        ok = took <= load.timeout_s
        self._loads.append(_Load(load.req_id, now, now + min(took, load.timeout_s), num_bytes, ok))

    def _finish_loads(
        self, output: ModelRunnerOutput, report: KVConnectorReport, now: float
    ) -> None:
        ended = [load for load in self._loads if load.done_at <= now]
        if not ended:
            return
        self._loads = [load for load in self._loads if load.done_at > now]
        output.finished_recving = {load.req_id for load in ended if load.ok}
        output.failed_recving = {load.req_id for load in ended if not load.ok}
        for load in ended:
            report.loads.append((load.req_id, load.done_at - load.started, load.num_bytes, load.ok))
            if load.ok:
                report.bytes_loaded += load.num_bytes
