"""KV-connector hooks on the decode side (DESIGN §3.2, §4.2; reference §1.5, §1.9, §4.3-4.5, §7).

A request with ``do_remote_prefill`` gets its blocks at admission, waits in
``WAITING_FOR_REMOTE_KVS`` while the worker loads its KV, and runs once the load is reported.
The test plays the worker: it reports ``finished_recving`` / ``failed_recving`` through
``helpers.step``. The prefill side is in ``test_scheduler_connector_prefill.py``, loads
after a preemption in ``test_scheduler_connector_preempt.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from scheduler import Request, RequestStatus, Scheduler, SchedulerOutput
from tests.scheduler.helpers import (
    REMOTE,
    InMemoryConnector,
    assert_all_free,
    drain,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
    used_blocks,
)


def _decode_side(**sched: Any) -> tuple[Scheduler, InMemoryConnector]:
    connector = InMemoryConnector()
    return make_scheduler(connector=connector, **sched), connector


def _start_load(s: Scheduler, request: Request) -> SchedulerOutput:
    """Add a remote-prefill request and run the step that starts its load."""
    s.add_request(request)
    out, outputs = step(s)
    assert request.request_id not in out.num_scheduled_tokens
    assert not outputs
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    return out


def _loading(
    prompt: int | list[int] = 10,
    *,
    params: dict[str, Any] | None = None,
    max_tokens: int = 8,
    **sched: Any,
) -> tuple[Scheduler, InMemoryConnector, Request]:
    """A decode side with one remote-prefill request (``params``: its kv_transfer_params,
    REMOTE by default) whose load has just started."""
    s, c = _decode_side(**sched)
    r = make_request(prompt, kv_transfer_params=dict(params or REMOTE), max_tokens=max_tokens)
    _start_load(s, r)
    return s, c, r


def _land_loads_and_drain(s: Scheduler, max_steps: int = 100) -> None:
    """Step until nothing is unfinished, each started load landing the step after it started;
    then check that every block went back to the pool."""
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        loading = {r.request_id for r in s.holding}
        step(s, finished_recving=loading)
    else:
        raise AssertionError(f"not finished after {max_steps} steps")
    assert_all_free(s)


# -- decode side: async remote load ------------------------------------------------------------


def test_remote_prefill_allocates_blocks_and_waits() -> None:
    s, c = _decode_side()
    r = make_request(10, kv_transfer_params=dict(REMOTE))
    out = _start_load(s, r)
    block_ids = s.kv_cache_manager.get_block_ids(r.request_id)
    assert len(block_ids) == 3  # 10 tokens in blocks of 4
    assert c.alloc_calls == [(r.request_id, block_ids, 10)]
    assert out.kv_connector_metadata.loads == {r.request_id: (block_ids, 10)}
    assert r.num_computed_tokens == 10
    assert r in s.holding and r not in s.running
    assert s.get_num_unfinished_requests() == 1
    # Nothing happens until the worker reports the load: no re-allocation, no new load.
    for _ in range(3):
        out, outputs = step(s)
        assert out.total_num_scheduled_tokens == 0 and not outputs
        assert out.kv_connector_metadata.loads == {}
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(c.alloc_calls) == 1
    assert s.kv_cache_manager.get_block_ids(r.request_id) == block_ids
    assert c.meta_calls == s.num_steps == 4


def test_build_connector_meta_once_per_step_before_computed_advances() -> None:
    seen: list[dict[str, int]] = []

    class Recording(InMemoryConnector):
        def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
            seen.append(
                {
                    rid: s.requests[rid].num_computed_tokens
                    for rid in scheduler_output.num_scheduled_tokens
                }
            )
            return super().build_connector_meta(scheduler_output)

    c = Recording()
    s = make_scheduler(connector=c)
    r = make_request(6, max_tokens=3)
    s.add_request(r)
    run_to_completion(s)
    # One prefill (from 0) and two decodes (from 6 and 7); an empty step also builds metadata.
    assert seen == [{r.request_id: 0}, {r.request_id: 6}, {r.request_id: 7}]
    step(s)
    assert c.meta_calls == s.num_steps == 4
    # A local request is still announced to the connector, with no external tokens.
    assert c.alloc_calls == [(r.request_id, c.alloc_calls[0][1], 0)]
    assert_all_free(s)


def test_remote_load_done_recomputes_only_the_last_token() -> None:
    s, _, r = _loading(max_tokens=4)
    block_ids = s.kv_cache_manager.get_block_ids(r.request_id)
    out, _ = step(s, finished_recving={r.request_id})  # reported after this step's schedule
    assert out.total_num_scheduled_tokens == 0
    out, outputs = step(s, tokens={r.request_id: [41]})
    assert out.num_scheduled_tokens == {r.request_id: 1}
    (new,) = out.scheduled_new_reqs
    assert new.req_id == r.request_id
    assert new.num_computed_tokens == 9
    assert new.block_ids == block_ids
    assert [o.new_token_ids for o in outputs] == [[41]]
    assert outputs[0].num_cached_tokens == 10
    produced = run_to_completion(s)
    assert len(produced[r.request_id]) == 3
    assert_all_free(s)


def test_loaded_blocks_become_prefix_hits_only_after_the_load() -> None:
    prompt = list(range(200, 210))
    s, _, r = _loading(prompt, max_tokens=2)
    kv = s.kv_cache_manager
    probe = make_request(prompt)  # never added: get_computed_blocks changes nothing
    assert kv.get_computed_blocks(probe)[1] == 0
    step(s, finished_recving={r.request_id})
    step(s)  # promoted and admitted here
    hit_blocks, num_hit = kv.get_computed_blocks(probe)
    assert num_hit == 8
    assert hit_blocks.get_block_ids() == kv.get_block_ids(r.request_id)[:2]
    drain(s)


def test_local_request_admitted_during_load_gets_no_hit() -> None:
    prompt = list(range(200, 210))
    s, _, r = _loading(prompt, max_tokens=2)
    twin = make_request(prompt, max_tokens=2)
    s.add_request(twin)
    out, _ = step(s)
    (new,) = out.scheduled_new_reqs
    assert new.req_id == twin.request_id and new.num_computed_tokens == 0
    assert out.num_scheduled_tokens == {twin.request_id: 10}
    assert not set(new.block_ids) & set(s.kv_cache_manager.get_block_ids(r.request_id))
    step(s, finished_recving={r.request_id})
    drain(s)


@pytest.mark.parametrize("remote_num_tokens", [4, 6, 9])
def test_partial_remote_load_prefills_the_rest(remote_num_tokens: int) -> None:
    params = {**REMOTE, "remote_num_tokens": remote_num_tokens}
    s, c, r = _loading(params=params, max_tokens=2)
    assert c.alloc_calls[-1][2] == remote_num_tokens
    assert r.num_computed_tokens == remote_num_tokens
    step(s, finished_recving={r.request_id})
    out, outputs = step(s)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == remote_num_tokens
    assert out.num_scheduled_tokens == {r.request_id: 10 - remote_num_tokens}
    assert len(outputs) == 1 and len(outputs[0].new_token_ids) == 1
    drain(s)


def test_remote_load_starts_after_the_local_prefix_hit() -> None:
    s, c = _decode_side()
    prompt = list(range(300, 314))
    first = make_request(prompt[:9], max_tokens=1)  # caches two blocks (8 tokens)
    s.add_request(first)
    run_to_completion(s)
    r = make_request(prompt, kv_transfer_params=dict(REMOTE), max_tokens=2)
    _start_load(s, r)
    assert c.alloc_calls[-1][2] == 14 - 8
    assert r.num_computed_tokens == 14
    assert r.num_cached_tokens == 14
    step(s, finished_recving={r.request_id})
    out, _ = step(s)
    assert out.num_scheduled_tokens == {r.request_id: 1}
    drain(s)


# -- failed loads (DESIGN §4.2, reference §4.5) ------------------------------------------------


def test_failed_load_recompute_prefills_locally() -> None:
    s, c, r = _loading(max_tokens=3)  # kv_load_failure_policy defaults to "recompute"
    out, outputs = step(s, failed_recving={r.request_id})
    assert not outputs
    assert (r.status, r.num_computed_tokens) == (RequestStatus.WAITING, 0)
    assert r.kv_transfer_params is not None and not r.kv_transfer_params["do_remote_prefill"]
    assert used_blocks(s) == 0  # the load ended: its blocks held nothing valid
    out, outputs = step(s)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 0
    assert out.num_scheduled_tokens == {r.request_id: 10}
    assert c.alloc_calls[-1][2] == 0
    assert len(outputs) == 1 and outputs[0].new_token_ids == [7]
    produced = run_to_completion(s)
    assert produced[r.request_id] == [7, 7]
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert [call[1] for call in c.finished_calls] == [RequestStatus.FINISHED_LENGTH_CAPPED]
    assert_all_free(s)


def test_failed_load_fail_policy_ends_with_error() -> None:
    s, c, r = _loading(kv_load_failure_policy="fail")
    out, outputs = step(s, failed_recving={r.request_id})
    (o,) = outputs
    assert o.request_id == r.request_id and o.new_token_ids == []
    assert o.finish_reason is not None and o.finish_reason.value == "error"
    assert o.error
    assert r.status == RequestStatus.FINISHED_ERROR
    assert [call[:2] for call in c.finished_calls] == [(r.request_id, RequestStatus.FINISHED_ERROR)]
    assert_all_free(s)
    out, outputs = step(s)
    assert r.request_id in out.finished_req_ids and not outputs


def test_failed_report_after_promotion_is_ignored() -> None:
    s, c, r = _loading(max_tokens=2)
    step(s, finished_recving={r.request_id})
    step(s, failed_recving={r.request_id})  # promoted and running by now
    assert r.status == RequestStatus.RUNNING and r.num_output_tokens == 1
    run_to_completion(s)
    assert len(c.finished_calls) == 1
    assert_all_free(s)


# -- aborts during a load (reference §1.9, §7 "P/D aborts") ------------------------------------


@pytest.mark.parametrize("report", ["finished_recving", "failed_recving"])
def test_abort_during_load_holds_blocks_until_the_load_ends(report: str) -> None:
    s, c, r = _loading()
    block_ids = s.kv_cache_manager.get_block_ids(r.request_id)
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    assert r.status == RequestStatus.FINISHED_ABORTED
    assert r not in s.holding and s.get_num_unfinished_requests() == 0
    assert [call[:2] for call in c.finished_calls] == [
        (r.request_id, RequestStatus.FINISHED_ABORTED)
    ]
    # The worker may still be writing into the blocks: they must not be reused yet.
    other = make_request(list(range(500, 600)), max_tokens=1)  # needs 25 of the 64 blocks
    s.add_request(other)
    out, _ = step(s)
    assert r.request_id in out.finished_req_ids
    assert not set(out.scheduled_new_reqs[0].block_ids) & set(block_ids)
    assert s.kv_cache_manager.get_block_ids(r.request_id) == block_ids
    run_to_completion(s)
    assert used_blocks(s) == 3 and r.request_id in s.requests
    if report == "finished_recving":
        step(s, finished_recving={r.request_id})
    else:
        step(s, failed_recving={r.request_id})
    assert len(c.finished_calls) == 2  # the abort and `other`; never twice for r
    assert_all_free(s)


def test_abort_after_load_reported_frees_at_once() -> None:
    s, c, r = _loading()
    step(s, finished_recving={r.request_id})
    s.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)
    assert len(c.finished_calls) == 1
    assert_all_free(s)
    out, _ = step(s)
    assert out.total_num_scheduled_tokens == 0 and r.request_id in out.finished_req_ids


def test_abort_all_with_a_load_in_flight() -> None:
    s, c = _decode_side()
    loading = make_request(10, kv_transfer_params=dict(REMOTE))
    _start_load(s, loading)
    running = make_request(8)
    queued = make_request(8)
    s.add_request(running)
    step(s)
    s.add_request(queued)
    s.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert s.get_num_unfinished_requests() == 0
    assert list(s.requests) == [loading.request_id]
    assert used_blocks(s) == 3
    step(s, finished_recving={loading.request_id})
    assert sorted(call[0] for call in c.finished_calls) == sorted(
        [loading.request_id, running.request_id, queued.request_id]
    )
    assert_all_free(s)


# -- holding before waiting (reference §1.5, §7 #45388) ----------------------------------------


def test_loaded_request_is_admitted_before_better_priority_waiting_request() -> None:
    s, _ = _decode_side(policy="priority", max_num_seqs=2)
    a = make_request(list(range(600, 608)), priority=0, max_tokens=3)
    r = make_request(10, priority=1, kv_transfer_params=dict(REMOTE))
    s.add_request(a)
    s.add_request(r)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {a.request_id: 8}
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    b = make_request(list(range(700, 708)), priority=0, max_tokens=1)
    s.add_request(b)
    out, _ = step(s, finished_recving={r.request_id})  # b takes the second slot, finishes
    assert out.num_scheduled_tokens == {a.request_id: 1, b.request_id: 8}
    w = make_request(8, priority=0)  # better priority than r, queued before r is promoted
    s.add_request(w)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {a.request_id: 1, r.request_id: 1}
    assert w.status == RequestStatus.WAITING
    drain(s)


def test_a_remote_load_leaves_a_running_prefill_the_blocks_it_still_needs() -> None:
    """A long prompt prefills in chunks; remote loads arrive meanwhile. A load holds its
    blocks until it lands and cannot be preempted, so it is admitted only with the running
    prefill's remaining blocks left free (vLLM's reserved blocks): the prefill completes
    without being preempted (it was, and stalled behind the loads). Reference §1.5."""
    from tests.scheduler.helpers import add

    s, _ = _decode_side(
        num_blocks=14, max_num_batched_tokens=32, max_model_len=48, long_prefill_token_threshold=8
    )
    r = add(s, "R", 40, max_tokens=1)  # 10 blocks, 8 tokens a step
    add(s, "X", 1, max_tokens=1)  # (not alone: a lone request takes the whole budget)
    step(s)
    loads = [add(s, f"L{k}", 16, kv_transfer_params=dict(REMOTE), max_tokens=2) for k in range(2)]
    for _ in range(4):
        step(s)
    assert r.is_finished and r.num_preemptions == 0  # its whole prompt, once
    # One load fits beside what the prefill still needed; the other waited for room.
    waiting = [RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING]
    assert [x.status for x in loads] == waiting
    _land_loads_and_drain(s)


def test_a_remote_load_leaves_a_request_recomputing_its_outputs_the_blocks_it_needs() -> None:
    """The same for a request that recomputes outputs as well as its prompt (moved here, or
    resumed after a preemption), once it is past its prompt: it still needs blocks."""
    from tests.scheduler.helpers import add

    s, _ = _decode_side(
        num_blocks=16, max_num_batched_tokens=32, max_model_len=48, long_prefill_token_threshold=8
    )
    add(s, "X", 1, max_tokens=8)  # older: R is the one a shortage would preempt
    r = add(s, "R", 24, max_tokens=17, output_token_ids=[7] * 16)  # 40 to compute again
    for _ in range(3):
        step(s)
    assert r.num_computed_tokens == r.num_prompt_tokens == 24  # 16 outputs still to compute
    # The next step takes 2 more blocks for R first; the load would then take 6 of the 7
    # left, and R's last 2 would not fit in the step after.
    assert s.kv_cache_manager.block_pool.num_free_blocks == 9
    load = add(s, "L", 24, kv_transfer_params=dict(REMOTE), max_tokens=2)
    step(s)
    step(s)
    assert r.is_finished and r.num_preemptions == 0
    assert load.status == RequestStatus.WAITING  # it waited for the room R needed
    _land_loads_and_drain(s)


def test_loads_done_together_are_admitted_best_priority_first() -> None:
    """Two remote loads end in one step with one slot free: under the priority policy the
    better one takes it (the worse one, loaded first, took it, and the better one then
    preempted a running request that ranks above the worse one)."""
    from tests.scheduler.helpers import InMemoryConnector, add, make_scheduler, step

    s = make_scheduler(connector=InMemoryConnector(), max_num_seqs=2, policy="priority")
    add(s, "A", 8, priority=1, max_tokens=50)
    step(s)
    add(s, "worse", 8, priority=3, kv_transfer_params={"do_remote_prefill": True})
    step(s)
    add(s, "better", 8, priority=0, kv_transfer_params={"do_remote_prefill": True})
    step(s)
    step(s, finished_recving={"worse", "better"})
    out, _ = step(s)
    assert not out.preempted_req_ids  # A keeps its slot
    assert sorted(r.request_id for r in s.running) == ["A", "better"]
    assert [r.request_id for r in s.holding] == ["worse"]  # loaded, waits for a slot


def test_a_loaded_request_is_not_released_for_a_worse_priority_running_request() -> None:
    """Priority: a running request short of blocks preempts the worst running request
    rather than release a loaded request that ranks above it, as vLLM keeps a loaded
    request's blocks and preempts the lowest-priority running one. It released it: the
    better request lost its loaded KV and waited, in the queue, until the worse finished."""
    from tests.scheduler.helpers import add

    s, _ = _decode_side(
        policy="priority",
        num_blocks=12,
        max_num_seqs=2,
        max_num_batched_tokens=8,
        max_model_len=48,
    )
    better = add(s, "H", 8, priority=0, max_tokens=4, kv_transfer_params=dict(REMOTE))
    step(s)  # its load starts: 2 blocks
    add(s, "L", 40, priority=5, max_tokens=4)  # 10 blocks, 8 tokens a step
    step(s, finished_recving={"H"})
    for _ in range(4):  # L's prefill takes the whole budget: H, loaded, waits
        step(s)
    assert s.holding == [better] and not better.awaiting_remote_kvs
    out, _ = step(s)  # L's first decode needs a 13th block
    assert out.preempted_req_ids == {"L"}
    assert s.holding == [better] and better.num_preemptions == 0
    out, _ = step(s)
    assert out.num_scheduled_tokens["H"] == 1  # continues from its loaded KV
    _land_loads_and_drain(s)


def test_a_step_that_released_a_loaded_request_for_kv_space_admits_nobody() -> None:
    """KV ran short and a loaded request gave its blocks back: as after a preemption (vLLM
    admits nobody in a step that preempted), the step admits no waiting request -- a newer
    one took the blocks just freed, ahead of the released request and the running one that
    needed them."""
    from tests.scheduler.helpers import add

    s, _ = _decode_side(num_blocks=12, max_num_seqs=3, max_num_batched_tokens=8, max_model_len=48)
    loaded = add(s, "H", 8, max_tokens=4, kv_transfer_params=dict(REMOTE))
    step(s)  # its load starts: 2 blocks
    add(s, "L", 40, max_tokens=4)  # 10 blocks, 8 tokens a step
    step(s, finished_recving={"H"})
    for _ in range(4):  # L's prefill takes the whole budget: H, loaded, waits
        step(s)
    assert s.holding == [loaded]
    add(s, "W", 2, max_tokens=4)  # a small newcomer: one block
    out, _ = step(s)  # L's first decode needs a 13th block: H gives its two back
    assert loaded in s.waiting and "L" in out.num_scheduled_tokens
    assert "W" not in out.num_scheduled_tokens  # not this step
    _land_loads_and_drain(s)
