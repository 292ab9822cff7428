"""RequestStatus / FinishReason, Request token bookkeeping, and the FCFS and priority waiting
queues behind ``create_request_queue``."""

from __future__ import annotations

import pytest

from scheduler import (
    FCFSRequestQueue,
    FinishReason,
    PriorityRequestQueue,
    Request,
    RequestQueue,
    RequestStatus,
    SamplingParams,
    create_request_queue,
)
from tests.scheduler.helpers import lora

FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH_CAPPED,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_IGNORED,
    RequestStatus.FINISHED_ERROR,
}


def req(request_id: str, priority: int = 0, arrival_time: float = 0.0, prompt: int = 4) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(range(10, 10 + prompt)),
        sampling_params=SamplingParams(max_tokens=8),
        eos_token_id=2,
        arrival_time=arrival_time,
        priority=priority,
    )


def ids(queue: RequestQueue) -> list[str]:
    return [r.request_id for r in queue]


def drain(queue: RequestQueue) -> list[str]:
    out = []
    while queue:
        out.append(queue.pop_request().request_id)
    return out


# -- RequestStatus / FinishReason ----------------------------------------------------------------


def test_status_order_matches_vllm() -> None:
    by_value = sorted(RequestStatus)
    assert by_value[:4] == [
        RequestStatus.WAITING,
        RequestStatus.WAITING_FOR_REMOTE_KVS,
        RequestStatus.RUNNING,
        RequestStatus.PREEMPTED,
    ]
    assert set(by_value[4:]) == FINISHED
    assert all(status > RequestStatus.PREEMPTED for status in FINISHED)


@pytest.mark.parametrize("status", list(RequestStatus))
def test_is_finished_exactly_for_finished_states(status: RequestStatus) -> None:
    assert RequestStatus.is_finished(status) == (status in FINISHED)
    r = req("r")
    r.status = status
    assert r.is_finished == (status in FINISHED)


def test_waiting_for_remote_kvs_and_preempted_are_not_finished() -> None:
    assert not RequestStatus.is_finished(RequestStatus.WAITING_FOR_REMOTE_KVS)
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (RequestStatus.FINISHED_STOPPED, FinishReason.STOP),
        (RequestStatus.FINISHED_LENGTH_CAPPED, FinishReason.LENGTH),
        (RequestStatus.FINISHED_ABORTED, FinishReason.ABORT),
        (RequestStatus.FINISHED_IGNORED, FinishReason.LENGTH),
        (RequestStatus.FINISHED_ERROR, FinishReason.ERROR),
        (RequestStatus.WAITING, None),
        (RequestStatus.WAITING_FOR_REMOTE_KVS, None),
        (RequestStatus.RUNNING, None),
        (RequestStatus.PREEMPTED, None),
    ],
)
def test_finish_reason_mapping(status: RequestStatus, reason: FinishReason | None) -> None:
    assert RequestStatus.get_finished_reason(status) == reason
    r = req("r")
    r.status = status
    assert r.get_finished_reason() == reason


def test_finish_reason_values_are_openai_strings() -> None:
    assert [f.value for f in FinishReason] == ["stop", "length", "abort", "error"]
    assert isinstance(FinishReason.STOP, str)
    assert FinishReason("length") is FinishReason.LENGTH


# -- Request -----------------------------------------------------------------------------------


def test_request_initial_state() -> None:
    prompt = [5, 6, 7]
    r = Request("r", prompt, SamplingParams(max_tokens=4, stop_token_ids=(9,)))
    prompt.append(8)  # the request keeps its own copy
    assert r.prompt_token_ids == [5, 6, 7]
    assert (r.num_prompt_tokens, r.num_tokens, r.num_output_tokens) == (3, 3, 0)
    assert r.status == RequestStatus.WAITING
    assert r.num_computed_tokens == 0
    assert r.max_tokens == 4
    assert r.stop_token_ids == frozenset({9})
    assert r.num_cached_tokens is None
    assert r.block_hashes == []
    assert r.lora_int_id == 0
    assert not r.do_remote_prefill


def test_request_lora_and_remote_prefill_views() -> None:
    r = Request("r", [1, 2], SamplingParams(), lora_request=lora(3))
    assert r.lora_int_id == 3
    remote = Request("p", [1, 2], SamplingParams(), kv_transfer_params={"do_remote_prefill": 1})
    assert remote.do_remote_prefill
    other = Request("q", [1, 2], SamplingParams(), kv_transfer_params={"do_remote_decode": 1})
    assert not other.do_remote_prefill


def test_append_output_tokens_int_and_list() -> None:
    r = req("r", prompt=3)
    r.append_output_token_ids(50)
    r.append_output_token_ids([51, 52])
    assert r.output_token_ids == [50, 51, 52]
    assert r.all_token_ids == [10, 11, 12, 50, 51, 52]
    assert (r.num_tokens, r.num_output_tokens, r.num_prompt_tokens) == (6, 3, 3)
    assert r.prompt_token_ids == [10, 11, 12]


def test_trim_output_tokens() -> None:
    r = req("r", prompt=2)
    r.append_output_token_ids([20, 21, 22, 23])
    r.trim_output_tokens(0)
    assert r.num_output_tokens == 4
    r.trim_output_tokens(3)
    assert r.output_token_ids == [20]
    assert r.all_token_ids == [10, 11, 20]
    assert r.num_tokens == 3
    r.trim_output_tokens(1)
    assert r.all_token_ids == r.prompt_token_ids == [10, 11]


# -- FCFS --------------------------------------------------------------------------------------


def test_fcfs_order_and_peek() -> None:
    q = FCFSRequestQueue()
    assert not q
    for name in "abc":
        q.add_request(req(name))
    assert len(q) == 3
    assert ids(q) == ["a", "b", "c"]
    assert q.peek_request().request_id == "a"
    assert len(q) == 3  # peek does not pop
    assert drain(q) == ["a", "b", "c"]


def test_fcfs_ignores_priority_and_arrival() -> None:
    q = FCFSRequestQueue()
    q.add_request(req("late-low", priority=5, arrival_time=9.0))
    q.add_request(req("early-high", priority=-5, arrival_time=1.0))
    assert drain(q) == ["late-low", "early-high"]


@pytest.mark.parametrize(
    "queue_class", [FCFSRequestQueue, PriorityRequestQueue], ids=["fcfs", "priority"]
)
def test_empty_queue_raises(queue_class: type[RequestQueue]) -> None:
    q = queue_class()
    with pytest.raises(IndexError):
        q.peek_request()
    with pytest.raises(IndexError):
        q.pop_request()


def test_fcfs_prepend_puts_request_at_front() -> None:
    q = FCFSRequestQueue()
    q.add_request(req("a"))
    q.add_request(req("b"))
    q.prepend_request(req("p"))
    assert ids(q) == ["p", "a", "b"]


def test_fcfs_prepend_requests_keeps_order() -> None:
    q = FCFSRequestQueue()
    q.add_request(req("c"))
    q.prepend_requests([req("x"), req("y"), req("z")])
    assert drain(q) == ["x", "y", "z", "c"]


def test_fcfs_remove() -> None:
    q = FCFSRequestQueue()
    reqs = {name: req(name) for name in "abcd"}
    for r in reqs.values():
        q.add_request(r)
    q.remove_request(reqs["b"])
    assert ids(q) == ["a", "c", "d"]
    q.remove_requests([reqs["a"], reqs["d"]])
    assert ids(q) == ["c"]
    # Removal is by identity: another object with the same id is not in the queue.
    q.remove_request(req("c"))
    assert ids(q) == ["c"]
    q.remove_requests([])
    assert len(q) == 1


# -- priority ----------------------------------------------------------------------------------


def test_priority_order_by_priority_arrival_then_id() -> None:
    q = PriorityRequestQueue()
    q.add_request(req("d", priority=1, arrival_time=0.0))
    q.add_request(req("c", priority=0, arrival_time=2.0))
    q.add_request(req("b", priority=0, arrival_time=1.0))
    q.add_request(req("a2", priority=0, arrival_time=1.0))
    q.add_request(req("z", priority=-1, arrival_time=5.0))
    assert q.peek_request().request_id == "z"
    assert ids(q) == ["z", "a2", "b", "c", "d"]
    assert len(q) == 5  # iterating does not consume
    assert drain(q) == ["z", "a2", "b", "c", "d"]


def test_priority_prepend_goes_back_to_key_order() -> None:
    q = PriorityRequestQueue()
    q.add_request(req("first", priority=0, arrival_time=0.0))
    q.add_request(req("third", priority=2, arrival_time=0.0))
    # A heap has no front: a worse-priority request is not put ahead of better ones.
    q.prepend_request(req("second", priority=1, arrival_time=9.0))
    assert ids(q) == ["first", "second", "third"]
    q.prepend_requests([req("last", priority=3), req("zeroth", priority=-1)])
    assert drain(q) == ["zeroth", "first", "second", "third", "last"]


def test_priority_pop_then_prepend_restores_head() -> None:
    q = PriorityRequestQueue()
    for i, name in enumerate("abc"):
        q.add_request(req(name, arrival_time=float(i)))
    head = q.pop_request()
    q.prepend_request(head)
    assert ids(q) == ["a", "b", "c"]


def test_priority_remove_keeps_heap_order() -> None:
    q = PriorityRequestQueue()
    reqs = [req(f"r{i}", priority=p, arrival_time=float(i)) for i, p in enumerate([3, 1, 2, 0, 1])]
    for r in reqs:
        q.add_request(r)
    q.remove_requests([reqs[3], reqs[1]])
    assert q.peek_request().request_id == "r4"
    q.remove_request(reqs[4])
    assert drain(q) == ["r2", "r0"]


# -- factory -----------------------------------------------------------------------------------


def test_create_request_queue() -> None:
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)
    assert create_request_queue("fcfs") is not create_request_queue("fcfs")


def test_create_request_queue_unknown_policy() -> None:
    with pytest.raises(ValueError, match="lifo"):
        create_request_queue("lifo")  # type: ignore[arg-type]
