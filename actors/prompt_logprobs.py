"""Prompt logprobs (vLLM's ``prompt_logprobs``): for each prompt token after the first, its
logprob under the model, its rank and the top ``k`` tokens, computed by the worker for the
prompt chunks of the requests that asked (``SamplingParams.prompt_logprobs``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from scheduler.request import PromptLogprob, SamplingParams

# Prompt positions whose logits are computed at once (64 x a 152k vocabulary: ~120 MB of
# float32 for the logits and their log-softmax).
SLICE = 64


class _Request(Protocol):
    req_id: str
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    wants_prompt_logprobs: bool  # false when they were sent elsewhere (P/D, a move)


class _Chunk(Protocol):
    @property
    def state(self) -> _Request: ...

    @property
    def start(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


class _Model(Protocol):
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def prompt_logprobs(
    model: _Model, batch: Sequence[_Chunk], hidden: torch.Tensor
) -> dict[str, tuple[int, list[PromptLogprob]]] | None:
    """For the requests that asked: each prompt token this step's chunk predicts (the one
    after each input position), as ``{req_id: (its prompt position, entries)}``. ``hidden``
    holds the batch's rows in order; logits are taken ``SLICE`` positions at a time, so a
    long chunk never holds a [tokens, vocab] tensor whole."""
    result: dict[str, tuple[int, list[PromptLogprob]]] = {}
    row = 0
    for s in batch:
        first, row = row, row + s.num_tokens
        request = s.state
        k = request.params.prompt_logprobs
        end = min(s.start + s.num_tokens, request.num_prompt_tokens - 1)
        if k is None or end <= s.start or not request.wants_prompt_logprobs:
            continue
        targets = request.token_ids[s.start + 1 : end + 1]
        entries: list[PromptLogprob] = []
        for lo in range(0, len(targets), SLICE):
            part = targets[lo : lo + SLICE]
            h = hidden[first + lo : first + lo + len(part)]
            logp = model.compute_logits(h).float().log_softmax(dim=-1)
            own_ids = torch.tensor(part, device=logp.device)
            own = logp.gather(1, own_ids[:, None])
            # vLLM's rank: tokens at least as likely, itself included (ties count ahead)
            ranks = (logp >= own).sum(dim=-1).tolist()
            top_values, top_ids = logp.topk(k, dim=-1)  # k = 0: empty
            # One copy to Python per slice (a sync per row costs 7x on a GPU).
            values, ids, owns = top_values.tolist(), top_ids.tolist(), own[:, 0].tolist()
            for j, token in enumerate(part):
                entry = dict(zip(ids[j], values[j], strict=True))
                entry[token] = owns[j]
                entries.append((entry, ranks[j]))
        result[request.req_id] = (s.start + 1, entries)
    return result or None
