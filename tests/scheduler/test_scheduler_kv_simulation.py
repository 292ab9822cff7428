"""KV-content simulation: random traces against ``fake_kv_worker.Worker``, which mirrors the
block tables from each ``SchedulerOutput`` and checks the KV identity of every slot a step reads.

A block shared before it is computed, reused while a load or a send still needs it, or hashed
with a failed load's content shows as a wrong read; a lost, repeated or stale token (sample
``i`` is ``1000 + i``, or EOS) as a wrong output. Traces mix FCFS and priority, chunked prefill
on and off, async scheduling, one to three batches in flight, lookahead, watermark, LoRA, cache
salts, remote loads (asynchronous or inside the step, failing, late, "ask again later",
over-reported, bursts that compete for blocks), prefill-side delayed frees, aborts and requests
arriving with outputs. Each must end with every request finished (or aborted), all blocks free.
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import pytest

from scheduler import (
    LoRAConfig,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    SchedulerOutput,
)
from tests.scheduler.fake_kv_worker import (
    BLOCK_SIZE,
    Load,
    ReqSpec,
    Role,
    SimConnector,
    Worker,
)
from tests.scheduler.helpers import EOS, assert_all_free, lora, make_request, make_scheduler

MAX_MODEL_LEN = 48
MAX_STEPS = 3000
NUM_SEEDS = 800
HARD_PATHS: tuple[str, ...] = ("preempted", "released loaded request", "sync load", "async load")
HARD_PATHS += ("failed load", "3 in flight", "aborted while loading", "delayed free")


@dataclass(frozen=True)
class Trace:
    sched: dict[str, Any]
    num_blocks: int
    prefix_caching: bool
    max_loras: int | None
    depth: int  # batches in flight
    with_connector: bool
    requests: list[ReqSpec]


# Prompts start with a piece of one of these, so blocks are shared.
PREFIXES = [[(31 * i + 17 * k) % 97 + 3 for i in range(30)] for k in range(2)]


def make_trace(seed: int) -> Trace:
    rng = random.Random(seed)
    with_connector = rng.random() < 0.5
    # A burst: a few partial remote loads arrive together and compete for a small cache.
    burst = with_connector and rng.random() < 0.3
    chunked = rng.random() < 0.7
    max_num_seqs = rng.randint(1, 6)
    sched: dict[str, Any] = {
        "max_num_seqs": max_num_seqs,
        "max_model_len": MAX_MODEL_LEN,
        "enable_chunked_prefill": chunked,
        "max_num_batched_tokens": (
            rng.randint(max(max_num_seqs, 4), 64) if chunked else rng.randint(MAX_MODEL_LEN, 96)
        ),
        "long_prefill_token_threshold": rng.choice([0, 0, 5]) if chunked else 0,
        "policy": rng.choice(["fcfs", "priority"]),
        "async_scheduling": rng.random() < 0.4,
        "strict_fcfs": rng.random() < 0.3,
        "max_skip_steps": rng.choice([0, 2, 32]),
        "num_lookahead_slots": rng.choice([3, 8] if burst else [0, 0, 1, 3, 8]),
        "watermark": rng.choice([0.0, 0.0, rng.uniform(0.0, 0.3)]),
        "kv_load_failure_policy": rng.choice(["recompute", "fail"]),
        "scheduler_reserve_full_isl": rng.random() < 0.6,
    }
    max_loras = rng.choice([None, None, 1, 2])
    requests = []
    for k in range(rng.randint(2, 4) if burst else rng.randint(1, 10)):
        shared = rng.choice(PREFIXES)[: rng.randint(0, 30)]
        prompt = (shared + [rng.randint(3, 99) for _ in range(rng.randint(0, 12))])[:40] or [5]
        max_tokens = rng.choice([None, rng.randint(1, MAX_MODEL_LEN - len(prompt))])
        num_outputs = rng.choice([0, 0, 0, 1, 3])
        if num_outputs >= (max_tokens or MAX_MODEL_LEN - len(prompt)):
            num_outputs = 0
        arrival = rng.randint(0, 1) if burst else rng.randint(0, 15)
        role: Role = "local"
        if with_connector:
            role = "load" if burst else rng.choice(["local", "load", "load", "send"])
        over = 0 if burst else num_outputs + 4  # the connector may offer more than there is
        requests.append(
            ReqSpec(
                req_id=f"r{k}",
                prompt=prompt,
                outputs=[1000 + i for i in range(num_outputs)],
                arrival=arrival,
                max_tokens=max_tokens,
                eos_at=rng.choice([None, None, rng.randint(num_outputs, num_outputs + 10)]),
                abort_at=rng.choice([None, None, None, arrival + rng.randint(0, 30)]),
                priority=rng.randint(0, 3),
                adapter=rng.randint(1, 3) if max_loras and rng.random() < 0.7 else None,
                salt=rng.choice([None, None, "s"]),
                role=role,
                remote_tokens=rng.randint(1, len(prompt) + over),
                sync_load=not burst and rng.random() < 0.5,
                load_delay=rng.choice([0, 1, 2, 4, 8]),
                load_fails=rng.random() < 0.3,
                ready_at=rng.choice([0, 0, 0, rng.randint(0, 20)]),
            )
        )
    return Trace(
        sched=sched,
        num_blocks=12 if burst else rng.choice([12, 13, 14, rng.randint(12, 30)]),
        prefix_caching=rng.random() < 0.8,
        max_loras=max_loras,
        depth=rng.choice([1, 1, 2, 3]),
        with_connector=with_connector,
        requests=requests,
    )


class Sim:
    """Runs one trace. Each step is executed as soon as it is scheduled (pipeline stages run in
    schedule order) and its output applied once ``depth`` steps are in flight, together with
    the connector reports that are due: loads that land or fail, sends the decode side read."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self.specs = {spec.req_id: spec for spec in trace.requests}
        self.connector = SimConnector(self.specs) if trace.with_connector else None
        self.s = make_scheduler(
            block_size=BLOCK_SIZE,
            num_blocks=trace.num_blocks,
            prefix_caching=trace.prefix_caching,
            connector=self.connector,
            lora=LoRAConfig(max_loras=trace.max_loras) if trace.max_loras else None,
            **trace.sched,
        )
        self.worker = Worker(self.specs)
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.loads: list[tuple[int, str, Load, int]] = []  # due step, id, load, first position
        self.sends: list[tuple[int, str, list[int], int]] = []  # due step, id, blocks, tokens
        self.produced: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.aborted: set[str] = set()
        self.events: Counter[str] = Counter()

    def run(self) -> None:
        last_arrival = max(spec.arrival for spec in self.trace.requests)
        for now in range(MAX_STEPS):
            self._arrivals_and_aborts(now)
            busy = self.s.has_requests() or self.in_flight or self.loads or self.sends
            if now > last_arrival and not busy:
                self._check_end()
                return
            self._step(now)
        raise AssertionError(f"hang: {self.s.requests} holding={self.s.holding}")

    def _arrivals_and_aborts(self, now: int) -> None:
        for spec in self.trace.requests:
            if spec.arrival == now:
                self.s.add_request(self._request(spec))
            request = self.s.requests.get(spec.req_id)
            if spec.abort_at == now and request is not None:
                self.aborted.add(spec.req_id)
                self.events["aborted while loading"] += request.awaiting_remote_kvs
                self.s.finish_requests(spec.req_id, RequestStatus.FINISHED_ABORTED)
                self.s.check_integrity()

    def _request(self, spec: ReqSpec) -> Request:
        params = {"do_remote_prefill": True} if spec.role == "load" else None
        return make_request(
            spec.prompt,
            req_id=spec.req_id,
            max_tokens=spec.max_tokens,
            priority=spec.priority,
            kv_transfer_params=params,
            lora=lora(spec.adapter) if spec.adapter else None,
            cache_salt=spec.salt,
            output_token_ids=list(spec.outputs),
        )

    def _step(self, now: int) -> None:
        s = self.s
        if self.connector is not None:
            self.connector.now = now
        holding = {r.request_id for r in s.holding}
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= s.scheduler_config.max_num_batched_tokens
        self.events["released loaded request"] += sum(r.request_id in holding for r in s.waiting)
        self.events["preempted"] += len(out.preempted_req_ids)
        mro = self.worker.execute(out)
        loads: dict[str, Load] = out.kv_connector_metadata or {}
        for req_id, load in loads.items():
            self.events["sync load" if load.sync else "async load"] += 1
            if not load.sync:
                start = s.requests[req_id].num_computed_tokens - load.num_tokens
                self.loads.append((now + self.specs[req_id].load_delay, req_id, load, start))
        self.in_flight.append((out, mro))
        self.events["3 in flight"] += len(self.in_flight) >= 3
        # A full pipeline, or a step with nothing new to run, waits for the oldest batch.
        while self.in_flight:
            if out.total_num_scheduled_tokens and len(self.in_flight) < self.trace.depth:
                break
            self._apply(*self.in_flight.popleft(), now)

    def _apply(self, out: SchedulerOutput, mro: ModelRunnerOutput, now: int) -> None:
        s = self.s
        mro.finished_recving, failed = set(), set(mro.failed_recving or ())
        for item in [item for item in self.loads if item[0] <= now]:
            self.loads.remove(item)
            _, req_id, load, start = item
            held = s.kv_cache_manager.get_block_ids(req_id)
            assert held[: len(load.block_ids)] == load.block_ids, f"{req_id}: blocks lost in a load"
            self.worker.write_load(self.specs[req_id], s.requests[req_id], load, start)
            (failed if self.specs[req_id].load_fails else mro.finished_recving).add(req_id)
        self.events["failed load"] += len(failed)
        mro.failed_recving = failed or None
        mro.finished_sending = set()
        for send in [send for send in self.sends if send[0] <= now]:
            self.sends.remove(send)
            _, req_id, block_ids, num_tokens = send
            self.worker.check_send(self.specs[req_id], s.requests[req_id], block_ids, num_tokens)
            mro.finished_sending.add(req_id)
            self.events["delayed free"] += 1
        for o in s.update_from_output(out, mro):
            spec = self.specs[o.request_id]
            assert o.request_id not in self.finish_reasons, f"output after the end: {o}"
            produced = self.produced.setdefault(o.request_id, [])
            produced += o.new_token_ids
            first = len(spec.outputs)
            expected = [spec.expected_token(i) for i in range(first, first + len(produced))]
            assert produced == expected, f"{o.request_id}: {produced} != {expected}"
            if o.finish_reason is not None:
                self.finish_reasons[o.request_id] = o.finish_reason.value
                self._check_finish(spec, o.finish_reason.value)
                if o.kv_transfer_params is not None:
                    blocks = o.kv_transfer_params["remote_block_ids"]
                    num_tokens = o.kv_transfer_params["remote_num_tokens"]
                    self.sends.append((now + spec.load_delay, o.request_id, blocks, num_tokens))
        s.check_integrity()

    def _check_finish(self, spec: ReqSpec, reason: str) -> None:
        outputs = spec.outputs + self.produced[spec.req_id]
        if reason == "stop":
            assert outputs[-1] == EOS, f"{spec.req_id} stopped without EOS"
        elif reason == "length":
            limit = spec.max_tokens or MAX_MODEL_LEN - len(spec.prompt)
            assert len(outputs) == min(limit, MAX_MODEL_LEN - len(spec.prompt)), spec.req_id
        else:
            assert reason == "error" and spec.load_fails, f"{spec.req_id} ended with {reason}"
            assert self.trace.sched["kv_load_failure_policy"] == "fail"

    def _check_end(self) -> None:
        for req_id in self.specs:
            assert req_id in self.finish_reasons or req_id in self.aborted, f"{req_id} lost"
        assert_all_free(self.s)


@pytest.mark.parametrize("seed", range(NUM_SEEDS))
def test_random_trace_reads_only_correct_kv(seed: int) -> None:
    Sim(make_trace(seed)).run()


def test_traces_reach_the_hard_paths() -> None:
    """The generator keeps producing the situations the simulation is for. (Whether the traces
    pass is the other test's business: a failing one still counts up to its failure.)"""
    events: Counter[str] = Counter()
    for seed in range(150):
        sim = Sim(make_trace(seed))
        with contextlib.suppress(Exception):
            sim.run()
        events.update(sim.events)
    for event in HARD_PATHS:
        assert events[event] > 0, f"no trace reaches {event!r}: {dict(events)}"


# The smallest traces that showed bugs (found by this simulation after the review fixes).


def _spec(req_id: str, prompt_len: int, **fields: Any) -> ReqSpec:
    defaults: dict[str, Any] = {
        "prompt": list(range(10, 10 + prompt_len)),
        "outputs": [],
        "arrival": 0,
        "max_tokens": 8,
        "eos_at": None,
        "abort_at": None,
        "priority": 0,
        "adapter": None,
        "salt": None,
        "role": "local",
    }
    return ReqSpec(req_id=req_id, **{**defaults, **fields})


def _trace(depth: int, *requests: ReqSpec, **sched: Any) -> Trace:
    return Trace(
        sched={"max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": 64, **sched},
        num_blocks=16,
        prefix_caching=True,
        max_loras=None,
        depth=depth,
        with_connector=True,
        requests=list(requests),
    )


def test_sync_load_confirmed_while_two_later_steps_are_in_flight() -> None:
    """Async scheduling, three steps in flight: confirming the load must hash only known
    tokens, not positions the steps still in flight compute (it raised IndexError)."""
    a = _spec("a", 6, role="load", sync_load=True, remote_tokens=4)
    Sim(_trace(3, a, _spec("twin", 6, arrival=6), async_scheduling=True)).run()


def test_failed_sync_load_of_a_request_preempted_in_flight() -> None:
    """Two batches in flight: the step after the load's preempts the request for a better
    priority one; the load's failure, reported afterwards, must still drop the sample that
    was computed from the bad KV (it was delivered)."""
    a = _spec("a", 12, role="load", sync_load=True, remote_tokens=8, load_fails=True, priority=1)
    b = _spec("b", 6, arrival=1, priority=0)
    Sim(_trace(2, a, b, policy="priority", max_num_seqs=1)).run()
