"""``actors.batch.update_requests``: the worker's per-request state from scheduler diffs."""

from __future__ import annotations

from actors.batch import RequestState, update_requests
from scheduler import SamplingParams
from scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput


def _output(
    new: list[NewRequestData], cached: CachedRequestData, n: dict[str, int]
) -> SchedulerOutput:
    return SchedulerOutput(new, cached, n, sum(n.values()), set(), set())


def test_a_request_resumed_after_its_first_output_no_longer_wants_prompt_logprobs() -> None:
    """Its prompt's logprobs went out with its first token: resumed after a preemption, its
    prompt is recomputed for the KV alone (the logits and log-softmax over the vocabulary of
    every prompt position were computed again and thrown away by the scheduler)."""
    params = SamplingParams(max_tokens=8, prompt_logprobs=2)
    requests: dict[str, RequestState] = {}
    new = NewRequestData("r", [1, 2, 3, 4], [], params, [0], 0, None, 2)
    update_requests(requests, _output([new], CachedRequestData(), {"r": 4}))
    assert requests["r"].wants_prompt_logprobs
    early = NewRequestData("q", [1, 2, 3, 4], [], params, [1], 0, None, 2)
    update_requests(requests, _output([early], CachedRequestData(), {"q": 2}))
    resumed = CachedRequestData(
        req_ids=["r", "q"],
        resumed_from_preemption=[True, True],
        new_token_ids=[[], []],
        new_block_ids=[[3, 4], [5]],
        num_computed_tokens=[0, 0],
        resumed_token_ids={"r": [1, 2, 3, 4, 9, 8], "q": [1, 2, 3, 4]},
    )
    update_requests(requests, _output([], resumed, {"r": 6, "q": 4}))
    assert not requests["r"].wants_prompt_logprobs
    assert requests["q"].wants_prompt_logprobs  # no output yet: its prompt's are still due
