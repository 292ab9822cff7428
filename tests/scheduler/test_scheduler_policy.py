"""Scenario tests for preemption by recompute, the FCFS and priority policies, Tandem's skip
rule with its aging bound (DESIGN §4.1) and priority preemption at ``max_num_seqs`` (§4.4).

Tiny caches (``block_size=4``, a few blocks) make KV pressure easy to create. Prompts are
distinct token ranges so requests never share prefix blocks by accident, and the fake model
samples ``T0 + i`` as a request's ``i``-th output, so a request that was preempted and
recomputed must still end with exactly ``T0, T0+1, ...``.
"""

from __future__ import annotations

from typing import Any

import pytest

from scheduler import Request, RequestStatus, Scheduler, SchedulerOutput
from tests.scheduler import helpers
from tests.scheduler.helpers import (
    T0,
    counting_step,
    expected,
    finish_counting,
    make_request,
    make_scheduler,
    request_ids,
    token_range,
)


def _new_ids(out: SchedulerOutput) -> list[str]:
    return [r.req_id for r in out.scheduled_new_reqs]


def _assert_preempted(s: Scheduler, r: Request, times: int = 1) -> None:
    assert r.status == RequestStatus.PREEMPTED
    assert r.num_computed_tokens == 0
    assert r.num_preemptions == times
    assert r.request_id not in s.kv_cache_manager.req_to_blocks
    assert r in list(s.waiting)


# -- FCFS preemption by recompute ----------------------------------------------------------


# Two decodes on 6 blocks (block_size 4):
#
#   step 1  A, B prefill 8 tokens     A=[a0 a1]     B=[b0 b1]     free 2
#   step 2  A, B decode position 8    A=[a0 a1 a2]  B=[b0 b1 b2]  free 0
#   step 5  C arrives (1 block): nothing free, skipped
#   step 6  A needs a3 for position 12 -> B (running[-1]) is preempted; A finishes
#   step 7  B resumes: prefix hit on b0 b1, recomputes positions 8..12
def _fcfs_pressure(prefix_caching: bool = True) -> tuple[Scheduler, dict[str, list[int]]]:
    """The scenario above, run through step 5 (the next step preempts)."""
    s = make_scheduler(num_blocks=6, max_model_len=24, prefix_caching=prefix_caching)
    s.add_request(make_request(token_range(1000, 8), req_id="A", max_tokens=6))
    s.add_request(make_request(token_range(2000, 8), req_id="B", max_tokens=10))
    produced: dict[str, list[int]] = {}
    for _ in range(4):
        counting_step(s, produced)
    s.add_request(make_request(token_range(3000, 4), req_id="C", max_tokens=1))
    out, _ = counting_step(s, produced)
    assert "C" not in out.num_scheduled_tokens
    assert s.kv_cache_manager.block_pool.num_free_blocks == 0
    return s, produced


def test_fcfs_preempts_last_running_request_to_front_of_waiting() -> None:
    s, produced = _fcfs_pressure()
    a, b, c = (s.requests[rid] for rid in "ABC")
    assert request_ids(s.running) == ["A", "B"]
    assert request_ids(s.waiting) == ["C"]

    out, _ = counting_step(s, produced)

    assert out.preempted_req_ids == {"B"}
    assert list(out.num_scheduled_tokens) == ["A"]  # A got B's block
    assert "B" not in out.scheduled_cached_reqs.req_ids
    _assert_preempted(s, b)
    # Back to the FRONT, ahead of C, which was queued before the preemption.
    assert request_ids(s.waiting) == ["B", "C"]
    assert s.make_stats().num_preemptions == 1
    assert a.is_finished and c.status == RequestStatus.WAITING
    finish_counting(s, produced)


def test_no_waiting_pass_in_a_step_that_preempted_for_kv() -> None:
    s, produced = _fcfs_pressure()
    out = s.schedule()
    assert out.preempted_req_ids == {"B"}
    # C (1 block) would fit in B's freed blocks and the budget is nearly untouched, yet the
    # step admits nobody: the freed blocks are for the running requests.
    assert s.kv_cache_manager.block_pool.num_free_blocks >= 1
    assert out.total_num_scheduled_tokens < s.scheduler_config.max_num_batched_tokens
    assert "C" not in out.num_scheduled_tokens and not out.scheduled_new_reqs
    assert s.requests["C"].status == RequestStatus.WAITING
    tokens = {rid: [T0 + r.num_output_tokens] for rid, r in s.requests.items()}
    for o in s.update_from_output(out, helpers.model_output(s, out, tokens)):
        produced[o.request_id].extend(o.new_token_ids)
    s.check_integrity()
    out, _ = counting_step(s, produced)
    assert "C" in _new_ids(out)  # the next step admits it
    finish_counting(s, produced)
    assert produced == {"A": expected(6), "B": expected(10), "C": expected(1)}


@pytest.mark.parametrize(("prefix_caching", "hit"), [(True, 8), (False, 0)])
def test_preempted_request_resumes_and_recomputes_prompt_plus_outputs(
    prefix_caching: bool, hit: int
) -> None:
    s, produced = _fcfs_pressure(prefix_caching)
    b = s.requests["B"]
    prompt_blocks = s.kv_cache_manager.get_block_ids("B")[:2]
    counting_step(s, produced)  # B preempted
    assert b.num_tokens == 13  # prompt (8) + 5 outputs

    out, _ = counting_step(s, produced)

    cached = out.scheduled_cached_reqs
    assert "B" not in _new_ids(out)
    i = cached.req_ids.index("B")
    assert cached.resumed_from_preemption[i] is True
    assert cached.resumed_token_ids["B"] == token_range(2000, 8) + expected(5)
    assert cached.num_computed_tokens[i] == hit
    assert cached.new_token_ids[i] == b.all_token_ids[hit:13]
    assert out.num_scheduled_tokens["B"] == 13 - hit
    # The whole block table, not a diff: 13 tokens -> 4 blocks.
    table = s.kv_cache_manager.get_block_ids("B")
    assert cached.new_block_ids[i] == table and len(table) == 4
    if prefix_caching:
        assert table[:2] == prompt_blocks  # its own prompt blocks, found again
    assert b.status == RequestStatus.RUNNING and b.num_computed_tokens == 13

    finish_counting(s, produced)
    assert produced == {"A": expected(6), "B": expected(10), "C": expected(1)}
    assert b.num_preemptions == 1


def test_fcfs_request_needing_blocks_preempts_itself_when_last() -> None:
    # 4 blocks: A=[a0 a1] B=[b0 b1] after step 2; at step 4 B needs b2 for position 8.
    s = make_scheduler(num_blocks=4, max_model_len=16)
    s.add_request(make_request(token_range(1000, 4), req_id="A", max_tokens=10))
    s.add_request(make_request(token_range(2000, 6), req_id="B", max_tokens=10))
    produced: dict[str, list[int]] = {}
    for _ in range(3):
        counting_step(s, produced)
    b = s.requests["B"]
    assert s.kv_cache_manager.block_pool.num_free_blocks == 0 and b.num_computed_tokens == 8
    s.add_request(make_request(token_range(3000, 2), req_id="W", max_tokens=1))

    out, _ = counting_step(s, produced)

    assert out.preempted_req_ids == {"B"}
    assert list(out.num_scheduled_tokens) == ["A"]
    _assert_preempted(s, b)
    assert request_ids(s.waiting) == ["B", "W"]  # W fits in B's blocks but is not admitted
    finish_counting(s, produced)
    assert produced == {"A": expected(10), "B": expected(10), "W": expected(1)}


# -- priority preemption under KV pressure --------------------------------------------------


def _x_first(
    num_blocks: int, max_model_len: int, budget: int, x_prompt: int, x_max_tokens: int, **cfg: Any
) -> tuple[Scheduler, Request, dict[str, list[int]]]:
    """A priority scheduler (``budget`` tokens a step, max_num_seqs 4) where X (priority 5, a
    ``x_prompt``-token prompt) has run one step alone."""
    s = make_scheduler(
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        policy="priority",
        **cfg,
    )
    x = make_request(token_range(1000, x_prompt), req_id="X", max_tokens=x_max_tokens, priority=5)
    s.add_request(x)
    produced: dict[str, list[int]] = {}
    counting_step(s, produced)
    return s, x, produced


def test_priority_victim_scheduled_earlier_in_step_gives_back_its_budget() -> None:
    # Budget 6. X (priority 5) runs first; Y (0) and Z (1, a 24-token prefill) join later.
    # At step 8 X is scheduled (1 token), then Y needs a block with none free: the victim is
    # the worst request, X, already scheduled this step.
    s, x, produced = _x_first(11, 44, budget=6, x_prompt=5, x_max_tokens=30)
    s.add_request(make_request(token_range(2000, 8), req_id="Y", max_tokens=30, priority=0))
    s.add_request(make_request(token_range(3000, 24), req_id="Z", max_tokens=5, priority=1))
    for _ in range(6):
        counting_step(s, produced)
    y, z = s.requests["Y"], s.requests["Z"]
    assert request_ids(s.running) == ["X", "Y", "Z"]
    assert s.kv_cache_manager.block_pool.num_free_blocks == 0
    assert y.num_computed_tokens % 4 == 0  # Y's next token opens a new block
    assert x.num_computed_tokens % 4 != 0  # X's does not: X is scheduled before Y fails
    z_remaining = z.num_tokens - z.num_computed_tokens
    assert z_remaining > 5

    out, _ = counting_step(s, produced)

    assert out.preempted_req_ids == {"X"}
    assert "X" not in out.num_scheduled_tokens
    assert out.scheduled_cached_reqs.req_ids == ["Y", "Z"]
    # X's token went back to the budget: Z's chunk is 6 - 1 (Y), not 6 - 2.
    assert out.num_scheduled_tokens == {"Y": 1, "Z": 5}
    assert out.total_num_scheduled_tokens == 6
    _assert_preempted(s, x)
    assert x.num_in_flight_tokens == 0
    finish_counting(s, produced)
    assert produced == {"X": expected(30), "Y": expected(30), "Z": expected(5)}


def test_victim_preempted_after_scheduling_leaves_no_uncomputed_block_findable() -> None:
    # Budget 12, chunks capped at 8. X (priority 5, 28-token prompt) has 20 tokens computed;
    # at step 3 it is scheduled 8 more (blocks 5 and 6, hashed at allocation), then Y needs
    # a block with none free and X is the victim: those two blocks were never computed and
    # must not stay findable, or an identical prompt would "hit" garbage KV.
    s, x, produced = _x_first(
        8, 32, budget=12, x_prompt=28, x_max_tokens=3, long_prefill_token_threshold=8
    )
    s.add_request(make_request(token_range(2000, 5), req_id="Y", max_tokens=20, priority=0))
    counting_step(s, produced)
    assert request_ids(s.running) == ["X", "Y"] and x.num_computed_tokens == 20

    out, _ = counting_step(s, produced)

    assert out.preempted_req_ids == {"X"} and out.num_scheduled_tokens == {"Y": 1}
    probe = make_request(token_range(1000, 28))
    _, num_hit = s.kv_cache_manager.get_computed_blocks(probe)
    assert num_hit == 20  # X's computed prefix is reusable, nothing beyond it
    finish_counting(s, produced)
    assert produced == {"X": expected(3), "Y": expected(20)}


@pytest.mark.parametrize(
    ("policy", "victim", "scheduled"),
    [("priority", "B", ["A", "C"]), ("fcfs", "C", ["A", "B"])],
)
def test_self_victim_priority_continues_while_fcfs_takes_last(
    policy: str, victim: str, scheduled: list[str]
) -> None:
    # 6 blocks; running [A (priority 0), B (9), C (1)]. At step 4 B needs a block, none free.
    # Priority: the victim is B itself; the pass goes on with C. FCFS: C (running[-1]) goes.
    s = make_scheduler(num_blocks=6, max_model_len=24, policy=policy)
    s.add_request(make_request(token_range(1000, 4), req_id="A", max_tokens=12, priority=0))
    s.add_request(make_request(token_range(2000, 6), req_id="B", max_tokens=12, priority=9))
    produced: dict[str, list[int]] = {}
    counting_step(s, produced)
    s.add_request(make_request(token_range(3000, 4), req_id="C", max_tokens=12, priority=1))
    counting_step(s, produced)
    counting_step(s, produced)
    assert request_ids(s.running) == ["A", "B", "C"]
    assert s.kv_cache_manager.block_pool.num_free_blocks == 0
    assert s.requests["B"].num_computed_tokens == 8  # B's next token needs a new block

    out, _ = counting_step(s, produced)

    assert out.preempted_req_ids == {victim}
    assert list(out.num_scheduled_tokens) == scheduled
    _assert_preempted(s, s.requests[victim])
    finish_counting(s, produced)
    assert produced == {rid: expected(12) for rid in "ABC"}


# -- Tandem's skip rule and its aging bound (DESIGN §4.1) -----------------------------------


def _hog_and_mixed_queue(strict_fcfs: bool) -> tuple[Scheduler, dict[str, list[int]]]:
    """10 blocks. R runs (4 blocks, growing); then L1, L2 (7 blocks each, cannot fit next to
    R) arrive interleaved with one-block requests s1, s2."""
    s = make_scheduler(num_blocks=10, max_model_len=40, strict_fcfs=strict_fcfs)
    s.add_request(make_request(token_range(1000, 16), req_id="R", max_tokens=12))
    produced: dict[str, list[int]] = {}
    counting_step(s, produced)
    for rid, base, n in (("L1", 2000, 28), ("s1", 3000, 2), ("L2", 4000, 26), ("s2", 3100, 2)):
        s.add_request(make_request(token_range(base, n), req_id=rid, max_tokens=1 if n < 4 else 2))
    return s, produced


def test_unallocatable_request_is_skipped_and_keeps_its_place() -> None:
    s, produced = _hog_and_mixed_queue(strict_fcfs=False)
    out, _ = counting_step(s, produced)
    assert _new_ids(out) == ["s1", "s2"]  # admitted past L1 and L2 in the same step
    assert request_ids(s.waiting) == ["L1", "L2"]  # re-prepended in their original order
    assert [s.requests[r].num_skipped_steps for r in ("L1", "L2")] == [1, 1]

    s.add_request(make_request(token_range(3200, 2), req_id="s3", max_tokens=1))
    out, _ = counting_step(s, produced)
    assert _new_ids(out) == ["s3"]
    assert request_ids(s.waiting) == ["L1", "L2"]
    finish_counting(s, produced)
    assert produced["L1"] == produced["L2"] == expected(2)
    assert produced["R"] == expected(12)


def test_strict_fcfs_stops_at_the_first_request_that_cannot_fit() -> None:
    s, produced = _hog_and_mixed_queue(strict_fcfs=True)
    out, _ = counting_step(s, produced)
    assert list(out.num_scheduled_tokens) == ["R"]  # s1 fits but is behind L1
    assert request_ids(s.waiting) == ["L1", "s1", "L2", "s2"]
    assert s.requests["L1"].num_skipped_steps == 0
    admitted: list[str] = []
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        out, _ = counting_step(s, produced)
        admitted += _new_ids(out)
    helpers.assert_all_free(s)
    assert admitted == ["L1", "s1", "L2", "s2"]  # strict arrival order
    assert produced["L1"] == produced["L2"] == expected(2)


def _stream_with_large_request(
    max_skip_steps: int,
) -> tuple[Scheduler, dict[int, list[str]], dict[str, list[int]]]:
    """8 blocks. At each step t = 1..13 a one-block request s<t> arrives and lives 3 steps,
    so two or three of them always hold blocks. At step 3 L arrives (before s3): it needs 7
    blocks, never free while the stream is admitted. Returns the admissions of each step."""
    s = make_scheduler(num_blocks=8, max_model_len=32, max_skip_steps=max_skip_steps)
    admitted: dict[int, list[str]] = {}
    produced: dict[str, list[int]] = {}
    for t in range(1, 14):
        if t == 3:
            s.add_request(make_request(token_range(9000, 28), req_id="L", max_tokens=2))
        s.add_request(make_request(token_range(1000 + 10 * t, 2), req_id=f"s{t}", max_tokens=3))
        out, _ = counting_step(s, produced)
        admitted[t] = _new_ids(out)
    return s, admitted, produced


@pytest.mark.parametrize("k", [0, 1, 3])
def test_aging_bound_blocks_the_queue_after_max_skip_steps(k: int) -> None:
    s, admitted, produced = _stream_with_large_request(max_skip_steps=k)
    for t in range(3, 3 + k):  # passed over k times: the stream still flows
        assert admitted[t] == [f"s{t}"]
    # Then L blocks the queue: s<3+k> fits (one block) but is not admitted ...
    assert admitted[3 + k] == []
    # ... the running requests drain, and L runs before anything that queued behind it.
    assert admitted[4 + k] == ["L"]
    assert all(f"s{t}" not in admitted[t] for t in range(3 + k, 5 + k))
    finish_counting(s, produced)
    assert produced["L"] == expected(2)
    assert all(produced[f"s{t}"] == expected(3) for t in range(1, 14))


def test_without_aging_a_large_request_starves_behind_a_stream() -> None:
    # The contrast that justifies the bound: with a huge max_skip_steps, L waits as long
    # as the stream lasts and only runs once it stops.
    s, admitted, produced = _stream_with_large_request(max_skip_steps=1000)
    assert all(admitted[t] == [f"s{t}"] for t in range(3, 14))
    assert s.requests["L"].status == RequestStatus.WAITING
    assert s.requests["L"].num_skipped_steps == 11
    finish_counting(s, produced)
    assert produced["L"] == expected(2)


# -- priority preemption at max_num_seqs (DESIGN §4.4, vllm#40004) ---------------------------


def _full_slots(
    policy: str = "priority",
    prio_a: int = 5,
    prio_b: int = 5,
    num_blocks: int = 16,
    stagger: bool = False,
    **cfg: object,
) -> tuple[Scheduler, dict[str, list[int]]]:
    """max_num_seqs=2, both slots taken by A and B (8-token prompts, 2 blocks each), in
    that order (``stagger``: B arrives a step later, so a worse A can still run first)."""
    s = make_scheduler(
        num_blocks=num_blocks, max_model_len=32, max_num_seqs=2, policy=policy, **cfg
    )
    produced: dict[str, list[int]] = {}
    s.add_request(make_request(token_range(1000, 8), req_id="A", max_tokens=10, priority=prio_a))
    if stagger:
        counting_step(s, produced)
    s.add_request(make_request(token_range(2000, 8), req_id="B", max_tokens=10, priority=prio_b))
    counting_step(s, produced)
    assert request_ids(s.running) == ["A", "B"]
    return s, produced


@pytest.mark.parametrize(
    ("prio_a", "prio_b", "victim", "survivor"),
    [(7, 5, "A", "B"), (5, 5, "B", "A")],  # worst priority; on a tie the later arrival
)
def test_better_priority_newcomer_preempts_worst_running_at_max_num_seqs(
    prio_a: int, prio_b: int, victim: str, survivor: str
) -> None:
    s, produced = _full_slots(prio_a=prio_a, prio_b=prio_b, stagger=True)
    s.add_request(make_request(token_range(3000, 8), req_id="N", max_tokens=4, priority=0))

    out, _ = counting_step(s, produced)

    assert out.preempted_req_ids == {victim}
    assert _new_ids(out) == ["N"]  # admitted in the same step
    assert set(out.num_scheduled_tokens) == {survivor, "N"}
    assert request_ids(s.running) == [survivor, "N"]
    _assert_preempted(s, s.requests[victim])
    finish_counting(s, produced)
    assert produced == {"A": expected(10), "B": expected(10), "N": expected(4)}


@pytest.mark.parametrize(
    ("policy", "prio_n"),
    [("priority", 5), ("priority", 6), ("fcfs", 0)],
    ids=["equal-priority", "worse-priority", "fcfs"],
)
def test_no_preemption_at_max_num_seqs_without_strictly_better_priority(
    policy: str, prio_n: int
) -> None:
    s, produced = _full_slots(policy=policy)
    s.add_request(make_request(token_range(3000, 8), req_id="N", max_tokens=4, priority=prio_n))
    out, _ = counting_step(s, produced)
    assert out.preempted_req_ids == set()
    assert set(out.num_scheduled_tokens) == {"A", "B"}
    assert request_ids(s.waiting) == ["N"]
    finish_counting(s, produced)
    assert s.make_stats().num_preemptions == 0
    assert produced["N"] == expected(4)


@pytest.mark.parametrize(("n_prompt", "preempts"), [(28, False), (20, True)])
def test_priority_preemption_only_when_the_newcomer_then_fits(
    n_prompt: int, preempts: bool
) -> None:
    # 8 blocks, A and B hold 2 each: 4 free, B would free 2 more. 28 tokens need 7 blocks
    # (cannot fit even after freeing B); 20 need 5 (fit, A's decode block included).
    s, produced = _full_slots(num_blocks=8)
    assert s.kv_cache_manager.block_pool.num_free_blocks == 4
    s.add_request(make_request(token_range(3000, n_prompt), req_id="N", max_tokens=2, priority=0))
    out, _ = counting_step(s, produced)
    assert out.preempted_req_ids == ({"B"} if preempts else set())
    assert _new_ids(out) == (["N"] if preempts else [])
    finish_counting(s, produced)
    assert produced["N"] == expected(2)


@pytest.mark.parametrize(
    ("num_blocks", "n_prompt", "cfg"),
    [(8, 24, {}), (10, 24, {"watermark": 0.3})],
    ids=["running-decode-takes-a-freed-block", "watermark"],
)
def test_priority_preemption_is_never_made_for_a_newcomer_that_is_not_admitted(
    num_blocks: int, n_prompt: int, cfg: dict[str, float]
) -> None:
    # N's 6 blocks "fit" in free + B's blocks by raw count, but N cannot be admitted this
    # step: A's decode takes one of those blocks first / the watermark keeps 3 blocks back.
    # Preempting B then throws B's work away for nothing (and, with the watermark, again
    # every other step: B is re-admitted past N, then preempted for N once more).
    s, produced = _full_slots(num_blocks=num_blocks, **cfg)
    s.add_request(make_request(token_range(3000, n_prompt), req_id="N", max_tokens=2, priority=0))
    for _ in range(4):
        out, _ = counting_step(s, produced)
        if out.preempted_req_ids:
            assert "N" in _new_ids(out), (
                f"preempted {out.preempted_req_ids} for N, but N was not admitted"
            )
    finish_counting(s, produced)
    assert produced["N"] == expected(2)


# -- priority waiting order ---------------------------------------------------------------


_ORDER_CASE = [("a", 2, 0.0), ("b", 1, 3.0), ("c", 1, 1.0), ("d", 0, 5.0), ("e", 2, -1.0)]
_ORDER = ["d", "c", "b", "e", "a"]  # lower priority value first, then earlier arrival


def test_priority_waiting_order_is_priority_then_arrival() -> None:
    s = make_scheduler(policy="priority")
    for rid, prio, arrival in _ORDER_CASE:
        s.add_request(make_request(4, req_id=rid, priority=prio, arrival_time=arrival))
    assert request_ids(s.waiting) == _ORDER
    out, _ = counting_step(s)
    assert _new_ids(out) == _ORDER
    assert request_ids(s.running) == _ORDER


def test_priority_admits_one_at_a_time_in_order_with_late_better_arrival() -> None:
    s = make_scheduler(policy="priority", max_num_seqs=1)
    for rid, prio, arrival in _ORDER_CASE:
        s.add_request(
            make_request(4, req_id=rid, max_tokens=1, priority=prio, arrival_time=arrival)
        )
    admitted: list[str] = []
    for t in range(10):
        if t == 2:  # arrives last, but outranks everything still waiting
            s.add_request(make_request(4, req_id="z", max_tokens=1, arrival_time=10.0))
        out, _ = counting_step(s)
        admitted += _new_ids(out)
    helpers.assert_all_free(s)
    assert admitted == ["d", "c", "z", "b", "e", "a"]
