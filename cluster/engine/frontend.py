"""Turning a user's prompt into scheduler requests: tokenize, validate, stop ids, ``n`` fan-out.

Shared by the in-process ``LLMEngine`` and the cluster's clients (vLLM's input processor): the
scheduler and the SchedulerActor deal only in token ids and ``n == 1`` requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from actors.model.tokenizer import Tokenizer
from actors.structured_output import compiler_for
from scheduler import LoRARequest, Request, SamplingParams


@dataclass(frozen=True)
class PreparedRequest:
    """One user request: its text, its token ids and the ``n`` scheduler requests it fans out to
    (``{id}#{i}`` when n > 1; sample ``i`` of a seeded request uses ``seed + i``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    requests: list[Request]


class RequestFactory:
    """Validates prompts against one model and builds its scheduler requests."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: list[int],
        priority_scheduling: bool = True,
    ) -> None:
        """``priority_scheduling``: some scheduler orders its queue by priority (vLLM's
        ``policy: priority``); without it a request's ``priority`` is refused, not ignored."""
        self.tokenizer = tokenizer
        self.priority_scheduling = priority_scheduling
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # EOS: the tokenizer's, else the config's first; the config's other EOS ids stop too.
        eos = tokenizer.eos_token_id  # (0 is an id)
        self.eos_token_id = (
            eos if eos is not None else (eos_token_ids[0] if eos_token_ids else None)
        )
        self.extra_stop_ids = tuple(e for e in eos_token_ids if e != self.eos_token_id)

    def prepare(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        child_ids: list[str],
        prompt_index: int = 0,
    ) -> PreparedRequest:
        """Raises ``ValueError`` naming the problem for an empty, too long or out-of-vocabulary
        prompt, or structured outputs whose spec does not compile. ``child_ids`` are the
        scheduler ids, one per sample; ``prompt_index``: see ``EngineClient.generate_async``."""
        params = params or SamplingParams()
        if priority != 0 and not self.priority_scheduling:
            raise ValueError(
                f"priority {priority} needs priority scheduling (the scheduler's policy: "
                "priority); every scheduler here serves in arrival order (fcfs)"
            )
        if params.structured_outputs is not None:  # a spec that cannot compile: refused now
            compiler = compiler_for(self.tokenizer, self.tokenizer.vocab_size)
            compiler.compile(params.structured_outputs)
        if isinstance(prompt, str):
            text: str | None = prompt
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            text, prompt_ids = None, [int(t) for t in prompt]
        self.validate(prompt_ids)
        # The config's other EOS ids stop a request as its EOS does: not with ignore_eos (as
        # vLLM adds them only then).
        extra = () if params.ignore_eos else self.extra_stop_ids
        stop_ids = tuple(params.stop_token_ids) + tuple(
            e for e in extra if e not in params.stop_token_ids
        )
        now = time.monotonic() if arrival_time is None else arrival_time
        requests = []
        for i, child_id in enumerate(child_ids):
            update: dict[str, Any] = {"n": 1, "stop_token_ids": stop_ids}
            if i > 0 and params.prompt_logprobs is not None:
                update["prompt_logprobs"] = None  # one sample computes them for all
            if params.seed is not None:
                update["seed"] = params.seed + i
            requests.append(
                Request(
                    request_id=child_id,
                    prompt_token_ids=prompt_ids,
                    sampling_params=params.model_copy(update=update),
                    eos_token_id=self.eos_token_id,
                    arrival_time=now,
                    priority=priority,
                    lora_request=lora_request,
                    num_samples=len(child_ids),
                    sample_index=i,
                    prompt_index=prompt_index,
                )
            )
        return PreparedRequest(request_id, text, prompt_ids, params, requests)

    def validate(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; max_model_len is {self.max_model_len} "
                f"(at least one must be left to generate)"
            )
