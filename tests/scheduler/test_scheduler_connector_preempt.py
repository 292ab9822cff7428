"""Remote KV loads and preemption on the decode side (reference §1.4, §4.3 step 4, §4.5).

A preempted request keeps its output tokens, so however it gets its KV back -- a load
reported done, a load that failed and fell back to recompute, or local recompute -- it must
reach the worker as *resumed* (``resumed_token_ids`` = prompt + outputs), never as a new
request, whose ``NewRequestData`` carries only the prompt.
"""

from __future__ import annotations

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
)


class _OffloadConnector(InMemoryConnector):
    """Loads the whole prompt asynchronously for every ``offloaded`` request, every time it is
    admitted (a CPU-offload store, say): a preempted request is loaded again."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        # The scheduler sets do_remote_prefill=False when it falls back to recomputing.
        if not params.get("offloaded") or params.get("do_remote_prefill") is False:
            return 0, False
        count = max(request.num_prompt_tokens - num_computed_tokens, 0)
        return count, count > 0


def _preempt_remote_request(s: Scheduler, r: Request) -> None:
    """Run ``r`` (its loads reported done at once) next to a long local request until the
    KV pressure preempts ``r``."""
    s.add_request(make_request(list(range(300, 316)), max_tokens=20))
    s.add_request(r)
    for _ in range(40):
        recv = {r.request_id} if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS else None
        out, _ = step(s, finished_recving=recv)
        if r.request_id in out.preempted_req_ids:
            return
    raise AssertionError("the scenario must preempt the remote request")


def _offloaded_and_preempted() -> tuple[Scheduler, _OffloadConnector, Request]:
    """An ``offloaded`` request (10-token prompt, 20 to generate) preempted by KV pressure."""
    c = _OffloadConnector()
    s = make_scheduler(
        connector=c,
        prefix_caching=False,
        num_blocks=10,
        max_model_len=40,
        max_num_batched_tokens=40,
    )
    r = make_request(10, kv_transfer_params={"offloaded": True}, max_tokens=20)
    _preempt_remote_request(s, r)
    return s, c, r


def _resume(s: Scheduler, r: Request) -> SchedulerOutput:
    for _ in range(40):
        recv = {r.request_id} if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS else None
        out, _ = step(s, finished_recving=recv)
        if r.request_id in out.num_scheduled_tokens:
            return out
    raise AssertionError("the preempted request was never resumed")


def test_preempted_request_loaded_again_is_resumed_not_new() -> None:
    """Reference §4.3 step 4: a finished load sets WAITING, "or PREEMPTED if it was
    preempted", so the worker gets the request's whole token list back."""
    s, c, r = _offloaded_and_preempted()
    out = _resume(s, r)
    loads = [call for call in c.alloc_calls if call[0] == r.request_id]
    assert [call[2] for call in loads] == [10, 10]  # loaded again after the preemption
    assert r.request_id not in [n.req_id for n in out.scheduled_new_reqs]
    cached = out.scheduled_cached_reqs
    i = cached.req_ids.index(r.request_id)
    assert cached.resumed_from_preemption[i]
    assert cached.num_computed_tokens[i] == 10
    assert cached.resumed_token_ids[r.request_id] == r.all_token_ids[:-1]
    assert out.num_scheduled_tokens[r.request_id] == len(r.all_token_ids) - 1 - 10
    run_to_completion(s)
    assert len(r.output_token_ids) == 20
    assert_all_free(s)


def test_preempted_request_whose_reload_fails_is_resumed_not_new() -> None:
    """Recomputing after a failed load must not forget the preemption either: the request
    has outputs, and NewRequestData would carry only its prompt."""
    s, _, r = _offloaded_and_preempted()
    while r.status != RequestStatus.WAITING_FOR_REMOTE_KVS:  # the reload starts
        step(s)
        assert s.num_steps < 60
    num_outputs = r.num_output_tokens
    assert num_outputs > 0
    step(s, failed_recving={r.request_id})
    out = _resume(s, r)
    assert r.request_id not in [n.req_id for n in out.scheduled_new_reqs]
    cached = out.scheduled_cached_reqs
    i = cached.req_ids.index(r.request_id)
    assert cached.resumed_from_preemption[i] and cached.num_computed_tokens[i] == 0
    assert cached.resumed_token_ids[r.request_id][10:] == r.output_token_ids[:num_outputs]
    run_to_completion(s)
    assert len(r.output_token_ids) == 20
    assert_all_free(s)


def test_completed_remote_load_is_not_repeated_after_preemption() -> None:
    c = InMemoryConnector()
    s = make_scheduler(connector=c, num_blocks=10, max_model_len=40, max_num_batched_tokens=40)
    r = make_request(10, kv_transfer_params=dict(REMOTE), max_tokens=20)
    _preempt_remote_request(s, r)
    out = _resume(s, r)
    # The prefill side's copy was consumed: the preempted request recomputes locally.
    assert [call[2] for call in c.alloc_calls if call[0] == r.request_id] == [10, 0]
    assert r.kv_transfer_params is not None and not r.kv_transfer_params["do_remote_prefill"]
    cached = out.scheduled_cached_reqs
    assert cached.resumed_from_preemption[cached.req_ids.index(r.request_id)]
    drain(s)
