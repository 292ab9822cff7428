"""Regression tests for the review findings r1-r10 (fixed in "scheduler: fixes from review").

Each test states the fixed behaviour and fails on the scheduler before that commit. The test
plays the worker through ``helpers.step`` (connector reports included) unless it needs several
steps in flight, where it calls ``schedule`` / ``update_from_output`` itself. (Bugs found later
by the KV simulation are reproduced in ``test_scheduler_kv_simulation.py``.)
"""

from __future__ import annotations

from typing import Any

import pytest

from scheduler import (
    CacheConfig,
    LoRAConfig,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from tests.scheduler.helpers import (
    EOS,
    InMemoryConnector,
    assert_all_free,
    drain,
    lora,
    make_request,
    make_scheduler,
    model_output,
    run_to_completion,
    step,
)

REMOTE = {"do_remote_prefill": True}


def _add(s: Scheduler, *requests: Request) -> None:
    for request in requests:
        s.add_request(request)


def _decode_side(**sched: Any) -> Scheduler:
    return make_scheduler(connector=InMemoryConnector(), **sched)


def _free(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.num_free_blocks


def _run_with_loads(s: Scheduler, max_steps: int = 200) -> None:
    """Step until nothing holds blocks, reporting every started load done at once."""
    for _ in range(max_steps):
        if not s.has_requests():
            return
        loading = {r.request_id for r in s.holding if r.awaiting_remote_kvs}
        step(s, finished_recving=loading or None)
    raise AssertionError(f"not finished after {max_steps} steps: {list(s.requests)}")


class _LoadConnector(InMemoryConnector):
    """Loads ``remote_num_tokens`` of a ``do_remote_prefill`` request, asynchronously or inside
    the step (``sync``); ``offloaded`` requests reload their prompt on every admission (a CPU
    offload store). ``do_remote_prefill=False`` (a failed or consumed load) means no load."""

    def __init__(self, sync: bool = False) -> None:
        super().__init__()
        self.sync = sync
        self.not_ready: set[str] = set()  # answered None: "ask again next step"

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if request.request_id in self.not_ready:
            return None, False
        params = request.kv_transfer_params or {}
        if params.get("offloaded") and params.get("do_remote_prefill") is not False:
            count = max(request.num_prompt_tokens - num_computed_tokens, 0)
            return count, count > 0
        if not params.get("do_remote_prefill"):
            return 0, False
        count = max(int(params["remote_num_tokens"]) - num_computed_tokens, 0)
        return count, count > 0 and not self.sync


def test_r1_loaded_request_is_promoted_past_the_watermark() -> None:
    s = _decode_side(num_blocks=16, max_model_len=64, watermark=0.25)
    r = make_request(56, req_id="d", max_tokens=4, kv_transfer_params=dict(REMOTE))
    s.add_request(r)
    step(s)  # the load starts: 14 of 16 blocks held
    assert r.awaiting_remote_kvs and _free(s) == 2
    step(s, finished_recving={"d"})
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"d": 1}
    assert r.status == RequestStatus.RUNNING
    assert _free(s) < s.kv_cache_manager.watermark_blocks  # promotion went below the watermark
    assert len(run_to_completion(s)["d"]) == 3
    assert_all_free(s)


def test_a_request_wanting_prompt_logprobs_loads_no_external_kv() -> None:
    """It computes every prompt token (its prompt's logprobs come from them): no external
    tokens, as it reads no prefix cache -- loaded positions would go out with None."""
    s = _decode_side()
    r = make_request(20, req_id="p", kv_transfer_params=dict(REMOTE), prompt_logprobs=1)
    s.add_request(r)
    out, _ = step(s)
    assert not r.awaiting_remote_kvs and out.num_scheduled_tokens == {"p": 20}
    run_to_completion(s)
    assert_all_free(s)


def test_a_remote_load_allocates_no_lookahead_blocks() -> None:
    """A load holds its blocks while it lands and computes nothing meanwhile: no lookahead
    slots (vLLM allocates none for it), which would count against the room of others."""
    s = _decode_side(num_lookahead_slots=8)
    r = make_request(16, req_id="d", kv_transfer_params=dict(REMOTE))
    s.add_request(r)
    step(s)
    assert r.awaiting_remote_kvs
    assert len(s.kv_cache_manager.req_to_blocks["d"]) == 4  # 16 tokens in blocks of 4
    step(s, finished_recving={"d"})
    run_to_completion(s)
    assert_all_free(s)


def test_r5_partial_loads_with_lookahead_make_progress() -> None:
    s = _decode_side(num_blocks=12, max_model_len=48, num_lookahead_slots=4)
    params = {**REMOTE, "remote_num_tokens": 16}
    a = make_request(list(range(100, 140)), req_id="A", kv_transfer_params=params)
    b = make_request(list(range(200, 232)), req_id="B", kv_transfer_params=params)
    _add(s, a, b)
    step(s)
    step(s, finished_recving={r.request_id for r in (a, b) if r.awaiting_remote_kvs})
    # (Loads take no lookahead, as in vLLM: both fit and load, and the one that cannot then
    # continue goes back to waiting -- a step later than when only one loaded.)
    ran = [step(s)[0].num_scheduled_tokens for _ in range(2)]
    assert any(ran), "loaded requests hold blocks and nothing runs"
    _run_with_loads(s)
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert_all_free(s)


def test_r5_deadlocked_loaded_request_goes_back_to_waiting() -> None:
    # A load takes its tokens' blocks (3 each: no lookahead, as in vLLM); promotion needs
    # the lookahead past the whole prompt (3 more blocks each), and 2 are left.
    s = _decode_side(num_blocks=8, max_model_len=32, num_lookahead_slots=8)
    params = {**REMOTE, "remote_num_tokens": 12}
    a = make_request(list(range(100, 116)), req_id="A", max_tokens=4, kv_transfer_params=params)
    b = make_request(list(range(200, 216)), req_id="B", max_tokens=4, kv_transfer_params=params)
    _add(s, a, b)
    step(s)
    assert a.awaiting_remote_kvs and b.awaiting_remote_kvs and _free(s) == 2
    s.make_stats()
    step(s, finished_recving={"A", "B"})
    out, _ = step(s)  # both loaded, neither can continue, nothing runs: B (newest) goes back
    assert not out.num_scheduled_tokens
    assert b.status == RequestStatus.WAITING and list(s.waiting) == [b]
    assert s.holding == [a] and b.num_computed_tokens == 0
    assert not s.kv_cache_manager.get_block_ids("B")
    assert s.make_stats().num_preemptions == 1 and b.num_preemptions == 1
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["A"]
    _run_with_loads(s)
    assert a.num_output_tokens == b.num_output_tokens == 4
    assert_all_free(s)


def test_r5_release_keeps_preempted_status_of_a_request_preempted_before_its_load() -> None:
    # X runs, is preempted by P (better priority), and reloads its prompt. P finished but
    # keeps its blocks for the decode side: X, loaded, cannot get the block for its outputs.
    s = make_scheduler(
        connector=_LoadConnector(),
        num_blocks=6,
        max_model_len=24,
        num_lookahead_slots=4,
        max_num_seqs=1,
        policy="priority",
        prefix_caching=False,
    )
    x = make_request(4, req_id="X", max_tokens=10, priority=1, kv_transfer_params={"offloaded": 1})
    p = make_request(12, req_id="P", max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    s.add_request(x)
    for _ in range(5):
        step(s, finished_recving={"X"} if x.awaiting_remote_kvs else None)
    s.add_request(p)
    out, _ = step(s)
    assert out.preempted_req_ids == {"X"} and p.status == RequestStatus.FINISHED_LENGTH_CAPPED
    step(s)  # X reloads its prompt (one block: a load takes no lookahead), one block left
    assert x.awaiting_remote_kvs and _free(s) == 1
    s.make_stats()
    step(s, finished_recving={"X"})
    out, _ = step(s)
    assert not out.num_scheduled_tokens
    assert x.status == RequestStatus.PREEMPTED and list(s.waiting) == [x] and not s.holding
    assert s.make_stats().num_preemptions == 1 and x.num_preemptions == 2
    step(s, finished_sending={"P"})
    _run_with_loads(s)
    assert x.num_output_tokens == 10
    assert_all_free(s)


def _sync_load_scheduler(**sched: Any) -> Scheduler:
    return make_scheduler(connector=_LoadConnector(sync=True), **sched)


def _sync_load_request(req_id: str, **kw: Any) -> Request:
    params = {**REMOTE, "remote_num_tokens": 8}
    return make_request(12, req_id=req_id, kv_transfer_params=params, **kw)


def test_r6_failed_sync_load_recomputes_and_drops_its_sample() -> None:
    s = _sync_load_scheduler()
    a = _sync_load_request("a")
    twin = make_request(12, req_id="twin")  # same prompt, no load, admitted in the same step
    _add(s, a, twin)
    out, outputs = step(s, {"a": [99]}, failed_recving={"a"})
    assert out.num_scheduled_tokens == {"a": 4, "twin": 12}
    assert twin.num_cached_tokens == 0  # a's loaded blocks were not findable
    assert [o.request_id for o in outputs] == ["twin"]  # a's sample came from bad KV
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    assert a.output_token_ids == [] and a.num_preemptions == 1
    out, _ = step(s)
    assert out.num_scheduled_tokens["a"] == 12 - 8  # recomputed: hits twin's blocks only
    produced = run_to_completion(s)
    assert a.output_token_ids == [7] * 8 and len(produced["a"]) == 7
    assert_all_free(s)


def test_r6_failed_sync_load_with_fail_policy_ends_in_error() -> None:
    s = _sync_load_scheduler(kv_load_failure_policy="fail")
    a = _sync_load_request("a")
    s.add_request(a)
    _, outputs = step(s, {"a": [99]}, failed_recving={"a"})
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", [])]
    assert outputs[0].finish_reason is not None and outputs[0].finish_reason.value == "error"
    assert a.status == RequestStatus.FINISHED_ERROR
    later = make_request(12, req_id="later")
    s.add_request(later)
    step(s)
    assert later.num_cached_tokens == 0  # the failed load's blocks were never hashed
    drain(s)


def test_r6_sync_loaded_blocks_are_hashed_once_the_step_returns() -> None:
    s = _sync_load_scheduler()
    a = _sync_load_request("a")
    same_step = make_request(12, req_id="same_step")
    _add(s, a, same_step)
    out = s.schedule()
    assert same_step.num_cached_tokens == 0
    s.update_from_output(out, model_output(s, out))  # no failure reported: the load is good
    later = make_request(12, req_id="later")
    s.add_request(later)
    step(s)
    assert later.num_cached_tokens == 8
    drain(s)


def test_r10_over_reported_remote_tokens_are_clipped() -> None:
    s = _decode_side()
    r = make_request(
        10, req_id="d", max_tokens=4, kv_transfer_params={**REMOTE, "remote_num_tokens": 16}
    )
    s.add_request(r)
    out, _ = step(s)
    assert out.kv_connector_metadata.loads == {"d": (s.kv_cache_manager.get_block_ids("d"), 10)}
    assert r.num_computed_tokens == 10 and len(s.kv_cache_manager.get_block_ids("d")) == 3
    step(s, finished_recving={"d"})
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"d": 1}  # the last prompt token, for its logits
    assert len(run_to_completion(s)["d"]) == 3
    assert_all_free(s)


def test_r2_async_load_candidate_preempts_only_once_loaded() -> None:
    s = _decode_side(policy="priority", max_num_seqs=2)
    a = make_request(8, req_id="A", priority=5, max_tokens=50)
    b = make_request(8, req_id="B", priority=5, max_tokens=50)
    _add(s, a, b)
    step(s)
    c = make_request(8, req_id="C", priority=0, kv_transfer_params=dict(REMOTE))
    d = make_request(8, req_id="D", priority=9)
    _add(s, c, d)
    out, _ = step(s)
    assert not out.preempted_req_ids
    assert s.running == [a, b] and c.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert d.status == RequestStatus.WAITING
    step(s, finished_recving={"C"})
    out, _ = step(s)
    assert out.preempted_req_ids == {"B"} and out.num_scheduled_tokens["C"] == 1
    assert s.running == [a, c] and d.status == RequestStatus.WAITING
    run_to_completion(s)
    assert c.num_output_tokens == d.num_output_tokens == 8 and b.num_output_tokens == 50
    assert_all_free(s)


@pytest.mark.parametrize("strict_fcfs", [True, False])
def test_r3_connector_none_never_blocks_the_queue(strict_fcfs: bool) -> None:
    c = _LoadConnector()
    c.not_ready.add("x")
    s = make_scheduler(
        connector=c,
        enable_chunked_prefill=False,
        max_num_batched_tokens=128,
        strict_fcfs=strict_fcfs,
        max_skip_steps=2,
    )
    _add(s, make_request(8, req_id="x", max_tokens=2), make_request(8, req_id="y", max_tokens=2))
    scheduled = [sorted(step(s)[0].num_scheduled_tokens) for _ in range(5)]
    assert scheduled == [["y"]] * 2 + [[]] * 3
    s.add_request(make_request(8, req_id="z", max_tokens=2))  # after x would have aged
    assert sorted(step(s)[0].num_scheduled_tokens) == ["z"]
    assert s.requests["x"].num_skipped_steps == 0
    c.not_ready.clear()
    assert len(run_to_completion(s)["x"]) == 2
    assert_all_free(s)


def test_r4_outputs_of_an_id_freed_twice_in_flight_go_to_the_right_request() -> None:
    s = make_scheduler()  # steps kept in flight by hand (pipeline parallelism)
    steps: list[tuple[SchedulerOutput, ModelRunnerOutput]] = []
    requests: list[Request] = []
    for n, token in ((8, 11), (2, 22), (5, 33)):
        if requests:
            s.finish_requests("x", RequestStatus.FINISHED_ABORTED)
        requests.append(make_request(n, req_id="x", max_tokens=5))
        s.add_request(requests[-1])
        out = s.schedule()
        steps.append((out, model_output(s, out, {"x": [token]})))
    delivered = [
        [(o.request_id, o.new_token_ids) for o in s.update_from_output(*st)] for st in steps
    ]
    assert delivered == [[], [], [("x", [33])]]
    assert [r.num_in_flight_tokens for r in requests] == [0, 0, 0]
    assert requests[2].output_token_ids == [33] and not requests[0].output_token_ids
    s.check_integrity()
    run_to_completion(s)
    assert requests[2].output_token_ids == [33, 7, 7, 7, 7]
    assert_all_free(s)


def test_r7_no_preemption_when_the_plan_hits_blocks_the_victim_is_filling() -> None:
    s = make_scheduler(
        policy="priority",
        max_num_seqs=2,
        enable_chunked_prefill=False,
        max_num_batched_tokens=48,
        max_model_len=48,
    )
    v = make_request(7, req_id="V", priority=5, max_tokens=20, arrival_time=0)
    s.add_request(v)
    step(s)  # V: prompt computed, one sample: 8 tokens, its 2nd block is filled next step
    w = make_request(list(range(500, 540)), req_id="W", priority=0, arrival_time=1)
    c = make_request(v.all_token_ids + list(range(600, 608)), req_id="C", arrival_time=2)
    _add(s, w, c)
    out, _ = step(s)
    assert not out.preempted_req_ids
    assert out.num_scheduled_tokens == {"V": 1, "W": 40}
    assert v.status == RequestStatus.RUNNING and c.status == RequestStatus.WAITING
    run_to_completion(s)
    assert v.num_output_tokens == 20 and c.num_output_tokens == 8
    assert_all_free(s)


def test_r8_request_whose_adapter_never_gets_a_slot_ages_and_blocks() -> None:
    s = make_scheduler(lora=LoRAConfig(max_loras=1), max_num_seqs=4, max_skip_steps=4)
    s.add_request(make_request(8, req_id="a0", lora=lora(1), max_tokens=4))
    step(s)
    late = make_request(8, req_id="late", lora=lora(2), max_tokens=4)
    s.add_request(late)
    skips = []
    for i in range(40):
        if i % 2 == 0:  # a stream that keeps adapter 1 running
            s.add_request(make_request(8, req_id=f"a{i + 1}", lora=lora(1), max_tokens=4))
        aged = late.num_skipped_steps == 4 and late.status == RequestStatus.WAITING
        out, _ = step(s)
        if aged and late.status == RequestStatus.WAITING:
            assert not out.scheduled_new_reqs  # it blocks the queue until admitted
        skips.append(late.num_skipped_steps)
        if late.is_finished:
            break
    assert max(skips) == 4 and late.num_output_tokens == 4
    drain(s)


def test_r8b_a_loaded_request_whose_adapter_never_gets_a_slot_ages_and_blocks() -> None:
    """The same for a request whose remote KV has loaded: it ages while the adapter slot
    stays taken, then blocks the waiting queue until the slot frees (it was retried each
    step with no bound, holding its blocks, while the other adapter's requests kept
    coming)."""
    s = make_scheduler(
        lora=LoRAConfig(max_loras=1), max_skip_steps=2, connector=InMemoryConnector()
    )
    s.add_request(make_request(8, req_id="a", lora=lora(1), max_tokens=4))
    step(s)
    loaded = make_request(8, req_id="r", lora=lora(2), max_tokens=3, kv_transfer_params=REMOTE)
    s.add_request(loaded)
    step(s)
    assert loaded.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(s, finished_recving={"r"})
    for i in range(30):  # a stream that keeps adapter 1's slot taken
        s.add_request(make_request(8, req_id=f"x{i}", lora=lora(1), max_tokens=4))
        blocking = loaded.num_skipped_steps == 2 and loaded.status != RequestStatus.RUNNING
        out, _ = step(s)
        if blocking and loaded.status != RequestStatus.RUNNING:
            assert not out.scheduled_new_reqs  # it blocks the queue until admitted
        if loaded.status == RequestStatus.RUNNING:
            break
    assert loaded.status == RequestStatus.RUNNING and i < 10
    drain(s)


def test_r9_has_requests_while_blocks_wait_for_a_send_or_a_load() -> None:
    s = _decode_side()
    s.add_request(
        make_request(10, req_id="p", max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    )
    s.add_request(make_request(10, req_id="d", kv_transfer_params=dict(REMOTE)))
    step(s)  # p finishes and keeps its blocks for the decode side; d's load starts
    s.finish_requests("d", RequestStatus.FINISHED_ABORTED)  # the load still writes its blocks
    assert not s.has_unfinished_requests() and s.has_requests()
    step(s, finished_sending={"p"})
    assert not s.has_unfinished_requests() and s.has_requests()
    step(s, finished_recving={"d"})
    assert not s.has_requests()
    assert_all_free(s)


def test_r10_an_idle_scheduler_steps_once_more_for_its_workers_but_holds_nothing() -> None:
    """A finished request's end reaches the workers with the next step (vLLM's
    ``has_finished_requests``): the loop must take it (``has_requests``), or idle workers keep
    the request's state until the next arrival. But nothing is held (``holds_requests``): a
    drain waits on that, or a failed instance -- never stepped again -- held its pool's
    resize for its whole drain timeout."""
    s = make_scheduler()
    s.add_request(make_request(6, req_id="a", max_tokens=1))
    step(s)
    assert not s.has_unfinished_requests() and not s.holds_requests() and s.has_requests()
    out, _ = step(s)
    assert out.finished_req_ids == {"a"} and out.total_num_scheduled_tokens == 0
    assert not s.has_requests()
    assert_all_free(s)


@pytest.mark.parametrize(("last", "sampling"), [(EOS, {}), (42, {"stop_token_ids": (42,)})])
def test_add_request_rejects_outputs_ending_in_a_stop_token(
    last: int, sampling: dict[str, Any]
) -> None:
    s = make_scheduler()
    r = make_request(6, output_token_ids=[1000, last], **sampling)
    with pytest.raises(ValueError, match="stop token"):
        s.add_request(r)
    assert not s.requests and not s.waiting
    ignored = make_request(6, output_token_ids=[1000, EOS], ignore_eos=True)
    s.add_request(ignored)  # EOS is an ordinary token when ignored
    assert s.requests == {ignored.request_id: ignored}


def test_update_from_output_rejects_a_missing_scheduled_request() -> None:
    s = make_scheduler()
    _add(s, make_request(6, req_id="a"), make_request(6, req_id="b"))
    out = s.schedule()
    with pytest.raises(ValueError, match="'b'"):
        s.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]]))


@pytest.mark.parametrize(
    ("config", "field", "value"),
    [
        (SchedulerConfig(), "watermark", 0.5),
        (CacheConfig(num_blocks=8), "num_blocks", 16),
        (LoRAConfig(), "max_loras", 4),
    ],
)
def test_configs_are_frozen(config: Any, field: str, value: object) -> None:
    before = getattr(config, field)
    with pytest.raises(ValueError, match="frozen"):
        setattr(config, field, value)
    assert getattr(config, field) == before


@pytest.mark.parametrize("strict_fcfs", [False, True])
def test_a_loaded_request_too_big_for_the_budget_left_is_not_starved(strict_fcfs: bool) -> None:
    """Chunked prefill off: a request whose remote load covered part of its prompt must
    compute the rest in one step, and the decodes leave too little of the budget. It stops
    the waiting queue (vLLM's break; after ``max_skip_steps`` unless ``strict_fcfs``), so the
    decodes drain and it runs. It waited for ever, holding its blocks, while new arrivals kept
    the decodes going."""
    from tests.scheduler.helpers import fresh_prompt

    connector = InMemoryConnector()
    s = make_scheduler(
        connector=connector,
        enable_chunked_prefill=False,
        max_model_len=32,
        max_num_batched_tokens=32,
        max_num_seqs=16,
        num_blocks=200,
        max_skip_steps=4,
        strict_fcfs=strict_fcfs,
    )
    for k in range(8):
        s.add_request(make_request(fresh_prompt(4), req_id=f"bg{k}", max_tokens=20))
    step(s)
    params = {**REMOTE, "remote_num_tokens": 4}  # 26 of its 30 tokens still to compute
    h = make_request(fresh_prompt(30), req_id="H", max_tokens=2, kv_transfer_params=params)
    s.add_request(h)
    for t in range(200):
        loaded = {"H"} if h.status == RequestStatus.WAITING_FOR_REMOTE_KVS else None
        if t % 2 == 0:  # a steady trickle of short requests keeps decodes running
            s.add_request(make_request(fresh_prompt(4), req_id=f"x{t}", max_tokens=20))
        out, _ = step(s, finished_recving=loaded)
        if "H" in out.num_scheduled_tokens:
            assert out.num_scheduled_tokens["H"] == 26  # whole, as chunked prefill is off
            break
    else:
        pytest.fail(f"H never ran: {h.status}, {len(s.running)} running")
    drain(s)


def test_a_loaded_request_blocks_only_the_waiting_requests_that_rank_after_it() -> None:
    """Under ``priority`` a loaded request that cannot run yet (chunked prefill off, too
    little budget) holds back the waiting requests that rank after it, not better-priority
    ones: they go first, as in vLLM's one ordered queue."""
    from tests.scheduler.helpers import fresh_prompt

    s = make_scheduler(
        connector=InMemoryConnector(),
        policy="priority",
        enable_chunked_prefill=False,
        strict_fcfs=True,  # (it blocks at once)
        max_model_len=32,
        max_num_batched_tokens=32,
        max_num_seqs=16,
        num_blocks=200,
    )
    for k in range(8):
        s.add_request(make_request(fresh_prompt(4), req_id=f"bg{k}", max_tokens=20, priority=5))
    step(s)
    params = {**REMOTE, "remote_num_tokens": 4}
    h = make_request(
        fresh_prompt(30), req_id="H", max_tokens=2, kv_transfer_params=params, priority=5
    )
    s.add_request(h)
    step(s)  # its load starts
    step(s, finished_recving={"H"})  # its load ended (reported with this step's output)
    better = make_request(fresh_prompt(4), req_id="better", max_tokens=2, priority=0)
    worse = make_request(fresh_prompt(4), req_id="worse", max_tokens=2, priority=9)
    _add(s, better, worse)
    out, _ = step(s)  # loaded: 26 to compute, 24 of the budget left by the decodes
    assert "H" not in out.num_scheduled_tokens and not h.awaiting_remote_kvs
    assert "better" in out.num_scheduled_tokens  # ranks before it
    assert "worse" not in out.num_scheduled_tokens  # waits for it
    drain(s)


def test_priority_preemption_with_chunked_prefill_off_counts_the_victims_budget() -> None:
    """At ``max_num_seqs`` with chunked prefill off, a better-priority prompt that fits the
    step's budget only with the victim's tokens given back preempts the victim (DESIGN
    §4.4); it waited for the victims to finish (the budget check came before the make-room
    one), and a replan with the victim's budget was cut to the budget left (a partial
    prefill, with chunked prefill off)."""
    from tests.scheduler.helpers import add

    s = make_scheduler(
        policy="priority",
        enable_chunked_prefill=False,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        max_model_len=32,
    )
    add(s, "v1", 4, priority=5, max_tokens=20)
    v2 = add(s, "v2", 4, priority=5, max_tokens=20)
    step(s)
    step(s)  # both decode: 1 token each of the 32
    c = add(s, "c", 31, priority=0, max_tokens=1)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"v1": 1, "c": 31}  # the whole prompt, at once
    assert out.preempted_req_ids == {"v2"} and v2.status == RequestStatus.PREEMPTED
    assert c.is_finished
    run_to_completion(s)
    assert v2.num_output_tokens == 20
    assert_all_free(s)


def test_a_sync_load_completed_while_preempted_is_not_read_again() -> None:
    """Two batches in flight: a request loads its prompt inside step 1, and step 2 preempts
    it for a better-priority one before step 1 returns. The load succeeded (its sample is
    delivered), so the source's copy is consumed, as when it completes for a running
    request: the resumed request recomputes. It kept do_remote_prefill and read the source
    again (a prefill instance has freed those blocks after the first read)."""
    c = _LoadConnector(sync=True)
    s = make_scheduler(connector=c, policy="priority", max_num_seqs=1)
    remote = {"do_remote_prefill": True, "remote_num_tokens": 8}
    a = make_request(
        list(range(300, 312)), req_id="a", priority=1, max_tokens=4, kv_transfer_params=remote
    )
    s.add_request(a)
    out1 = s.schedule()
    assert out1.num_scheduled_tokens == {"a": 4}  # 8 loaded in the step, 4 computed
    mro1 = model_output(s, out1)  # (the worker starts it now: a samples)
    s.add_request(make_request(list(range(400, 406)), req_id="b", priority=0, max_tokens=4))
    out2 = s.schedule()
    assert out2.preempted_req_ids == {"a"} and a.status == RequestStatus.PREEMPTED
    mro2 = model_output(s, out2)
    s.update_from_output(out1, mro1)  # the load is good; a's sample is delivered
    s.update_from_output(out2, mro2)
    s.check_integrity()
    assert a.num_output_tokens == 1
    assert a.kv_transfer_params is not None and not a.kv_transfer_params["do_remote_prefill"]
    run_to_completion(s)
    assert [call[2] for call in c.alloc_calls if call[0] == "a"] == [8, 0]
    assert a.num_output_tokens == 4
    assert_all_free(s)
