"""Several batches in flight: sync pipeline parallelism and async scheduling (reference §3).

The fake worker builds each step's ``ModelRunnerOutput`` right after ``schedule()`` (as a real
one would start executing it) and the driver applies the outputs later, oldest first. Sample
number ``i`` of a request is ``token(req_id, i)``, so every run of the same requests must produce
the same token lists whatever the batching, and tokens out of order would show.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import pytest

from scheduler import ModelRunnerOutput, RequestStatus, Scheduler, SchedulerOutput
from tests.scheduler.helpers import (
    EOS,
    assert_all_free,
    make_request,
    make_scheduler,
    sampling_reqs,
)

TokenFn = Callable[[str, int], int]


def _count_token(req_id: str, i: int) -> int:
    return 1000 + i


class Pipeline:
    """Schedule up to ``depth`` steps ahead; apply outputs in FIFO order."""

    def __init__(self, s: Scheduler, depth: int, token: TokenFn = _count_token) -> None:
        self.s = s
        self.depth = depth
        self.token = token
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
        self.samples: dict[str, int] = {}  # samples the fake worker has produced per request
        self.produced: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.scheduled: dict[str, int] = {}  # tokens scheduled per request, over its life
        self.steps: list[SchedulerOutput] = []
        self.max_in_flight = 0

    def schedule(self, max_running_reqs: int | None = None) -> SchedulerOutput:
        s = self.s
        out = s.schedule(max_running_reqs)
        self.steps.append(out)
        for req_id, n in out.num_scheduled_tokens.items():
            assert s.requests[req_id].status == RequestStatus.RUNNING
            self.scheduled[req_id] = self.scheduled.get(req_id, 0) + n
        if not s.scheduler_config.async_scheduling:
            # Sync: a request is in at most one in-flight batch (placeholders do not exist).
            for req_id, n in out.num_scheduled_tokens.items():
                assert s.requests[req_id].num_in_flight_tokens == n
        sampled = []
        sampling = sampling_reqs(s, out)
        for req_id in out.num_scheduled_tokens:
            if req_id in sampling:
                i = self.samples.get(req_id, 0)
                self.samples[req_id] = i + 1
                sampled.append([self.token(req_id, i)])
            else:
                sampled.append([])
        self.in_flight.append(
            (
                out,
                ModelRunnerOutput(
                    req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled
                ),
            )
        )
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        return out

    def update(self) -> None:
        out, mro = self.in_flight.popleft()
        for o in self.s.update_from_output(out, mro):
            assert o.request_id not in self.finish, f"output after the end: {o}"
            self.produced.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                self.finish[o.request_id] = o.finish_reason.value
        self.s.check_integrity()

    def run(self, max_steps: int = 1000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not self.s.has_unfinished_requests() and not self.in_flight:
                return self.produced
            if len(self.in_flight) < self.depth and self.s.has_unfinished_requests():
                if self.schedule().total_num_scheduled_tokens:
                    continue
                self.in_flight.pop()  # an empty step runs nothing and returns nothing
                assert self.in_flight, "nothing scheduled and nothing in flight: stuck"
            self.update()
        raise AssertionError(f"not finished after {max_steps} steps")


def _eos_at(spec: dict[str, int]) -> TokenFn:
    def token(req_id: str, i: int) -> int:
        return EOS if spec.get(req_id) == i else 1000 + i

    return token


def _workload(s: Scheduler) -> None:
    prompts = [5, 17, 9, 30, 3, 12]
    for k, n in enumerate(prompts):
        s.add_request(make_request(list(range(k * 100, k * 100 + n)), req_id=f"r{k}", max_tokens=6))


# -- sync pipeline parallelism -----------------------------------------------------------------


def test_pp_in_flight_request_is_not_scheduled_again() -> None:
    s = make_scheduler(max_num_batched_tokens=32)
    for k in range(3):
        s.add_request(make_request(list(range(k * 50, k * 50 + 20)), req_id=f"r{k}", max_tokens=4))
    p = Pipeline(s, depth=2)
    first = p.schedule()
    assert first.num_scheduled_tokens == {"r0": 20, "r1": 12}
    second = p.schedule()  # r0 and r1 are in flight: r2 fills the second micro-batch
    assert second.num_scheduled_tokens == {"r2": 20}
    p.update()
    third = p.schedule()
    assert third.num_scheduled_tokens == {"r0": 1, "r1": 8}
    assert p.produced == {"r0": [1000]}
    p.update()
    assert p.produced == {"r0": [1000], "r2": [1000]}
    p.run()
    assert all(len(tokens) == 4 for tokens in p.produced.values())
    assert_all_free(s)


def test_pp_nothing_schedulable_while_everything_is_in_flight() -> None:
    s = make_scheduler()
    s.add_request(make_request(8, req_id="a", max_tokens=3))
    p = Pipeline(s, depth=3)
    assert p.schedule().num_scheduled_tokens == {"a": 8}
    assert p.schedule().total_num_scheduled_tokens == 0
    p.in_flight.pop()
    p.update()
    assert p.schedule().num_scheduled_tokens == {"a": 1}


@pytest.mark.parametrize("pp_size", [2, 3, 4])
@pytest.mark.parametrize("chunked", [True, False])
def test_pp_results_equal_one_batch_at_a_time(pp_size: int, chunked: bool) -> None:
    eos = _eos_at({"r1": 2, "r4": 0})
    budget = 16 if chunked else 128
    results = []
    for depth in (1, pp_size):
        s = make_scheduler(
            max_num_batched_tokens=budget, max_num_seqs=4, enable_chunked_prefill=chunked
        )
        _workload(s)
        p = Pipeline(s, depth, eos)
        results.append((p.run(), p.finish))
        assert p.max_in_flight <= depth and (p.max_in_flight >= 2) == (depth > 1)
        assert_all_free(s)
    assert results[0] == results[1]
    produced, finish = results[0]
    assert produced["r1"] == [1000, 1001, EOS] and finish["r1"] == "stop"
    assert produced["r4"] == [EOS]
    assert produced["r0"] == [1000 + i for i in range(6)] and finish["r0"] == "length"


# -- async scheduling --------------------------------------------------------------------------


def _async(**kw: Any) -> Scheduler:
    return make_scheduler(async_scheduling=True, **kw)


def _assert_only_left(s: Scheduler, req_ids: set[str]) -> None:
    s.check_integrity()
    assert set(s.requests) == req_ids
    assert set(s.kv_cache_manager.req_to_blocks) == req_ids


def test_async_schedules_next_decode_before_output_returns() -> None:
    s = _async()
    r = make_request(8, req_id="a", max_tokens=5)
    s.add_request(r)
    p = Pipeline(s, depth=2)
    first = p.schedule()
    assert first.num_scheduled_tokens == {"a": 8}
    assert r.num_output_placeholders == 1
    second = p.schedule()
    assert second.num_scheduled_tokens == {"a": 1}
    # The input of this decode is the token still on its way: the worker fills it in.
    assert second.scheduled_cached_reqs.new_token_ids == [[]]
    assert second.scheduled_cached_reqs.num_computed_tokens == [8]
    assert r.num_output_placeholders == 2 and r.num_in_flight_tokens == 9
    p.update()
    p.update()
    assert p.produced == {"a": [1000, 1001]}
    assert r.num_output_placeholders == 0 and r.num_in_flight_tokens == 0
    p.run()
    assert p.produced["a"] == [1000 + i for i in range(5)]
    assert_all_free(s)


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize(("prompt", "max_tokens"), [(8, 1), (8, 2), (13, 7), (3, 12)])
def test_async_total_scheduled_tokens(depth: int, prompt: int, max_tokens: int) -> None:
    s = _async()
    s.add_request(make_request(prompt, req_id="a", max_tokens=max_tokens))
    p = Pipeline(s, depth)
    p.run()
    assert p.scheduled["a"] == prompt + max_tokens - 1
    assert p.produced["a"] == [1000 + i for i in range(max_tokens)]
    assert p.finish["a"] == "length"
    assert_all_free(s)


def test_async_eos_with_a_step_in_flight_ignores_the_stale_output() -> None:
    s = _async()
    r = make_request(8, req_id="a", max_tokens=10)
    s.add_request(r)
    p = Pipeline(s, depth=2, token=_eos_at({"a": 1}))
    p.schedule()
    p.update()
    p.schedule()  # decode 1 samples EOS
    p.schedule()  # decode 2 is in flight when EOS arrives
    p.update()
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert p.finish == {"a": "stop"} and p.produced == {"a": [1000, EOS]}
    assert not s.has_unfinished_requests()
    p.update()  # the stale step: its sample (token 1002) must not appear
    assert p.produced == {"a": [1000, EOS]}
    assert_all_free(s)
    assert s.schedule().finished_req_ids == {"a"}


def test_async_abort_with_a_step_in_flight() -> None:
    s = _async()
    s.add_request(make_request(8, req_id="a", max_tokens=10))
    s.add_request(make_request(list(range(50, 58)), req_id="b", max_tokens=3))
    p = Pipeline(s, depth=2)
    p.schedule()
    p.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    _assert_only_left(s, {"b"})
    p.run()
    assert "a" not in p.produced
    assert p.produced["b"] == [1000, 1001, 1002]
    assert_all_free(s)


@pytest.mark.parametrize(
    ("async_scheduling", "depth", "num_blocks"),
    [(False, 2, 10), (False, 3, 10), (True, 2, 12), (True, 3, 10)],
)
def test_preempted_with_a_step_in_flight_waits_for_it(
    async_scheduling: bool, depth: int, num_blocks: int
) -> None:
    s = make_scheduler(
        num_blocks=num_blocks,
        max_model_len=40,
        max_num_batched_tokens=40,
        async_scheduling=async_scheduling,
    )
    s.add_request(make_request(list(range(0, 16)), req_id="a", max_tokens=20))
    p = Pipeline(s, depth)
    p.schedule()
    # b arrives one step later, so under sync PP it sits in the other micro-batch.
    s.add_request(make_request(list(range(100, 116)), req_id="b", max_tokens=20))
    stale_preemptions = resumptions = 0
    while s.has_unfinished_requests() or p.in_flight:
        in_flight_before = {rid: r.num_in_flight_tokens for rid, r in s.requests.items()}
        if len(p.in_flight) < depth and s.has_unfinished_requests():
            out = p.schedule()
            cached = out.scheduled_cached_reqs
            for rid, resumed in zip(cached.req_ids, cached.resumed_from_preemption, strict=True):
                if resumed:  # resumed only once its stale output was processed
                    assert in_flight_before[rid] == 0
                    resumptions += 1
            for rid in out.preempted_req_ids:
                stale_preemptions += in_flight_before[rid] > 0
            if out.total_num_scheduled_tokens:
                continue
            p.in_flight.pop()
        p.update()
        assert s.num_steps < 500
    assert stale_preemptions and resumptions, "the scenario must preempt with a step in flight"
    # The stale step's token is kept and the resumed request continues right after it.
    assert p.produced == {rid: [1000 + i for i in range(20)] for rid in ("a", "b")}
    assert p.finish == {"a": "length", "b": "length"}
    assert_all_free(s)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preempted_request_room_free_still_waits_for_its_stale_output(
    async_scheduling: bool,
) -> None:
    s = make_scheduler(
        num_blocks=10,
        max_model_len=40,
        max_num_batched_tokens=40,
        async_scheduling=async_scheduling,
    )
    s.add_request(make_request(list(range(0, 16)), req_id="a", max_tokens=20))
    p = Pipeline(s, depth=3)
    p.schedule()
    s.add_request(make_request(list(range(100, 116)), req_id="b", max_tokens=20))
    b = s.requests["b"]
    while True:
        if len(p.in_flight) == p.depth:
            p.update()
        out = p.schedule()
        if "b" in out.preempted_req_ids and b.num_in_flight_tokens:
            break
        assert s.num_steps < 100, "the scenario must preempt b with a step in flight"
    # Abort a: b would fit at once, but a step still in flight carries its tokens.
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    while b.num_in_flight_tokens:
        out = p.schedule()
        assert out.total_num_scheduled_tokens == 0
        p.in_flight.pop()
        p.update()
    while p.in_flight:
        p.update()
    out = p.schedule()
    cached = out.scheduled_cached_reqs
    assert cached.req_ids == ["b"] and cached.resumed_from_preemption == [True]
    assert cached.resumed_token_ids["b"] == b.all_token_ids
    p.run()
    assert p.produced["b"] == [1000 + i for i in range(20)]
    assert_all_free(s)


# -- micro-batches: schedule(max_running_reqs) -------------------------------------------------


def _decoding(s: Scheduler, n: int) -> Pipeline:
    """``n`` requests ``d0``.. whose prompts are computed and first token sampled: all running,
    nothing in flight."""
    for k in range(n):
        s.add_request(make_request(list(range(k * 10, k * 10 + 4)), req_id=f"d{k}", max_tokens=6))
    p = Pipeline(s, depth=2)
    p.schedule()
    p.update()
    assert len(s.running) == n and all(r.num_in_flight_tokens == 0 for r in s.running)
    assert all(len(r.output_token_ids) == 1 for r in s.running)
    return p


@pytest.mark.parametrize("n", [2, 5, 8])
def test_cap_splits_running_decodes_into_disjoint_micro_batches(n: int) -> None:
    s = make_scheduler()
    p = _decoding(s, n)
    k = -(-n // 2)
    first = p.schedule(k)
    second = p.schedule(k)  # the first is still in flight
    a, b = set(first.num_scheduled_tokens), set(second.num_scheduled_tokens)
    assert len(a) == k and len(b) == n - k
    assert not a & b and a | b == {f"d{i}" for i in range(n)}
    assert all(v == 1 for v in first.num_scheduled_tokens.values())
    assert all(v == 1 for v in second.num_scheduled_tokens.values())
    assert first.scheduled_cached_reqs.req_ids == [f"d{i}" for i in range(k)]  # in queue order
    assert not first.scheduled_new_reqs and not second.scheduled_new_reqs
    # Both micro-batches are out: a third step has nothing to continue.
    assert p.schedule(k).total_num_scheduled_tokens == 0
    p.in_flight.pop()
    p.update()
    # The first micro-batch is back: it forms the next step again, the second still in flight.
    third = p.schedule(k)
    assert set(third.num_scheduled_tokens) == a
    p.update()
    p.update()
    assert {rid: len(t) for rid, t in p.produced.items()} == {
        f"d{i}": 3 if f"d{i}" in a else 2 for i in range(n)
    }


def test_cap_larger_than_the_idle_requests_takes_what_is_not_in_flight() -> None:
    s = make_scheduler()
    p = _decoding(s, 3)
    assert set(p.schedule(1).num_scheduled_tokens) == {"d0"}
    assert set(p.schedule(5).num_scheduled_tokens) == {"d1", "d2"}


def test_cap_still_admits_waiting_requests() -> None:
    s = make_scheduler()
    p = _decoding(s, 4)
    s.add_request(make_request(list(range(500, 506)), req_id="w0", max_tokens=3))
    s.add_request(make_request(list(range(600, 603)), req_id="w1", max_tokens=3))
    first = p.schedule(2)
    assert first.num_scheduled_tokens == {"d0": 1, "d1": 1, "w0": 6, "w1": 3}
    assert [r.req_id for r in first.scheduled_new_reqs] == ["w0", "w1"]
    assert [r.request_id for r in s.running] == ["d0", "d1", "d2", "d3", "w0", "w1"]
    second = p.schedule(2)
    assert second.num_scheduled_tokens == {"d2": 1, "d3": 1}
    assert not second.scheduled_new_reqs
    p.update()
    p.update()
    assert p.produced["w0"] == [1000] and p.produced["w1"] == [1000]
    assert not s.waiting


def test_no_cap_continues_every_running_request_in_one_step() -> None:
    s = make_scheduler()
    p = _decoding(s, 5)
    first = p.schedule(None)
    assert set(first.num_scheduled_tokens) == {f"d{i}" for i in range(5)}
    assert p.schedule(None).total_num_scheduled_tokens == 0  # all in flight
    p.in_flight.pop()
    p.update()
    assert set(p.schedule().num_scheduled_tokens) == {f"d{i}" for i in range(5)}


@pytest.mark.parametrize("depth", [2, 3])
def test_capped_micro_batches_give_the_tokens_of_one_batch_at_a_time(depth: int) -> None:
    """The engine loop's policy -- cap = ceil(running / depth) for every step -- changes no
    token, and splits requests that are all idle at once (here: admitted in one step) into
    micro-batches within the cap."""
    eos = _eos_at({"r1": 2, "r4": 0})
    results = []
    for pipelined in (False, True):
        s = make_scheduler(max_num_batched_tokens=128, max_num_seqs=8)
        _workload(s)
        p = Pipeline(s, depth if pipelined else 1, eos)
        split_steps = 0
        while s.has_unfinished_requests() or p.in_flight:
            if len(p.in_flight) < p.depth and s.has_unfinished_requests():
                cap = -(-len(s.running) // p.depth) or None
                idle = {r.request_id for r in s.running if not r.num_in_flight_tokens}
                out = p.schedule(cap)
                if cap is not None:
                    assert len(idle & set(out.num_scheduled_tokens)) <= cap
                    split_steps += len(idle) > cap
                if out.total_num_scheduled_tokens:
                    continue
                p.in_flight.pop()
            p.update()
            assert s.num_steps < 500
        assert_all_free(s)
        assert (split_steps > 0) == pipelined, "the scenario must split the running requests"
        assert p.max_in_flight == p.depth
        results.append((p.produced, p.finish))
    assert results[0] == results[1]
    produced, finish = results[0]
    assert produced["r1"] == [1000, 1001, EOS] and finish["r1"] == "stop"
    assert produced["r0"] == [1000 + i for i in range(6)] and finish["r0"] == "length"


def test_prompt_logprobs_of_a_discarded_step_stay_out_of_a_new_request_with_its_id() -> None:
    """A request freed with prompt chunks in flight: those steps' prompt logprobs are dropped
    with their tokens (``discarded_in_flight``), never written into a new request that took
    its id meanwhile."""
    s = make_scheduler(async_scheduling=True, max_num_batched_tokens=8, max_num_seqs=4)
    s.add_request(make_request(20, req_id="a", prompt_logprobs=1))
    p = Pipeline(s, depth=2)
    for chunk in range(2):  # chunks [0, 8) and [8, 16) in flight, each with its 8 entries
        out = p.schedule()
        assert out.num_scheduled_tokens == {"a": 8}
        entries = [({900 + chunk: -1.0}, 1) for _ in range(8)]
        p.in_flight[-1][1].prompt_logprobs = {"a": (8 * chunk + 1, entries)}
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    new = make_request(5, req_id="a", prompt_logprobs=1)
    s.add_request(new)
    p.update()
    p.update()
    assert "a" not in p.produced
    assert new.prompt_logprobs == [None] * 5  # (was 17 entries long, 16 of them stale)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 5}
    own = [({100 + q: -0.5}, 1) for q in range(1, 5)]
    mro = ModelRunnerOutput(["a"], [[7]], prompt_logprobs={"a": (1, own)})
    (o,) = s.update_from_output(out, mro)
    assert o.prompt_logprobs == [None, *own]
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert_all_free(s)
