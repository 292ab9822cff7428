"""Scenario tests for multi-LoRA limits (reference §5): at most ``max_loras`` distinct adapters
among running requests; a waiting request with a new adapter is skipped (not a hard stop);
requests without LoRA are never blocked; preempting a request frees its adapter slot."""

from __future__ import annotations

import pytest

from scheduler import EngineCoreOutput, LoRAConfig, RequestStatus, Scheduler, SchedulerOutput
from scheduler.request import FinishReason
from tests.scheduler.helpers import (
    counting_step,
    drain,
    expected,
    finish_counting,
    lora,
    make_request,
    make_scheduler,
    model_output,
    request_ids,
    token_range,
)


def _adapters(s: Scheduler) -> set[int]:
    return {r.lora_int_id for r in s.running if r.lora_request is not None}


def _step(
    s: Scheduler, produced: dict[str, list[int]] | None = None
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """A ``counting_step`` that also checks the adapter limit on running and scheduled
    requests."""
    out, outputs = counting_step(s, produced)
    assert s.lora_config is not None
    assert len(_adapters(s)) <= s.lora_config.max_loras
    scheduled = {
        s.requests[rid].lora_int_id for rid in out.num_scheduled_tokens if rid in s.requests
    }
    assert len(scheduled - {0}) <= s.lora_config.max_loras
    return out, outputs


def _finish(s: Scheduler, produced: dict[str, list[int]]) -> None:
    finish_counting(s, produced, _step)


def _admitted(out: SchedulerOutput) -> list[str]:
    cached = out.scheduled_cached_reqs
    resumed = [
        rid for rid, r in zip(cached.req_ids, cached.resumed_from_preemption, strict=True) if r
    ]
    return [r.req_id for r in out.scheduled_new_reqs] + resumed


@pytest.mark.parametrize(
    ("max_loras", "adapters", "first", "skipped"),
    [
        (1, [1, 2, None, 1, 2, None], ["r0", "r2", "r3", "r5"], ["r1", "r4"]),
        (2, [1, 2, 3, None, 2, 3, None], ["r0", "r1", "r3", "r4", "r6"], ["r2", "r5"]),
    ],
)
def test_new_adapter_is_skipped_when_slots_are_full(
    max_loras: int, adapters: list[int | None], first: list[str], skipped: list[str]
) -> None:
    # Adapter requests live 2 steps, base-model ones 6: at step 3 every adapter that was in
    # the first batch is gone and the skipped requests get their slots.
    s = make_scheduler(lora=LoRAConfig(max_loras=max_loras))
    for i, n in enumerate(adapters):
        s.add_request(
            make_request(
                token_range(1000 + 20 * i, 5),
                req_id=f"r{i}",
                max_tokens=6 if n is None else 2,
                lora=None if n is None else lora(n),
            )
        )
    produced: dict[str, list[int]] = {}
    out, _ = _step(s, produced)
    assert _admitted(out) == first  # requests behind the skipped one are still admitted
    assert request_ids(s.waiting) == skipped
    assert len(_adapters(s)) == max_loras
    out, _ = _step(s, produced)  # the first adapters finish at the end of this step
    assert _admitted(out) == []
    assert _adapters(s) == set()
    out, _ = _step(s, produced)
    assert _admitted(out) == skipped
    _finish(s, produced)
    assert produced == {f"r{i}": expected(6 if n is None else 2) for i, n in enumerate(adapters)}


def test_requests_without_lora_are_never_blocked() -> None:
    s = make_scheduler(lora=LoRAConfig(max_loras=1))
    s.add_request(make_request(token_range(1000, 5), req_id="a1", max_tokens=4, lora=lora(1)))
    produced: dict[str, list[int]] = {}
    _step(s, produced)
    queue = [("b1", None), ("a2", 2), ("b2", None), ("a3", 3), ("b3", None), ("a1b", 1)]
    for i, (rid, n) in enumerate(queue):
        s.add_request(
            make_request(
                token_range(2000 + 20 * i, 5),
                req_id=rid,
                max_tokens=4,
                lora=None if n is None else lora(n),
            )
        )
    out, _ = _step(s, produced)
    assert _admitted(out) == ["b1", "b2", "b3", "a1b"]
    assert request_ids(s.waiting) == ["a2", "a3"]
    _finish(s, produced)
    assert all(tokens == expected(4) for tokens in produced.values())
    assert len(produced) == 7


@pytest.mark.parametrize("strict_fcfs", [False, True])
def test_an_adapter_waiting_long_for_a_slot(strict_fcfs: bool) -> None:
    """A request waiting for an adapter slot past ``max_skip_steps`` blocks the queue (the
    aging bound: a rare adapter cannot starve) -- but not with ``strict_fcfs``, which is
    vLLM's behaviour, and vLLM never blocks the queue for a full adapter set."""
    s = make_scheduler(lora=LoRAConfig(max_loras=1), max_skip_steps=2, strict_fcfs=strict_fcfs)
    s.add_request(make_request(token_range(1000, 5), req_id="a", max_tokens=30, lora=lora(1)))
    s.add_request(make_request(token_range(2000, 5), req_id="w", max_tokens=4, lora=lora(2)))
    produced: dict[str, list[int]] = {}
    for _ in range(3):
        _step(s, produced)
    s.add_request(make_request(token_range(3000, 5), req_id="base", max_tokens=4))
    out, _ = _step(s, produced)
    assert ("base" in _admitted(out)) is strict_fcfs
    assert "w" not in out.num_scheduled_tokens
    _finish(s, produced)


def test_kv_preemption_frees_the_adapter_slot() -> None:
    # 6 blocks. A (base, 3 blocks) and R (adapter 1, 2 blocks) run; W (adapter 2) is skipped
    # for the adapter slot. At step 4 R needs a block, none free: R is preempted. R's 3
    # blocks do not fit back, so at step 5 R is passed over and W takes the freed slot.
    s = make_scheduler(num_blocks=6, max_model_len=24, lora=LoRAConfig(max_loras=1))
    s.add_request(make_request(token_range(1000, 12), req_id="A", max_tokens=10))
    s.add_request(make_request(token_range(2000, 6), req_id="R", max_tokens=10, lora=lora(1)))
    s.add_request(make_request(token_range(3000, 2), req_id="W", max_tokens=1, lora=lora(2)))
    produced: dict[str, list[int]] = {}
    for _ in range(3):
        out, _ = _step(s, produced)
        assert "W" not in out.num_scheduled_tokens
        assert _adapters(s) == {1}
    r, w = s.requests["R"], s.requests["W"]
    # Skipped for the adapter slot each step; those skips count toward the aging bound
    # (max_skip_steps, 32 by default) so a rare adapter cannot starve.
    assert w.num_skipped_steps == 3

    out, _ = _step(s, produced)
    assert out.preempted_req_ids == {"R"}
    assert r.status == RequestStatus.PREEMPTED
    assert _adapters(s) == set()
    assert "W" not in out.num_scheduled_tokens  # no waiting pass in a preempting step

    out, _ = _step(s, produced)
    assert _admitted(out) == ["W"]
    assert r.status == RequestStatus.PREEMPTED
    _finish(s, produced)
    assert produced == {"A": expected(10), "R": expected(10), "W": expected(1)}


def _full_slots_with_adapter(
    prio_a: int, lora_a: int | None, prio_b: int, lora_b: int | None
) -> tuple[Scheduler, dict[str, list[int]]]:
    """policy=priority, max_num_seqs=2, max_loras=1: A and B run, N (adapter 2, priority 0)
    arrives."""
    s = make_scheduler(
        max_num_seqs=2, max_model_len=40, policy="priority", lora=LoRAConfig(max_loras=1)
    )
    a_lora = None if lora_a is None else lora(lora_a)
    b_lora = None if lora_b is None else lora(lora_b)
    s.add_request(
        make_request(token_range(1000, 8), req_id="A", max_tokens=6, priority=prio_a, lora=a_lora)
    )
    s.add_request(
        make_request(token_range(2000, 8), req_id="B", max_tokens=6, priority=prio_b, lora=b_lora)
    )
    produced: dict[str, list[int]] = {}
    _step(s, produced)
    s.add_request(
        make_request(token_range(3000, 8), req_id="N", max_tokens=2, priority=0, lora=lora(2))
    )
    return s, produced


def test_priority_preemption_at_max_num_seqs_frees_the_adapter_slot() -> None:
    s, produced = _full_slots_with_adapter(prio_a=0, lora_a=None, prio_b=5, lora_b=1)
    assert _adapters(s) == {1}
    out, _ = _step(s, produced)
    assert out.preempted_req_ids == {"B"}
    assert _admitted(out) == ["N"]  # same step: B's adapter slot went with it
    assert _adapters(s) == {2}
    _finish(s, produced)
    assert produced == {"A": expected(6), "B": expected(6), "N": expected(2)}


def test_priority_preemption_is_not_made_for_a_newcomer_blocked_by_the_adapter_limit() -> None:
    # A (priority 0) holds the only adapter slot with adapter 1; the victim would be B (base
    # model, priority 5), whose preemption frees no slot: N cannot be admitted either way,
    # so B must keep running. (Today B is preempted, re-admitted past N, preempted again...)
    s, produced = _full_slots_with_adapter(prio_a=0, lora_a=1, prio_b=5, lora_b=None)
    b = s.requests["B"]
    for _ in range(4):
        out, _ = _step(s, produced)
        assert "N" not in out.num_scheduled_tokens
    assert b.num_preemptions == 0
    _finish(s, produced)
    assert produced == {"A": expected(6), "B": expected(6), "N": expected(2)}


def test_a_request_the_workers_could_not_compute_fails_alone() -> None:
    """A worker that cannot read a request's adapter (its files went after an eviction)
    names it in ``failed_req_ids``: that request ends with the error, its blocks are freed
    without the hashes of the step (they hold no KV of its adapter), and the others go on.
    (The failure stopped the whole instance.)"""
    s = make_scheduler(lora=LoRAConfig(max_loras=2))
    s.add_request(make_request(token_range(1000, 8), req_id="bad", max_tokens=4, lora=lora(1)))
    s.add_request(make_request(token_range(2000, 8), req_id="ok", max_tokens=4, lora=lora(2)))
    s.add_request(make_request(token_range(3000, 8), req_id="base", max_tokens=4))
    bad = s.requests["bad"]
    out = s.schedule()
    result = model_output(s, out)
    result.failed_req_ids = {"bad": "the LoRA adapter `adapter-1` could not be loaded"}
    outputs = {o.request_id: o for o in s.update_from_output(out, result)}
    s.check_integrity()
    assert outputs["bad"].finish_reason == FinishReason.ERROR
    assert outputs["bad"].new_token_ids == []
    assert outputs["bad"].error is not None and "adapter-1" in outputs["bad"].error
    assert bad.status == RequestStatus.FINISHED_ERROR and "bad" not in s.requests
    assert outputs["ok"].new_token_ids == [7] and outputs["base"].new_token_ids == [7]
    # Its prompt's blocks were hashed when they were allocated: none may serve a later
    # request of that adapter.
    again = make_request(token_range(1000, 8), req_id="again", lora=lora(1))
    assert s.kv_cache_manager.get_computed_blocks(again)[1] == 0
    assert drain(s) == {"ok": [7, 7, 7], "base": [7, 7, 7]}  # (drain: every token 7)


def _again_hits(s: Scheduler, prompt: list[int]) -> int:
    """Prompt tokens a new request of adapter 1 would find in the prefix cache."""
    again = make_request(prompt, req_id="again", lora=lora(1))
    return s.kv_cache_manager.get_computed_blocks(again)[1]


def test_no_block_a_failed_step_filled_is_found_again_wherever_it_is() -> None:
    """The step that could not apply a request's adapter wrote KV computed without it into
    blocks hashed under that adapter. Whoever else holds such a block -- another sample of
    the prompt, which hit it in the same step -- or wherever it went -- back to the free
    queue, its request preempted or aborted while the step was in flight (pipeline stages,
    async scheduling) -- no later request of the adapter may find it: one did, and read the
    prompt's first block as computed without its adapter."""
    error = "the LoRA adapter `adapter-1` could not be loaded"
    prompt = token_range(1000, 8)
    # Two samples of one prompt admitted together: the second hits the first's block 0.
    s = make_scheduler(lora=LoRAConfig(max_loras=2))
    for rid in ("s0", "s1"):
        s.add_request(make_request(prompt, req_id=rid, max_tokens=4, lora=lora(1)))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"s0": 8, "s1": 4}
    result = model_output(s, out)
    result.failed_req_ids = {"s0": error, "s1": error}
    assert all(o.finish_reason == FinishReason.ERROR for o in s.update_from_output(out, result))
    s.check_integrity()
    assert _again_hits(s, prompt) == 0

    # Aborted while its failing step is in flight.
    s = make_scheduler(lora=LoRAConfig(max_loras=2))
    s.add_request(make_request(prompt, req_id="r", max_tokens=4, lora=lora(1)))
    out = s.schedule()
    result = model_output(s, out)
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    result.failed_req_ids = {"r": error}
    assert s.update_from_output(out, result) == []
    s.check_integrity()
    assert _again_hits(s, prompt) == 0

    # Sync pipelining: r's failing step is in flight when a's decode preempts it for a block.
    s = make_scheduler(
        num_blocks=3,
        max_model_len=12,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        lora=LoRAConfig(max_loras=2),
    )
    s.add_request(make_request(token_range(2000, 4), req_id="a", max_tokens=4))
    first = s.schedule()  # a's prompt (1 block)
    s.add_request(make_request(prompt, req_id="r", max_tokens=4, lora=lora(1)))
    second = s.schedule()  # a is in flight: r's prompt (2 blocks, the last free ones)
    assert second.num_scheduled_tokens == {"r": 8}
    s.update_from_output(first, model_output(s, first))
    third = s.schedule()  # a's decode needs a block: r is preempted, its step in flight
    assert third.preempted_req_ids == {"r"} and third.num_scheduled_tokens == {"a": 1}
    result = model_output(s, second)
    result.failed_req_ids = {"r": error}
    [failed] = s.update_from_output(second, result)
    assert failed.request_id == "r" and failed.finish_reason == FinishReason.ERROR
    s.check_integrity()
    assert _again_hits(s, prompt) == 0
    s.update_from_output(third, model_output(s, third))
    assert drain(s) == {"a": [7, 7]}
