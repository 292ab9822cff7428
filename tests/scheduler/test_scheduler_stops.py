"""Scenario tests for ``Scheduler.update_from_output()`` (stop checks in vLLM v1's order,
trimming, logprobs), ``finish_requests()`` (aborts) and ``make_stats()``."""

from __future__ import annotations

import pytest

from scheduler import (
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
)
from tests.scheduler.helpers import (
    EOS,
    add,
    assert_all_free,
    drain,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)


def _mro(
    out: SchedulerOutput,
    tokens: dict[str, list[int]],
    logprobs: dict[str, list[dict[int, float]]] | None = None,
) -> ModelRunnerOutput:
    """Every scheduled request samples ``tokens[req_id]`` (``[]`` if absent)."""
    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=[list(tokens.get(r, [])) for r in req_ids],
        logprobs=None if logprobs is None else [logprobs.get(r) for r in req_ids],
    )


def _step_with(
    s: Scheduler,
    tokens: dict[str, list[int]],
    logprobs: dict[str, list[dict[int, float]]] | None = None,
) -> dict[str, EngineCoreOutput]:
    out = s.schedule()
    outputs = s.update_from_output(out, _mro(out, tokens, logprobs))
    s.check_integrity()
    return {o.request_id: o for o in outputs}


def _lp(token: int) -> dict[int, float]:
    return {token: -0.5, token + 1: -1.5}


# -- stop checks -----------------------------------------------------------------------------
def test_eos_stops_with_finish_reason_stop() -> None:
    s = make_scheduler()
    a = add(s, "a", max_tokens=10)
    assert _step_with(s, {"a": [11]})["a"].finish_reason is None
    o = _step_with(s, {"a": [EOS]})["a"]
    assert (o.new_token_ids, o.finish_reason, o.stop_reason) == ([EOS], FinishReason.STOP, None)
    assert o.finish_reason == "stop"
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert a.output_token_ids == [11, EOS]
    assert_all_free(s)


def test_eos_is_ignored_with_ignore_eos() -> None:
    s = make_scheduler()
    a = add(s, "a", max_tokens=3, ignore_eos=True)
    for _ in range(2):
        assert not _step_with(s, {"a": [EOS]})["a"].finished
    o = _step_with(s, {"a": [EOS]})["a"]
    assert o.finish_reason == FinishReason.LENGTH
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert a.output_token_ids == [EOS, EOS, EOS]
    assert_all_free(s)


def test_stop_token_id_stops_with_the_token_as_stop_reason() -> None:
    s = make_scheduler()
    a = add(s, "a", max_tokens=10, stop_token_ids=(42, 43))
    _step_with(s, {"a": [11]})
    o = _step_with(s, {"a": [43]})["a"]
    assert (o.new_token_ids, o.finish_reason, o.stop_reason) == ([43], FinishReason.STOP, 43)
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert a.stop_reason == 43
    assert_all_free(s)


def test_max_tokens_stops_with_finish_reason_length() -> None:
    s = make_scheduler()
    a = add(s, "a", max_tokens=3)
    reasons = [_step_with(s, {"a": [11 + i]})["a"].finish_reason for i in range(3)]
    assert reasons == [None, None, FinishReason.LENGTH]
    assert reasons[-1] == "length"
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert a.stop_reason is None
    assert not s.has_unfinished_requests()
    assert_all_free(s)


def test_max_model_len_stops_with_finish_reason_length() -> None:
    s = make_scheduler(max_model_len=8, max_num_batched_tokens=16, num_blocks=8)
    a = add(s, "a", 5, max_tokens=100)
    reasons = [_step_with(s, {"a": [11]})["a"].finish_reason for _ in range(3)]
    assert reasons == [None, None, FinishReason.LENGTH]
    assert a.num_tokens == 8
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_free(s)


@pytest.mark.parametrize("token", [EOS, 42])
def test_eos_and_stop_ids_stop_even_below_min_tokens(token: int) -> None:
    # min_tokens is the sampler's job (it masks EOS and stop ids); a sampled one is honoured.
    s = make_scheduler()
    a = add(s, "a", max_tokens=10, min_tokens=5, stop_token_ids=(42,))
    o = _step_with(s, {"a": [token]})["a"]
    assert o.finish_reason == FinishReason.STOP
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert a.num_output_tokens == 1
    assert_all_free(s)


def test_eos_is_checked_before_stop_token_ids() -> None:
    s = make_scheduler()
    add(s, "a", max_tokens=10, stop_token_ids=(EOS,))
    o = _step_with(s, {"a": [EOS]})["a"]
    assert (o.finish_reason, o.stop_reason) == (FinishReason.STOP, None)
    assert_all_free(s)


@pytest.mark.parametrize(("token", "stop_reason"), [(EOS, None), (42, 42)])
def test_stop_on_the_last_allowed_token_is_stop_not_length(token: int, stop_reason: int) -> None:
    s = make_scheduler()
    a = add(s, "a", max_tokens=2, stop_token_ids=(42,))
    _step_with(s, {"a": [11]})
    o = _step_with(s, {"a": [token]})["a"]
    assert (o.finish_reason, o.stop_reason) == (FinishReason.STOP, stop_reason)
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert_all_free(s)


def test_tokens_after_a_stop_in_the_middle_of_a_step_are_trimmed() -> None:
    s = make_scheduler()
    a = add(s, "a", max_tokens=10)
    b = add(s, "b", max_tokens=10)
    _step_with(s, {"a": [11], "b": [21]})
    outs = _step_with(
        s,
        {"a": [12, 13, EOS, 14, 15], "b": [22, 23]},
        logprobs={"a": [_lp(t) for t in (12, 13, EOS, 14, 15)], "b": [_lp(22), _lp(23)]},
    )
    assert outs["a"].new_token_ids == [12, 13, EOS]
    assert outs["a"].new_logprobs == [_lp(12), _lp(13), _lp(EOS)]
    assert outs["a"].finish_reason == FinishReason.STOP
    assert a.output_token_ids == [11, 12, 13, EOS]
    assert a.all_token_ids[-5:] == [a.prompt_token_ids[-1], 11, 12, 13, EOS]
    # b is untouched by a's stop: all its tokens and logprobs pass through.
    assert outs["b"].new_token_ids == [22, 23]
    assert outs["b"].new_logprobs == [_lp(22), _lp(23)]
    assert not outs["b"].finished
    assert b.output_token_ids == [21, 22, 23]
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert_all_free(s)


def test_tokens_past_max_tokens_in_one_step_are_trimmed() -> None:
    s = make_scheduler()
    a = add(s, "a", max_tokens=3)
    sampled = [11, 12, 13, 14, 15]
    o = _step_with(s, {"a": sampled}, logprobs={"a": [_lp(t) for t in sampled]})["a"]
    assert o.new_token_ids == [11, 12, 13]
    assert o.new_logprobs == [_lp(11), _lp(12), _lp(13)]
    assert o.finish_reason == FinishReason.LENGTH
    assert a.output_token_ids == [11, 12, 13]
    assert_all_free(s)


def test_logprobs_pass_through_per_request() -> None:
    s = make_scheduler()
    add(s, "a", max_tokens=4)
    add(s, "b", max_tokens=4)
    outs = _step_with(s, {"a": [11], "b": [21]}, logprobs={"a": [_lp(11)]})  # b: None
    assert outs["a"].new_logprobs == [_lp(11)]
    assert outs["b"].new_logprobs is None
    outs = _step_with(s, {"a": [12], "b": [22]})  # no logprobs at all
    assert outs["a"].new_logprobs is None and outs["b"].new_logprobs is None
    s.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert_all_free(s)


def test_finished_request_output_carries_tokens_and_reason_once() -> None:
    s = make_scheduler()
    add(s, "a", max_tokens=2)
    produced = run_to_completion(s)
    assert produced == {"a": [7, 7]}
    out = s.schedule()
    assert out.finished_req_ids == {"a"}
    assert s.update_from_output(out, ModelRunnerOutput.empty()) == []
    assert_all_free(s)


# -- finish_requests -------------------------------------------------------------------------
def test_abort_waiting_and_running_requests_frees_them() -> None:
    s = make_scheduler(max_num_seqs=1, max_num_batched_tokens=16)
    a = add(s, "a", 8, max_tokens=10)
    b = add(s, "b", 8, max_tokens=10)
    step(s)
    assert (a.status, b.status) == (RequestStatus.RUNNING, RequestStatus.WAITING)
    assert s.kv_cache_manager.usage > 0

    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert not s.waiting and "b" not in s.requests
    s.check_integrity()
    out, _ = step(s)
    assert out.finished_req_ids == {"b"}

    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert a.get_finished_reason() == FinishReason.ABORT
    assert not s.running
    assert s.kv_cache_manager.usage == 0.0  # blocks freed at once
    out = s.schedule()
    assert (out.finished_req_ids, out.num_scheduled_tokens) == ({"a"}, {})
    s.update_from_output(out, ModelRunnerOutput.empty())
    assert s.schedule().finished_req_ids == set()  # shipped once
    assert_all_free(s)


def test_abort_unknown_and_already_finished_ids_is_ignored() -> None:
    s = make_scheduler()
    a = add(s, "a", max_tokens=1)
    b = add(s, "b", max_tokens=5)
    step(s)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    s.finish_requests(["nope", "a"], RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED  # not rewritten to ABORTED
    assert b.status == RequestStatus.RUNNING
    assert s.schedule().finished_req_ids == {"a"}
    s.finish_requests(["b", "b"], RequestStatus.FINISHED_ABORTED)  # twice in one call
    assert b.get_finished_reason() == FinishReason.ABORT
    s.check_integrity()
    s.finish_requests("b", RequestStatus.FINISHED_STOPPED)  # again, later: ignored
    assert b.get_finished_reason() == FinishReason.ABORT
    assert_all_free(s)


def test_finish_requests_none_aborts_everything() -> None:
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=16)
    reqs = [add(s, f"r{i}", 6, max_tokens=10) for i in range(4)]
    step(s)
    assert len(s.running) == 2 and len(s.waiting) == 2
    s.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in reqs)
    assert_all_free(s)
    assert s.schedule().finished_req_ids == {"r0", "r1", "r2", "r3"}


@pytest.mark.parametrize(
    "status", [RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED]
)
def test_finish_requests_with_a_non_finished_status_raises(status: RequestStatus) -> None:
    s = make_scheduler()
    a = add(s, "a", max_tokens=4)
    step(s)
    with pytest.raises(ValueError, match=status.name):
        s.finish_requests("a", status)
    assert a.status == RequestStatus.RUNNING
    assert s.running == [a]
    s.check_integrity()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert_all_free(s)


def test_output_of_a_request_aborted_while_its_step_was_in_flight_is_ignored() -> None:
    s = make_scheduler()
    a = add(s, "a", max_tokens=4)
    b = add(s, "b", max_tokens=4)
    out = s.schedule()
    assert set(out.num_scheduled_tokens) == {"a", "b"}
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.get_block_ids("a") == []
    outputs = s.update_from_output(out, _mro(out, {"a": [11], "b": [21]}))
    s.check_integrity()
    assert [o.request_id for o in outputs] == ["b"]
    assert a.output_token_ids == []
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert b.output_token_ids == [21]
    out, _ = step(s)
    assert out.finished_req_ids == {"a"}
    assert set(out.num_scheduled_tokens) == {"b"}
    drain(s)


def test_stale_output_is_not_delivered_to_a_new_request_that_reuses_the_id() -> None:
    # "a" is aborted while its step is in flight and a new request with the same id arrives
    # before that step's output: the output belongs to the old request and must be dropped.
    s = make_scheduler()
    add(s, "a", max_tokens=4)
    out = s.schedule()
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    try:
        new_a = add(s, "a", max_tokens=4)
    except ValueError:  # rejecting the reuse while a step names the old one is fine too
        new_a = None
    outputs = s.update_from_output(out, _mro(out, {"a": [11]}))
    s.check_integrity()
    assert outputs == []
    if new_a is not None:
        assert new_a.output_token_ids == []
        assert new_a.num_in_flight_tokens == 0
        assert run_to_completion(s, max_steps=20) == {"a": [7, 7, 7, 7]}
    assert_all_free(s)


def test_abort_during_a_chunked_prefill_frees_the_partial_blocks() -> None:
    s = make_scheduler(max_num_batched_tokens=8, max_num_seqs=4)
    a = add(s, "a", 30, max_tokens=4)
    step(s)
    step(s)
    assert a.num_computed_tokens == 16 and a.num_output_tokens == 0
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert_all_free(s)


# -- make_stats ------------------------------------------------------------------------------
def test_make_stats_gauges_and_prefix_cache_counters_reset_on_read() -> None:
    s = make_scheduler(block_size=4, num_blocks=64, max_num_seqs=1)
    prompt = list(range(500, 520))
    s.add_request(make_request(prompt, req_id="a", max_tokens=2))
    s.add_request(make_request(list(prompt), req_id="b", max_tokens=2))
    stats = s.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_steps) == (0, 2, 0)
    assert stats.kv_cache_usage == 0.0
    assert (stats.prefix_cache_requests, stats.prefix_cache_queries) == (0, 0)

    step(s)  # a admitted (no hit); b waits for a slot
    stats = s.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_steps) == (1, 1, 1)
    assert stats.kv_cache_usage == pytest.approx(5 / 64)
    assert (stats.prefix_cache_requests, stats.prefix_cache_queries) == (1, 20)
    assert stats.prefix_cache_hits == 0
    again = s.make_stats()
    assert (again.prefix_cache_requests, again.prefix_cache_queries) == (0, 0)
    assert again.num_running_reqs == 1 and again.num_steps == 1  # gauges are not reset

    step(s)  # a reaches max_tokens
    step(s)  # b admitted: 16 of 20 tokens hit a's cached blocks
    stats = s.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_steps) == (1, 0, 3)
    assert (stats.prefix_cache_requests, stats.prefix_cache_queries) == (1, 20)
    assert stats.prefix_cache_hits == 16
    assert stats.num_preemptions == 0
    run_to_completion(s)
    stats = s.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)
    assert stats.prefix_cache_hits == 0
    assert_all_free(s)


def _preempt_b() -> tuple[Scheduler, Request, Request]:
    """8 blocks of 4: two 12-token prompts fill 6; at 16 tokens each they hold all 8, and the
    next decode of a needs a 5th block -> b (the last admitted) is preempted."""
    s = make_scheduler(block_size=4, num_blocks=8, max_model_len=32, max_num_batched_tokens=32)
    a = add(s, "a", 12, max_tokens=10)
    b = add(s, "b", 12, max_tokens=10)
    for _ in range(5):
        out, _ = step(s)
        assert out.preempted_req_ids == set()
    out, _ = step(s)
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    return s, a, b


def test_abort_a_preempted_request() -> None:
    s, a, b = _preempt_b()
    assert list(s.waiting) == [b]
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert not s.waiting
    s.check_integrity()
    out, _ = step(s)
    assert out.finished_req_ids == {"b"}
    assert set(out.num_scheduled_tokens) == {"a"}
    run_to_completion(s)
    assert a.num_output_tokens == 10
    assert_all_free(s)


def test_make_stats_counts_preemptions_and_resets_them() -> None:
    s, _, b = _preempt_b()
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1
    stats = s.make_stats()
    assert stats.num_preemptions == 1
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(5 / 8)
    assert s.make_stats().num_preemptions == 0
    drain(s)
