"""Scenario tests for ``Scheduler.schedule()``: the token budget shared by running then waiting
requests, ``max_num_seqs``, chunked prefill, ``long_prefill_token_threshold``, ``max_model_len``
clipping, prefix caching through the scheduler, and what ``SchedulerOutput`` carries.

Prompts are built from distinct token ranges (``fresh_prompt``) so that prefix caching only hits
where a test asks for it.
"""

from __future__ import annotations

import random
from typing import Any

from scheduler import (
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
)
from tests.scheduler.helpers import (
    add,
    assert_all_free,
    drain,
    fresh_prompt,
    make_scheduler,
    model_output,
    step,
)


def _with_a(n: int, max_tokens: int, **sched: Any) -> tuple[Scheduler, list[int]]:
    """A scheduler holding request "a" on a fresh ``n``-token prompt; returns the prompt too."""
    s = make_scheduler(**sched)
    prompt = fresh_prompt(n)
    add(s, "a", prompt, max_tokens=max_tokens)
    return s, prompt


def _assert_step_limits(s: Scheduler, num_scheduled: dict[str, int], total: int) -> None:
    cfg = s.scheduler_config
    assert total == sum(num_scheduled.values())
    assert total <= cfg.max_num_batched_tokens
    assert all(n > 0 for n in num_scheduled.values())
    assert len(s.running) <= cfg.max_num_seqs
    for request in s.running:
        assert request.num_computed_tokens <= cfg.max_model_len - 1


# -- the token budget ------------------------------------------------------------------------
def test_running_decodes_are_scheduled_first_and_waiting_prefills_get_the_rest() -> None:
    s = make_scheduler(max_num_batched_tokens=16, max_num_seqs=8)
    add(s, "a", 4, max_tokens=20)
    add(s, "b", 4, max_tokens=20)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 4, "b": 4}

    add(s, "c", 20, max_tokens=4)
    out, outputs = step(s)
    # Two decodes (1 token each) come first; the prefill of c takes the remaining 14.
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 14}
    assert list(out.num_scheduled_tokens) == ["a", "b", "c"]
    assert out.total_num_scheduled_tokens == 16
    assert [r.req_id for r in out.scheduled_new_reqs] == ["c"]
    assert out.scheduled_cached_reqs.req_ids == ["a", "b"]
    assert {o.request_id for o in outputs} == {"a", "b"}  # c's partial prefill samples nothing

    add(s, "d", 10, max_tokens=4)
    out, _ = step(s)
    # Running first: a, b decode; c finishes its prompt (6); d gets what is left (8 of 10).
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 6, "d": 8}
    assert out.total_num_scheduled_tokens == 16
    drain(s)


def test_waiting_request_gets_nothing_when_running_requests_use_the_whole_budget() -> None:
    s = make_scheduler(max_num_batched_tokens=8, max_num_seqs=8)
    add(s, "a", 30, max_tokens=2)
    add(s, "b", 5, max_tokens=2)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 8}
    assert [r.request_id for r in s.waiting] == ["b"]
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 8}  # the running prefill keeps the budget
    assert out.scheduled_new_reqs == []
    drain(s)


def test_total_scheduled_tokens_never_exceed_the_budget_on_a_mixed_workload() -> None:
    rng = random.Random(1234)
    s = make_scheduler(max_num_batched_tokens=24, max_num_seqs=5, num_blocks=64, max_model_len=64)
    for i in range(20):
        add(s, f"r{i}", rng.randint(1, 40), max_tokens=rng.randint(1, 12))
    produced: dict[str, int] = {}
    for _ in range(500):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        _assert_step_limits(s, out.num_scheduled_tokens, out.total_num_scheduled_tokens)
        assert out.num_scheduled_tokens, "a step with unfinished requests scheduled nothing"
        for o in s.update_from_output(out, model_output(s, out)):
            produced[o.request_id] = produced.get(o.request_id, 0) + len(o.new_token_ids)
        s.check_integrity()
    assert len(produced) == 20
    assert_all_free(s)


# -- max_num_seqs ----------------------------------------------------------------------------
def test_max_num_seqs_caps_running_and_the_rest_get_in_as_others_finish() -> None:
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=2)
    add(s, "a", 4, max_tokens=1)
    add(s, "b", 4, max_tokens=3)
    add(s, "c", 4, max_tokens=3)
    add(s, "d", 4, max_tokens=3)
    out, outputs = step(s)
    assert set(out.num_scheduled_tokens) == {"a", "b"}  # budget left, but no slot for c, d
    assert [r.request_id for r in s.waiting] == ["c", "d"]
    assert {o.request_id for o in outputs if o.finished} == {"a"}
    assert [r.request_id for r in s.running] == ["b"]

    out, _ = step(s)  # a's slot goes to c
    assert out.num_scheduled_tokens == {"b": 1, "c": 4}
    assert [r.request_id for r in s.waiting] == ["d"]
    assert len(s.running) == 2

    out, outputs = step(s)  # b reaches max_tokens; d still has no slot this step
    assert out.num_scheduled_tokens == {"b": 1, "c": 1}
    assert {o.request_id for o in outputs if o.finished} == {"b"}

    out, _ = step(s)
    assert out.num_scheduled_tokens == {"c": 1, "d": 4}
    drain(s)


# -- chunked prefill -------------------------------------------------------------------------
def test_chunked_prefill_splits_a_long_prompt_and_partial_steps_emit_nothing() -> None:
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=64)
    a = add(s, "a", 40, max_tokens=2)
    chunks = []
    for expected_computed in (16, 32):
        out = s.schedule()
        mro = model_output(s, out)
        assert mro.sampled_token_ids == [[]]  # a partial prefill samples nothing
        assert s.update_from_output(out, mro) == []
        s.check_integrity()
        chunks.append(out.num_scheduled_tokens["a"])
        assert a.num_computed_tokens == expected_computed
        assert a.num_output_tokens == 0
    out, outputs = step(s)
    chunks.append(out.num_scheduled_tokens["a"])
    assert chunks == [16, 16, 8]
    assert [o.new_token_ids for o in outputs] == [[7]]
    drain(s)


def test_chunked_prefill_on_fills_the_budget_with_a_chunk_of_the_next_prompt() -> None:
    s = make_scheduler(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=True)
    add(s, "a", 20, max_tokens=2)
    add(s, "b", 20, max_tokens=2)
    add(s, "c", 5, max_tokens=2)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 20, "b": 12}
    assert [r.request_id for r in s.waiting] == ["c"]
    drain(s)


def test_chunked_prefill_off_never_splits_and_smaller_requests_behind_run() -> None:
    s = make_scheduler(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False)
    add(s, "a", 20, max_tokens=2)
    b = add(s, "b", 20, max_tokens=2)
    add(s, "c", 5, max_tokens=2)
    out, _ = step(s)
    # b (20) does not fit the 12 left and is not chunked; Tandem skips it so c runs.
    assert out.num_scheduled_tokens == {"a": 20, "c": 5}
    assert b.status == RequestStatus.WAITING
    assert b.num_computed_tokens == 0
    assert b.request_id not in s.kv_cache_manager.req_to_blocks

    out, _ = step(s)  # a and c decode (1 + 1); b (20) fits the 30 left, in one piece
    assert out.num_scheduled_tokens == {"a": 1, "c": 1, "b": 20}
    drain(s)


def test_chunked_prefill_off_with_strict_fcfs_waits_instead_of_skipping() -> None:
    s = make_scheduler(
        max_num_batched_tokens=32,
        max_model_len=32,
        enable_chunked_prefill=False,
        strict_fcfs=True,
    )
    add(s, "a", 20, max_tokens=2)
    add(s, "b", 20, max_tokens=2)
    add(s, "c", 5, max_tokens=2)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 20}
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 20, "c": 5}
    drain(s)


# -- long_prefill_token_threshold ------------------------------------------------------------
def test_long_prefill_threshold_caps_chunks_when_several_requests_are_present() -> None:
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    add(s, "a", 20, max_tokens=2)
    add(s, "b", 20, max_tokens=2)
    steps = [step(s)[0].num_scheduled_tokens for _ in range(3)]
    assert steps == [{"a": 8, "b": 8}, {"a": 8, "b": 8}, {"a": 4, "b": 4}]
    drain(s)


def test_long_prefill_threshold_does_not_cap_a_lone_request() -> None:
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    add(s, "a", 20, max_tokens=3)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 20}
    # A second arrival makes two present: its prefill is capped, a's decode is not affected.
    add(s, "b", 20, max_tokens=2)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 8}
    drain(s)


def test_long_prefill_threshold_counts_waiting_requests_as_present() -> None:
    # a runs alone until b arrives; b cannot be admitted (max_num_seqs=1) but is present.
    s = make_scheduler(max_num_batched_tokens=64, max_num_seqs=1, long_prefill_token_threshold=8)
    add(s, "a", 40, max_tokens=2)
    add(s, "b", 4, max_tokens=2)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 8}
    drain(s)


# -- max_model_len ---------------------------------------------------------------------------
def test_request_stops_length_capped_at_max_model_len() -> None:
    s = make_scheduler(max_model_len=16, max_num_batched_tokens=16)
    a = add(s, "a", 10, max_tokens=1000)  # max_tokens alone would never stop it
    tokens: list[int] = []
    last = None
    for _ in range(20):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        _assert_step_limits(s, out.num_scheduled_tokens, out.total_num_scheduled_tokens)
        for o in s.update_from_output(out, model_output(s, out)):
            tokens += o.new_token_ids
            last = o
        s.check_integrity()
    assert len(tokens) == 6
    assert a.num_tokens == 16
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert last is not None and last.finish_reason == FinishReason.LENGTH
    assert_all_free(s)


def test_prompt_of_max_model_len_minus_one_gets_exactly_one_token() -> None:
    s = make_scheduler(max_model_len=16, max_num_batched_tokens=16)
    a = add(s, "a", 15, max_tokens=None)
    assert a.max_tokens == 1  # unset max_tokens becomes max_model_len - prompt
    out, outputs = step(s)
    assert out.num_scheduled_tokens == {"a": 15}
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([7], FinishReason.LENGTH)]
    assert_all_free(s)


def test_scheduled_tokens_never_take_num_computed_past_max_model_len_minus_one() -> None:
    # With async scheduling a request is scheduled ahead of its outputs; the clip keeps
    # num_computed_tokens <= max_model_len - 1 however many steps run ahead.
    s = make_scheduler(max_model_len=16, max_num_batched_tokens=16, async_scheduling=True)
    a = add(s, "a", 10, max_tokens=1000)
    in_flight = []
    for _ in range(8):
        out = s.schedule()
        in_flight.append(out)
        assert a.num_computed_tokens <= 15
    assert [o.num_scheduled_tokens.get("a", 0) for o in in_flight] == [10, 1, 1, 1, 1, 1, 0, 0]
    assert a.num_computed_tokens == 15
    finish = []
    for out in in_flight:
        sampled = [[7]] if "a" in out.num_scheduled_tokens else []
        mro = ModelRunnerOutput(req_ids=list(out.num_scheduled_tokens), sampled_token_ids=sampled)
        finish += [o.finish_reason for o in s.update_from_output(out, mro)]
        s.check_integrity()
    assert finish == [None] * 5 + [FinishReason.LENGTH]
    assert a.num_tokens == 16
    assert_all_free(s)


# -- DESIGN §4: a batch fills its budget -----------------------------------------------------
def test_sixteen_prompts_of_1024_tokens_are_all_scheduled_in_the_first_step() -> None:
    s = make_scheduler(
        block_size=16,
        num_blocks=2048,
        max_num_batched_tokens=16384,
        max_num_seqs=32,
        max_model_len=4096,
    )
    for i in range(16):
        add(s, f"r{i}", 1024, max_tokens=4)
    out, outputs = step(s)
    assert out.num_scheduled_tokens == {f"r{i}": 1024 for i in range(16)}
    assert out.total_num_scheduled_tokens == 16384
    assert len(out.scheduled_new_reqs) == 16
    assert all(len(r.block_ids) == 64 for r in out.scheduled_new_reqs)
    assert len(outputs) == 16
    assert not s.waiting
    drain(s)


# -- prefix caching through the scheduler ----------------------------------------------------
def test_prefix_hit_for_a_request_admitted_in_a_later_step() -> None:
    s, prompt = _with_a(22, 3, block_size=4)
    out, _ = step(s)
    a_blocks = out.scheduled_new_reqs[0].block_ids
    assert len(a_blocks) == 6

    add(s, "b", list(prompt), max_tokens=3)  # same prompt: 5 full blocks cached
    add(s, "c", prompt[:9] + fresh_prompt(5), max_tokens=3)  # shares 2 full blocks
    out, outputs = step(s)
    new = {r.req_id: r for r in out.scheduled_new_reqs}
    assert new["b"].num_computed_tokens == 20
    assert new["b"].block_ids[:5] == a_blocks[:5]
    assert new["b"].block_ids[5] not in a_blocks
    assert new["c"].num_computed_tokens == 8
    assert new["c"].block_ids[:2] == a_blocks[:2]
    assert out.num_scheduled_tokens == {"a": 1, "b": 2, "c": 6}
    cached = {o.request_id: o.num_cached_tokens for o in outputs}
    assert cached == {"a": 0, "b": 20, "c": 8}
    drain(s)


def test_prefix_hit_revives_the_freed_blocks_of_a_finished_request() -> None:
    s, prompt = _with_a(13, 1, block_size=4, num_blocks=16, max_model_len=64)
    out, _ = step(s)
    a_blocks = out.scheduled_new_reqs[0].block_ids
    assert s.kv_cache_manager.usage == 0.0  # a finished: all its blocks are free (and cached)

    add(s, "b", list(prompt), max_tokens=2)
    out, outputs = step(s)
    (b,) = out.scheduled_new_reqs
    assert b.num_computed_tokens == 12
    assert b.block_ids[:3] == a_blocks[:3]
    assert out.num_scheduled_tokens == {"b": 1}
    assert outputs[0].num_cached_tokens == 12
    assert s.kv_cache_manager.block_pool.num_free_blocks == 16 - 4
    drain(s)


def test_identical_prompts_added_together_share_blocks_in_the_same_step() -> None:
    s, prompt = _with_a(20, 2, block_size=4)
    add(s, "b", list(prompt), max_tokens=2)
    out, outputs = step(s)
    a, b = out.scheduled_new_reqs
    assert (a.req_id, b.req_id) == ("a", "b")
    # The last-token rule: 20 tokens in blocks of 4 -> a hit of 4 blocks (16 tokens), not 5.
    assert b.num_computed_tokens == 16
    assert b.block_ids[:4] == a.block_ids[:4]
    assert b.block_ids[4] != a.block_ids[4]
    assert out.num_scheduled_tokens == {"a": 20, "b": 4}
    assert {o.request_id: o.num_cached_tokens for o in outputs} == {"a": 0, "b": 16}
    # Shared blocks are counted once: 5 + 1 blocks in use.
    assert s.kv_cache_manager.block_pool.num_free_blocks == 64 - 6
    drain(s)


def test_no_prefix_hits_with_caching_off() -> None:
    s, prompt = _with_a(20, 2, block_size=4, prefix_caching=False)
    add(s, "b", list(prompt), max_tokens=2)
    out, _ = step(s)
    a, b = out.scheduled_new_reqs
    assert b.num_computed_tokens == 0
    assert not set(a.block_ids) & set(b.block_ids)
    assert out.num_scheduled_tokens == {"a": 20, "b": 20}

    add(s, "c", list(prompt), max_tokens=2)  # a's blocks are computed by now: still no hit
    out, outputs = step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert out.num_scheduled_tokens["c"] == 20
    assert all(o.num_cached_tokens == 0 for o in outputs)
    assert s.make_stats().prefix_cache_hits == 0
    drain(s)


# -- SchedulerOutput contents ----------------------------------------------------------------
def test_new_request_is_sent_once_then_as_cached_diffs() -> None:
    s, prompt = _with_a(6, 4, block_size=4)
    sampled = iter([[50], [51], [52], [53]])

    def run_step() -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        out = s.schedule()
        outputs = s.update_from_output(out, model_output(s, out, {"a": next(sampled)}))
        s.check_integrity()
        return out, outputs

    out, _ = run_step()
    assert out.step_id == 0
    assert len(out.scheduled_new_reqs) == 1
    new = out.scheduled_new_reqs[0]
    assert (new.req_id, new.prompt_token_ids, new.num_computed_tokens) == ("a", prompt, 0)
    assert new.eos_token_id == 2
    assert len(new.block_ids) == 2  # the whole table: 6 tokens in blocks of 4
    table = list(new.block_ids)
    assert out.scheduled_cached_reqs.num_reqs == 0
    assert out.finished_req_ids == set()

    expected = [  # (step, new_token_ids, grows the table?, num_computed_tokens before the step)
        (1, [50], False, 6),
        (2, [51], False, 7),
        (3, [52], True, 8),  # the 9th token needs a third block
    ]
    for step_id, tokens, grows, computed in expected:
        out, outputs = run_step()
        cached = out.scheduled_cached_reqs
        assert out.step_id == step_id
        assert out.scheduled_new_reqs == []
        assert cached.req_ids == ["a"]
        assert cached.resumed_from_preemption == [False]
        assert cached.new_token_ids == [tokens]
        assert cached.num_computed_tokens == [computed]
        if grows:
            (new_ids,) = cached.new_block_ids
            assert new_ids is not None and len(new_ids) == 1
            assert new_ids[0] not in table
            table += new_ids
        else:
            assert cached.new_block_ids == [None]
        assert out.num_scheduled_tokens == {"a": 1}
    assert outputs[0].finish_reason == FinishReason.LENGTH

    out = s.schedule()  # the finished id is shipped once, in the next output
    assert (out.step_id, out.finished_req_ids, out.num_scheduled_tokens) == (4, {"a"}, {})
    s.update_from_output(out, ModelRunnerOutput.empty())
    out = s.schedule()
    assert (out.step_id, out.finished_req_ids) == (5, set())
    assert_all_free(s)


def test_chunked_prefill_diffs_carry_the_prompt_slice_and_new_blocks() -> None:
    s, prompt = _with_a(20, 2, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    out, _ = step(s)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert len(out.scheduled_new_reqs[0].block_ids) == 2
    seen = set(out.scheduled_new_reqs[0].block_ids)
    for start, n, new_blocks in ((8, 8, 2), (16, 4, 1)):
        out, _ = step(s)
        cached = out.scheduled_cached_reqs
        assert cached.req_ids == ["a"]
        assert cached.num_computed_tokens == [start]
        assert cached.new_token_ids == [prompt[start : start + n]]
        (ids,) = cached.new_block_ids
        assert ids is not None and len(ids) == new_blocks and not seen & set(ids)
        seen |= set(ids)
    drain(s)


def test_a_worker_mirroring_the_diffs_rebuilds_every_block_table_and_position() -> None:
    # A worker that only reads SchedulerOutputs (new requests in full, then diffs) must end up
    # with the scheduler's block tables and token positions, through chunking, prefix sharing,
    # preemption and stops.
    rng = random.Random(7)
    s = make_scheduler(
        block_size=4, num_blocks=14, max_model_len=48, max_num_batched_tokens=20, max_num_seqs=6
    )
    shared = fresh_prompt(10)
    for i in range(14):
        tail = fresh_prompt(rng.randint(1, 14))
        prompt = shared[: rng.randint(0, 10)] + tail
        add(s, f"r{i}", prompt, max_tokens=rng.randint(4, 24))
    tables: dict[str, list[int]] = {}
    positions: dict[str, int] = {}
    num_preempted = 0
    for _ in range(400):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            tables.pop(req_id, None)
            positions.pop(req_id, None)
        num_preempted += len(out.preempted_req_ids)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in tables, "a request was sent in full twice"
            tables[new.req_id] = list(new.block_ids)
            positions[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            request = s.requests[req_id]
            start = cached.num_computed_tokens[i]
            n = out.num_scheduled_tokens[req_id]
            assert cached.new_token_ids[i] == request.all_token_ids[start : start + n]
            if cached.resumed_from_preemption[i]:
                assert cached.resumed_token_ids[req_id] == request.all_token_ids
                tables[req_id] = list(cached.new_block_ids[i] or [])
            else:
                assert positions[req_id] == start
                tables[req_id] += cached.new_block_ids[i] or []
            positions[req_id] = start
        for req_id, n in out.num_scheduled_tokens.items():
            assert tables[req_id] == s.kv_cache_manager.get_block_ids(req_id)
            positions[req_id] += n
            assert len(tables[req_id]) * 4 >= positions[req_id]
        # EOS (2) now and then.
        tokens = {rid: [2 if rng.random() < 0.05 else 7] for rid in out.num_scheduled_tokens}
        s.update_from_output(out, model_output(s, out, tokens))
        s.check_integrity()
    assert num_preempted > 0, "the scenario should exercise preemption"
    assert not s.has_unfinished_requests()
    assert_all_free(s)
