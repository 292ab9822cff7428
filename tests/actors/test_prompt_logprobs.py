"""``prompt_logprobs``: each prompt token's logprob, rank and the top ``k``, as vLLM reports
them -- a rank counts every token at least as likely, the token itself and its ties."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from actors.prompt_logprobs import prompt_logprobs
from scheduler.request import SamplingParams


class _Logits:
    """A model whose logits are one fixed row, whatever the hidden state."""

    def __init__(self, row: list[float]) -> None:
        self.row = torch.tensor(row)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.row.expand(hidden.shape[0], -1)


def _chunk(prompt: list[int], k: int) -> SimpleNamespace:
    request = SimpleNamespace(
        req_id="r",
        params=SamplingParams(max_tokens=1, prompt_logprobs=k),
        token_ids=prompt,
        num_prompt_tokens=len(prompt),
        wants_prompt_logprobs=True,
    )
    return SimpleNamespace(state=request, start=0, num_tokens=len(prompt))


def test_a_rank_counts_the_tokens_tied_with_it_as_vllm_does() -> None:
    model = _Logits([0.0, 5.0, 5.0, 5.0, 1.0])
    result = prompt_logprobs(model, [_chunk([0, 1, 4, 0], k=1)], torch.zeros(4, 8))
    assert result is not None
    start, entries = result["r"]
    assert start == 1
    ranks = [rank for _, rank in entries]
    assert ranks == [3, 4, 5]  # token 1 ties 2 and 3; 4 is fourth; 0 is last
    logp = torch.tensor([0.0, 5.0, 5.0, 5.0, 1.0]).log_softmax(-1)
    entry, _ = entries[1]
    assert entry[4] == float(logp[4])  # its own logprob, beside the top 1
    assert len(entry) == 2
