"""Requests that arrive with outputs already produced: the decode side of a P/D hand-off
(the prefill instance sampled the first token) and a request moved to another instance."""

from __future__ import annotations

import pytest

from scheduler import RequestStatus
from tests.scheduler.helpers import (
    InMemoryConnector,
    assert_all_free,
    make_request,
    make_scheduler,
    run_to_completion,
    step,
)


def test_decode_side_continues_after_the_prefill_token() -> None:
    """P computed 10 prompt tokens and sampled 61; D loads the 10 tokens' KV, computes only
    61 and samples the second token: nothing is recomputed and no token is sampled twice."""
    s = make_scheduler(connector=InMemoryConnector())
    prompt = list(range(300, 310))
    r = make_request(
        prompt,
        req_id="d",
        max_tokens=4,
        output_token_ids=[61],
        kv_transfer_params={"do_remote_prefill": True, "remote_num_tokens": len(prompt)},
    )
    s.add_request(r)
    out, outputs = step(s)
    assert out.num_scheduled_tokens == {}
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert r.num_computed_tokens == len(prompt)
    step(s, finished_recving={"d"})  # the load is reported with this step's output
    out, outputs = step(s, tokens={"d": [62]})
    assert out.num_scheduled_tokens == {"d": 1}  # only the first output token's KV
    (new,) = out.scheduled_new_reqs
    assert new.prompt_token_ids == prompt and new.output_token_ids == [61]
    assert new.num_computed_tokens == len(prompt)
    assert [o.new_token_ids for o in outputs] == [[62]]
    produced = run_to_completion(s)
    # max_tokens counts the token the prefill instance produced: 61, 62 + 2 more.
    assert r.output_token_ids[:2] == [61, 62] and len(r.output_token_ids) == 4
    assert len(produced["d"]) == 2
    assert r.get_finished_reason() is not None
    assert_all_free(s)


def test_moved_request_recomputes_prompt_and_outputs_then_continues() -> None:
    s = make_scheduler(max_num_batched_tokens=64)
    r = make_request(12, req_id="m", max_tokens=5, output_token_ids=[40, 41, 42])
    s.add_request(r)
    out, outputs = step(s, tokens={"m": [43]})
    assert out.num_scheduled_tokens == {"m": 15}  # prompt + the 3 outputs, one prefill
    assert out.scheduled_new_reqs[0].output_token_ids == [40, 41, 42]
    assert [o.new_token_ids for o in outputs] == [[43]]
    out, outputs = step(s, tokens={"m": [44]})
    assert out.scheduled_cached_reqs.new_token_ids == [[43]]
    assert outputs[0].finished and outputs[0].finish_reason == "length"
    assert r.output_token_ids == [40, 41, 42, 43, 44]
    assert_all_free(s)


def test_outputs_that_already_fill_max_tokens_or_the_context_are_rejected() -> None:
    s = make_scheduler(max_model_len=32)
    with pytest.raises(ValueError, match="max_tokens"):
        s.add_request(make_request(4, max_tokens=2, output_token_ids=[5, 6]))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request(20, max_tokens=None, output_token_ids=[5] * 12))
    assert not s.requests
