"""KV-connector hooks on the prefill side, and a prefill -> decode hand-off (DESIGN §2, §3.2;
reference §1.8, §4.1, §4.4).

A request with ``do_remote_decode`` that stops or reaches its length keeps its blocks after it
finishes (``delay_free``) until the decode side has read them (``finished_sending``, reported by
the test playing the worker); its final output carries the ``kv_transfer_params``.
"""

from __future__ import annotations

from typing import Any

import pytest

from scheduler import Request, RequestStatus, Scheduler
from scheduler.kv_cache_manager import cdiv
from tests.scheduler.helpers import (
    EOS,
    InMemoryConnector,
    assert_all_free,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
    used_blocks,
)

# -- prefill side: request_finished and delayed free -------------------------------------------


class _CheckingConnector(InMemoryConnector):
    """Also records whether the request still held its blocks when it was reported finished."""

    def __init__(self, s_ref: list[Scheduler]) -> None:
        super().__init__()
        self.s_ref = s_ref
        self.held_at_finish: list[list[int]] = []

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.held_at_finish.append(self.s_ref[0].kv_cache_manager.get_block_ids(request.request_id))
        return super().request_finished(request, block_ids)


def _prefill_side(**sched: Any) -> tuple[Scheduler, _CheckingConnector]:
    ref: list[Scheduler] = []
    c = _CheckingConnector(ref)
    ref.append(make_scheduler(connector=c, **sched))
    return ref[0], c


def test_prefill_side_delays_free_until_finished_sending() -> None:
    s, c = _prefill_side()
    r = make_request(10, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    s.add_request(r)
    out, outputs = step(s, tokens={r.request_id: [55]})
    block_ids = out.scheduled_new_reqs[0].block_ids
    assert len(block_ids) == 3
    assert c.finished_calls == [(r.request_id, RequestStatus.FINISHED_LENGTH_CAPPED, block_ids)]
    assert c.held_at_finish == [block_ids]  # called before the free
    (o,) = outputs
    assert o.finish_reason is not None and o.finish_reason.value == "length"
    assert o.new_token_ids == [55]
    assert o.kv_transfer_params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": block_ids,
        "remote_num_tokens": 10,
    }
    # Finished for the client, but its blocks are held for the decode side to read.
    for i in range(3):
        later, _ = step(s)
        if i == 0:
            assert later.finished_req_ids == {r.request_id}
        assert later.total_num_scheduled_tokens == 0
        assert r.request_id in s.requests and r not in s.running
        assert s.get_num_unfinished_requests() == 0
        assert s.kv_cache_manager.get_block_ids(r.request_id) == block_ids
        assert used_blocks(s) == 3
    # A late abort of an already finished request is ignored (PR #25067).
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and used_blocks(s) == 3
    step(s, finished_sending={r.request_id})
    assert len(c.finished_calls) == 1
    assert_all_free(s)


@pytest.mark.parametrize("lookahead", [0, 3])
def test_request_finished_block_ids_cover_the_computed_tokens(lookahead: int) -> None:
    s, c = _prefill_side(num_lookahead_slots=lookahead)
    r = make_request(12, max_tokens=5, kv_transfer_params={"do_remote_decode": True})
    s.add_request(r)
    produced = run_to_completion(s)
    assert produced[r.request_id] == [7] * 5
    (call,) = c.finished_calls
    # 12 prompt tokens + 4 decoded inputs = 16 computed: exactly 4 blocks, lookahead excluded.
    assert r.num_computed_tokens == 16
    assert call[2] == c.held_at_finish[0][: cdiv(16, 4)]
    assert len(call[2]) == 4
    step(s, finished_sending={r.request_id})
    assert_all_free(s)


def test_stopped_prefill_request_partial_tail_block_included() -> None:
    s, c = _prefill_side()
    r = make_request(9, max_tokens=8, kv_transfer_params={"do_remote_decode": True})
    s.add_request(r)
    step(s)
    step(s, tokens={r.request_id: [EOS]})
    assert r.status == RequestStatus.FINISHED_STOPPED
    assert r.num_computed_tokens == 10  # 9 prompt + 1 decoded input
    (call,) = c.finished_calls
    assert len(call[2]) == 3 and call[2] == c.held_at_finish[0][:3]
    assert used_blocks(s) == 3
    step(s, finished_sending={r.request_id})
    assert_all_free(s)


def test_aborted_prefill_request_is_not_delayed() -> None:
    s, c = _prefill_side(max_num_batched_tokens=8, max_num_seqs=4)
    r = make_request(20, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    s.add_request(r)
    step(s)  # first chunk of 8
    assert r.num_computed_tokens == 8
    s.finish_requests([r.request_id], RequestStatus.FINISHED_ABORTED)
    assert c.finished_calls == [
        (r.request_id, RequestStatus.FINISHED_ABORTED, c.held_at_finish[0][:2])
    ]
    assert_all_free(s)
    out, _ = step(s)
    assert r.request_id in out.finished_req_ids
    assert len(c.finished_calls) == 1


def test_finished_sending_for_a_running_request_is_ignored() -> None:
    s, _ = _prefill_side()
    r = make_request(7, max_tokens=3, kv_transfer_params={"do_remote_decode": True})
    s.add_request(r)
    step(s, finished_sending={r.request_id})
    assert r.status == RequestStatus.RUNNING and used_blocks(s) == 2
    run_to_completion(s)
    assert used_blocks(s) == 3
    step(s, finished_sending={r.request_id})
    assert_all_free(s)


# -- end to end: prefill instance -> decode instance (DESIGN §2) -------------------------------


def test_prefill_to_decode_hand_off() -> None:
    cp, cd = InMemoryConnector(), InMemoryConnector()
    p, d = make_scheduler(connector=cp), make_scheduler(connector=cd)
    prompt = list(range(400, 414))
    p_req = make_request(
        prompt, req_id="pd", max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )
    p.add_request(p_req)
    out, outputs = step(p, tokens={"pd": [61]})
    p_blocks = out.scheduled_new_reqs[0].block_ids
    (first,) = outputs
    assert first.new_token_ids == [61] and first.finished
    params = first.kv_transfer_params
    assert params is not None and params["remote_block_ids"] == p_blocks
    assert used_blocks(p) == 4

    d_req = make_request(prompt, req_id="pd", max_tokens=4, kv_transfer_params=params)
    d.add_request(d_req)
    out, _ = step(d)
    d_blocks = d.kv_cache_manager.get_block_ids("pd")
    assert out.kv_connector_metadata.loads == {"pd": (d_blocks, 14)}
    # The D worker reads P's blocks; both sides report the transfer done.
    step(d, finished_recving={"pd"})
    step(p, finished_sending={"pd"})
    assert_all_free(p)
    tokens: list[int] = []
    out, outputs = step(d, tokens={"pd": [61]})
    assert out.scheduled_new_reqs[0].num_computed_tokens == 13
    tokens += outputs[0].new_token_ids
    for i in range(3):
        _, outputs = step(d, tokens={"pd": [62 + i]})
        tokens += outputs[0].new_token_ids
    assert tokens == [61, 62, 63, 64]
    assert outputs[0].finished and d_req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert [call[:2] for call in cp.finished_calls] == [
        ("pd", RequestStatus.FINISHED_LENGTH_CAPPED)
    ]
    assert_all_free(d)
