"""Property tests: random traces keep the scheduler's invariants (DESIGN §3.1, reference §1, §3).

A trace is a set of requests (arrival step, prompt drawn from a few shared prefixes, output
length or EOS, priority, optional abort step) run under a random configuration: FCFS or
priority, chunked prefill on or off, prefix caching on or off, async scheduling, and one or two
batches in flight. After every ``schedule()`` the step fits the budgets and only running requests
are scheduled; after every call the queues and block tables agree (``check_integrity``). At the
end every request has finished and every block is free. The fake worker's sample ``i`` of a
request is ``1000 + i`` (or EOS), so lost, repeated or reordered tokens show.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler import (
    EngineCoreOutput,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
)
from tests.scheduler.helpers import (
    EOS,
    InMemoryConnector,
    assert_all_free,
    make_request,
    make_scheduler,
    sampling_reqs,
)

MAX_MODEL_LEN = 48
BLOCK_SIZE = 4
MAX_STEPS = 2000
PREFIXES = [list(range(1000 * k + 100, 1000 * k + 100 + 24)) for k in range(3)]
SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass
class Req:
    arrival: int
    prompt: list[int]
    max_tokens: int | None
    eos_at: int | None
    priority: int
    abort_at: int | None
    params: dict[str, Any] | None = None
    load_delay: int = 0  # remote load: steps until the worker reports it
    load_fails: bool = False


@dataclass
class Trace:
    sched: dict[str, Any]
    num_blocks: int
    prefix_caching: bool
    depth: int
    reqs: list[Req]
    send_delay: int = 0  # prefill side: steps until the decode side has read the blocks


@st.composite
def _prompt(draw: st.DrawFn) -> list[int]:
    prefix = draw(st.sampled_from(PREFIXES))
    shared = draw(st.integers(0, len(prefix)))
    suffix = draw(st.lists(st.integers(3, 99), max_size=MAX_MODEL_LEN - 1 - shared))
    prompt = prefix[:shared] + suffix
    return prompt or [5]


@st.composite
def _req(draw: st.DrawFn, horizon: int) -> Req:
    prompt = draw(_prompt())
    room = MAX_MODEL_LEN - len(prompt)
    return Req(
        arrival=draw(st.integers(0, horizon)),
        prompt=prompt,
        max_tokens=draw(st.none() | st.integers(1, min(room, 24))),
        eos_at=draw(st.none() | st.integers(0, 12)),
        priority=draw(st.integers(0, 3)),
        abort_at=draw(st.none() | st.integers(0, horizon + 40)),
    )


@st.composite
def _config(draw: st.DrawFn) -> dict[str, Any]:
    chunked = draw(st.booleans())
    max_num_seqs = draw(st.integers(1, 8))
    if chunked:
        budget = draw(st.integers(max(max_num_seqs, 4), 64))
        threshold = draw(st.sampled_from([0, 0, 4, 9]))
    else:
        budget, threshold = draw(st.integers(MAX_MODEL_LEN, 96)), 0
    return {
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": budget,
        "max_model_len": MAX_MODEL_LEN,
        "enable_chunked_prefill": chunked,
        "long_prefill_token_threshold": threshold,
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "async_scheduling": draw(st.booleans()),
        "strict_fcfs": draw(st.booleans()),
        "max_skip_steps": draw(st.sampled_from([0, 2, 32])),
    }


@st.composite
def traces(draw: st.DrawFn, connector: bool = False) -> Trace:
    horizon = draw(st.integers(0, 30))
    reqs = draw(st.lists(_req(horizon), min_size=1, max_size=10))
    sched = draw(_config())
    if connector:
        sched["kv_load_failure_policy"] = draw(st.sampled_from(["recompute", "fail"]))
        for r in reqs:
            role = draw(st.sampled_from(["local", "remote_prefill", "remote_decode"]))
            if role == "remote_prefill":
                remote = draw(st.integers(1, len(r.prompt)))
                r.params = {"do_remote_prefill": True, "remote_num_tokens": remote}
                r.load_delay = draw(st.integers(0, 6))
                r.load_fails = draw(st.booleans())
            elif role == "remote_decode":
                r.params = {"do_remote_decode": True}
    return Trace(
        sched=sched,
        num_blocks=draw(st.integers(MAX_MODEL_LEN // BLOCK_SIZE, 40)),
        prefix_caching=draw(st.booleans()),
        depth=draw(st.sampled_from([1, 2])),
        reqs=reqs,
        send_delay=draw(st.integers(0, 5)),
    )


@dataclass
class Runner:
    """Plays the engine loop (with up to ``depth`` batches in flight) and the worker."""

    trace: Trace
    connector: InMemoryConnector | None = None
    s: Scheduler = field(init=False)
    reqs: dict[str, Req] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    samples: dict[str, int] = field(default_factory=dict)
    produced: dict[str, list[int]] = field(default_factory=dict)
    sent: set[str] = field(default_factory=set)  # requests the worker has seen in full
    finished: dict[str, str] = field(default_factory=dict)  # req_id -> finish reason
    # Connector reports due: step -> set of request ids, per kind.
    due: dict[str, dict[int, set[str]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        t = self.trace
        self.s = make_scheduler(
            block_size=BLOCK_SIZE,
            num_blocks=t.num_blocks,
            prefix_caching=t.prefix_caching,
            connector=self.connector,
            **t.sched,
        )
        self.due = {"finished_recving": {}, "failed_recving": {}, "finished_sending": {}}

    def _report_later(self, kind: str, at: int, req_id: str) -> None:
        self.due[kind].setdefault(at, set()).add(req_id)

    def _reports(self, now: int) -> dict[str, set[str] | None]:
        fields: dict[str, set[str] | None] = {}
        for kind, by_step in self.due.items():
            ids: set[str] = set()
            for at in [at for at in by_step if at <= now]:
                ids |= by_step.pop(at)
            fields[kind] = ids or None
        return fields

    def _add_arrivals(self, now: int) -> None:
        for k, r in enumerate(self.trace.reqs):
            if r.arrival == now:
                request = make_request(
                    r.prompt,
                    req_id=f"r{k}",
                    max_tokens=r.max_tokens,
                    priority=r.priority,
                    kv_transfer_params=dict(r.params) if r.params else None,
                )
                self.reqs[request.request_id] = r
                self.requests.append(request)
                self.s.add_request(request)
            if r.abort_at == now and f"r{k}" in self.s.requests:
                self.s.finish_requests(f"r{k}", RequestStatus.FINISHED_ABORTED)
                self.s.check_integrity()

    def _schedule(self, now: int) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        s, cfg = self.s, self.s.scheduler_config
        out = s.schedule()
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert len(s.running) <= cfg.max_num_seqs
        for req_id, n in out.num_scheduled_tokens.items():
            request = s.requests[req_id]
            assert n > 0 and request.status == RequestStatus.RUNNING
            assert request.num_computed_tokens <= cfg.max_model_len - 1
            if not cfg.async_scheduling:
                assert request.num_in_flight_tokens == n  # in one in-flight batch at most
        for new in out.scheduled_new_reqs:
            # Sent in full once: a request with outputs must come back as "resumed", since
            # NewRequestData carries only the prompt.
            assert new.req_id not in self.sent, f"{new.req_id} sent as new twice"
            self.sent.add(new.req_id)
        cached = out.scheduled_cached_reqs
        for req_id, resumed in zip(cached.req_ids, cached.resumed_from_preemption, strict=True):
            assert req_id in self.sent
            if resumed:
                assert cached.resumed_token_ids[req_id] == s.requests[req_id].all_token_ids
        s.check_integrity()
        if out.kv_connector_metadata is not None:
            for req_id in out.kv_connector_metadata.loads:
                r = self.reqs[req_id]
                kind = "failed_recving" if r.load_fails else "finished_recving"
                self._report_later(kind, now + r.load_delay, req_id)
        sampling = sampling_reqs(s, out)
        sampled: list[list[int]] = []
        for req_id in out.num_scheduled_tokens:
            if req_id not in sampling:
                sampled.append([])
                continue
            i = self.samples.get(req_id, 0)
            self.samples[req_id] = i + 1
            sampled.append([EOS if self.reqs[req_id].eos_at == i else 1000 + i])
        return out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled)

    def _update(self, out: SchedulerOutput, mro: ModelRunnerOutput, now: int) -> None:
        for kind, ids in self._reports(now).items():
            setattr(mro, kind, ids)
        for o in self.s.update_from_output(out, mro):
            self._check_output(o, now)
        self.s.check_integrity()

    def _check_output(self, o: EngineCoreOutput, now: int) -> None:
        assert o.request_id not in self.finished, f"output after the end: {o}"
        tokens = self.produced.setdefault(o.request_id, [])
        tokens += o.new_token_ids
        r = self.reqs[o.request_id]
        expected = [EOS if r.eos_at == i else 1000 + i for i in range(len(tokens))]
        assert tokens == expected, f"{o.request_id}: tokens lost, repeated or reordered"
        assert EOS not in tokens[:-1]
        if o.finish_reason is None:
            return
        self.finished[o.request_id] = o.finish_reason.value
        if o.finish_reason.value == "length":
            limit = r.max_tokens or MAX_MODEL_LEN - len(r.prompt)
            assert len(tokens) == min(limit, MAX_MODEL_LEN - len(r.prompt))
        elif o.finish_reason.value == "stop":
            assert tokens[-1] == EOS
        if o.kv_transfer_params is not None:  # prefill side: the decode side reads, then reports
            self._report_later("finished_sending", now + self.trace.send_delay, o.request_id)

    def run(self) -> None:
        s = self.s
        last_event = max(max(r.arrival, r.abort_at or 0) for r in self.trace.reqs)
        in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        for now in range(MAX_STEPS):
            self._add_arrivals(now)
            busy = s.has_unfinished_requests() or s.requests or any(self.due.values())
            if now > last_event and not busy and not in_flight:
                break
            out, mro = self._schedule(now)
            if out.total_num_scheduled_tokens:
                in_flight.append((out, mro))
                if len(in_flight) < self.trace.depth:
                    continue
                out, mro = in_flight.popleft()
            elif in_flight:  # an empty step is not queued: wait for the oldest batch instead
                out, mro = in_flight.popleft()
            self._update(out, mro, now)
        else:
            raise AssertionError(f"not finished after {MAX_STEPS} steps: {list(s.requests)}")
        assert len(self.requests) == len(self.trace.reqs)
        assert all(request.is_finished for request in self.requests)
        assert_all_free(s)


@SETTINGS
@given(traces())
def test_random_traces_keep_invariants(trace: Trace) -> None:
    runner = Runner(trace)
    runner.run()
    for req_id, r in runner.reqs.items():
        if r.abort_at is None:
            assert req_id in runner.finished, f"{req_id} never finished"


@settings(SETTINGS, max_examples=120)
@given(traces(connector=True))
def test_random_connector_traces_keep_invariants(trace: Trace) -> None:
    runner = Runner(trace, connector=InMemoryConnector())
    runner.run()
    fail = trace.sched["kv_load_failure_policy"] == "fail"
    for req_id, r in runner.reqs.items():
        if r.abort_at is None:
            assert req_id in runner.finished, f"{req_id} never finished"
        if runner.finished.get(req_id) == "error":
            assert fail and r.load_fails
