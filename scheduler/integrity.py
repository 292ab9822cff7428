"""Invariants of a scheduler as code: run by tests after every scenario and by the engine
when idle in debug mode."""

from __future__ import annotations

from scheduler.remote_kv import RemoteKV
from scheduler.request import RequestStatus
from scheduler.state import SchedulerState


def check_scheduler_integrity(state: SchedulerState, remote_kv: RemoteKV) -> None:
    """Raise ``AssertionError`` if the queues, statuses or block tables disagree: the block
    pool's own invariants; running <= max_num_seqs; every queued request in the queue its
    status allows, in one queue only, and known; waiting requests hold no blocks; requests in
    no queue are finished (their blocks await a send or a load); adapters <= max_loras; the
    remote-KV bookkeeping agrees with the requests. Mutates nothing."""
    state.kv_cache_manager.check_integrity()
    cfg = state.scheduler_config
    assert len(state.running) <= cfg.max_num_seqs, "more running requests than max_num_seqs"
    seen: set[str] = set()
    for requests, allowed in (
        (state.running, {RequestStatus.RUNNING}),
        (list(state.waiting), {RequestStatus.WAITING, RequestStatus.PREEMPTED}),
        (
            state.holding,
            {
                RequestStatus.WAITING,
                RequestStatus.PREEMPTED,
                RequestStatus.WAITING_FOR_REMOTE_KVS,
            },
        ),
    ):
        for request in requests:
            assert request.status in allowed, f"{request} is in the wrong queue"
            assert request.request_id not in seen, f"{request} is in two queues"
            assert state.requests.get(request.request_id) is request, f"{request} is unknown"
            seen.add(request.request_id)
    for request in state.waiting:
        assert request.request_id not in state.kv_cache_manager.req_to_blocks, (
            f"{request} is waiting but holds blocks"
        )
        assert request.num_computed_tokens == 0, f"{request} is waiting with computed tokens"
    for request in state.running:
        assert request.kv_slots >= request.num_computed_tokens, (
            f"{request} has computed more tokens than its blocks hold"
        )
    for queue in state.discarded_in_flight.values():
        assert queue and all(r.num_in_flight_tokens > 0 for r in queue), (
            "a discarded request has no output in flight"
        )
    remote_kv.check_integrity()
    for req_id, request in state.requests.items():
        if req_id not in seen:
            assert request.is_finished, f"{request} is in no queue but not finished"
    if state.lora_config is not None:
        loras = {r.lora_int_id for r in state.running if r.lora_request is not None}
        assert len(loras) <= state.lora_config.max_loras, "more adapters than max_loras"
    for req_id in state.kv_cache_manager.req_to_blocks:
        assert req_id in state.requests, f"blocks held for unknown request {req_id!r}"
    for request in state.requests.values():
        state.kv_cache_manager.check_hint(request)
