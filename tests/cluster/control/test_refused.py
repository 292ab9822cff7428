"""``RefusedRequests``: a user request refused by its first part (the waiting bound) has its
later samples and prompts refused too, as the front end names them (``{id}#{i}`` samples,
``{id}-{k}`` prompts of a batch), for that client only."""

from __future__ import annotations

from cluster.control.remembered import RefusedRequests
from scheduler import Request, SamplingParams


def part(rid: str, prompt: int = 0, sample: int = 0, n: int = 1) -> Request:
    request_id = f"{rid}-{prompt}" if prompt >= 0 else rid
    if n > 1:
        request_id = f"{request_id}#{sample}"
    return Request(
        request_id,
        [1, 2, 3],
        SamplingParams(max_tokens=4),
        num_samples=n,
        sample_index=sample,
        prompt_index=max(prompt, 0),
    )


def test_the_later_parts_of_a_refused_batch_are_refused() -> None:
    refused = RefusedRequests()
    refused.remember("c", part("cmpl-1", prompt=0, n=2))  # its first part: refused
    assert refused.refused("c", part("cmpl-1", prompt=0, sample=1, n=2))  # its sample 1
    assert refused.refused("c", part("cmpl-1", prompt=3, sample=0, n=2))  # its prompt 3
    assert refused.refused("c", part("cmpl-1", prompt=3, sample=1, n=2))
    assert not refused.refused("other", part("cmpl-1", prompt=3, n=2))  # another client's
    assert not refused.refused("c", part("cmpl-2", prompt=1))  # another request


def test_a_single_prompt_request_refused_refuses_its_samples_only() -> None:
    refused = RefusedRequests()
    refused.remember("c", part("chat-7", prompt=-1, n=4))
    assert refused.refused("c", part("chat-7", prompt=-1, sample=2, n=4))
    assert not refused.refused("c", part("chat-8", prompt=-1, sample=1, n=4))


def test_it_is_forgotten_after_its_ttl() -> None:
    refused = RefusedRequests(ttl_s=0.0)
    refused.remember("c", part("cmpl-1"))
    assert not refused.refused("c", part("cmpl-1", prompt=1))
    bounded = RefusedRequests(max_ids=4)
    for i in range(10):
        bounded.remember("c", part(f"cmpl-{i}"))
    assert len(bounded._refused) <= 4 and bounded.refused("c", part("cmpl-9", prompt=2))
