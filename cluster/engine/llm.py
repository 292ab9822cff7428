"""``LLM``: offline batch and streaming generation on one machine (vLLM's ``LLM`` shape).

from cluster import LLM, SamplingParams
llm = LLM()                                   # the built-in SmolLM2-135M-Instruct
for out in llm.generate(["Hello"], SamplingParams(max_tokens=32)):
    print(out.outputs[0].text)
"""

from __future__ import annotations

import copy
import itertools
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from cluster.engine.generation_config import sampling_defaults
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.outputs import RequestOutput
from scheduler import LoRARequest, SamplingParams

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """Continuous batching in-process: every prompt is queued at once and the engine steps
    until all are done; a streaming variant yields each request's progress per step."""

    def __init__(
        self, model: str | None = None, *, generation_config: str = "auto", **config: Any
    ) -> None:
        """``generation_config``: vLLM's -- ``auto`` (the model's ``generation_config.json``),
        ``vllm`` (the usual defaults), or a folder holding one: the sampling a call without
        ``sampling_params`` gets (``get_default_sampling_params``)."""
        self.engine = LLMEngine(model, **config)
        self.default_sampling_params = SamplingParams(
            **sampling_defaults(generation_config, self.engine.worker.model_path)
        )
        self._ids = itertools.count()
        # Per live request: its call's outputs not yielded yet (a snapshot: True), see ``_run``.
        self._queues: dict[str, deque[tuple[RequestOutput, bool]]] = {}

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` / ``chat`` use without ``sampling_params`` (vLLM's): the model's
        ``generation_config.json`` values (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens) over the usual defaults."""
        return self.default_sampling_params

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in the prompts' order."""
        ids = self._add(prompts, sampling_params, lora_request, priority)
        final: dict[str, RequestOutput] = {}
        for out in self._run(set(ids)):
            if out.finished:
                final[out.request_id] = out
        return [final[i] for i in ids]

    def generate_stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield a ``RequestOutput`` whenever a request advances (``new_text`` /
        ``new_token_ids`` hold the step's delta). ``abort(request_id)`` may be called while
        iterating; the request then ends with ``finish_reason="abort"``. Leaving the loop
        early aborts whatever is left."""
        ids = self._add(prompts, sampling_params, lora_request, priority)
        yield from self._run(set(ids))

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then ``generate``."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts: list[Prompt] = [tok.encode_chat(list(c)) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, **kwargs)

    def abort(self, request_id: str | list[str]) -> None:
        self._snapshot_pending()  # (an abort changes the outputs in place too)
        self.engine.abort_request(request_id)

    # -- internals --------------------------------------------------------------------------
    def _add(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        lora: LoRARequest | Sequence[LoRARequest | None] | None,
        priority: Sequence[int] | None,
    ) -> list[str]:
        items = _as_list(prompts)
        n = len(items)
        default = self.default_sampling_params
        param_list = _broadcast(params if params is not None else default, n, "sampling")
        lora_list = _broadcast(lora, n, "lora_request")
        prio = list(priority) if priority is not None else [0] * n
        if len(prio) != n:
            raise ValueError(f"priority has {len(prio)} entries for {n} prompts")
        ids = []
        for prompt, p, lr, pr in zip(items, param_list, lora_list, prio, strict=True):
            request_id = str(next(self._ids))
            if isinstance(prompt, dict):
                if "prompt_token_ids" in prompt:
                    prompt = list(prompt["prompt_token_ids"])
                elif "prompt" in prompt:
                    prompt = str(prompt["prompt"])
                else:
                    raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
            self.engine.add_request(request_id, prompt, p, lora_request=lr, priority=pr)
            ids.append(request_id)
        return ids

    def _snapshot_pending(self) -> None:
        """Before a step: the outputs that live calls have not yielded yet become snapshots
        (the step changes the objects in place). Only interleaved streams have any."""
        for queue in {id(q): q for q in self._queues.values()}.values():
            for i, (out, copied) in enumerate(queue):
                if not copied:
                    queue[i] = (copy.deepcopy(out), True)

    def _run(self, ids: set[str]) -> Iterator[RequestOutput]:
        """Step the engine until ``ids`` finish. Outputs of requests that belong to another
        live ``generate`` / ``generate_stream`` call (interleaved streams) are queued for it as
        snapshots, never dropped; so are this call's own, once another call steps while this
        one has not yielded them all (a step updates a request's output object in place)."""
        engine = self.engine
        remaining = set(ids)
        mine: deque[tuple[RequestOutput, bool]] = deque()  # in the steps' order
        for rid in ids:
            self._queues[rid] = mine
        try:
            while remaining:
                while mine:
                    out, _ = mine.popleft()
                    if out.request_id not in remaining:
                        continue  # (a final after its final: an abort's, after its end)
                    if out.finished:
                        remaining.discard(out.request_id)
                    yield out
                if not remaining or not engine.has_unfinished_requests():
                    break
                self._snapshot_pending()
                for out in engine.step():
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.append((out, False))
        finally:
            for rid in ids:
                self._queues.pop(rid, None)
            if remaining:  # the consumer stopped early: nothing may keep running
                engine.abort_request(sorted(remaining))
                engine.processor.forget(remaining)


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]  # one tokenized prompt
    return items


def _broadcast(value: Any, n: int, name: str) -> list[Any]:
    if value is None or isinstance(value, (SamplingParams, LoRARequest)):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} prompts")
    return values
