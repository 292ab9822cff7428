"""The shapes of OpenAI's responses: a request's prompts (``Job``), the usage block, logprobs,
and the SSE chunks of a stream (``SSEStream``). ``cluster.openai_serving`` runs the requests
and uses these to answer."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from actors.model.tokenizer import Tokenizer
from cluster.errors import APIError, api_error
from cluster.openai_protocol import StreamOptions
from cluster.outputs import CompletionOutput, RequestOutput
from scheduler import SamplingParams
from scheduler.outputs import TokenLogprobs


@dataclass
class Job:
    """One prompt of a request: its ids, its text (for echo) and its first choice index."""

    prompt_ids: list[int]
    text: str | None
    params: SamplingParams
    first_index: int


class SSEStream:
    """The SSE chunks of one streamed request (completions or chat; ``choice`` shapes one
    sample's delta): a chunk per step with the choices that moved, ``finish_reason`` once per
    choice, an error body if generation fails, the usage chunk (``include_usage``) or usage on
    every chunk (``continuous_usage_stats`` too, like vLLM), then ``[DONE]``."""

    def __init__(
        self,
        rid: str,
        obj: str,
        model: str,
        jobs: list[Job],
        options: StreamOptions | None,
        span: Any,
    ) -> None:
        self.rid, self.obj, self.model, self.jobs, self.span = rid, obj, model, jobs, span
        self.created = int(time.time())
        self.include_usage = options is not None and options.include_usage
        self.continuous = self.include_usage and bool(options and options.continuous_usage_stats)
        self.finals: dict[int, RequestOutput] = {}

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        if usage is None and self.continuous:
            usage = usage_of(self.jobs, self.finals)
        body = {
            "id": self.rid,
            "object": self.obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage,
        }
        return sse(body)

    async def run(
        self,
        outputs: AsyncGenerator[tuple[Job, RequestOutput], None],
        prologue: list[dict[str, Any]] | None,
        choice: Callable[[Job, CompletionOutput], dict[str, Any]],
    ) -> AsyncIterator[str]:
        ended: set[int] = set()  # choice indexes whose finish_reason went out
        try:
            if prologue:
                yield self.chunk(prologue)
            async for job, out in outputs:
                self.finals[id(job)] = out
                choices = []
                for sample in out.outputs:
                    index = job.first_index + sample.index
                    if index in ended or not (sample.new_token_ids or sample.finished):
                        continue
                    if sample.finish_reason == "error":
                        yield sse(APIError(503, sample.error or "generation failed").body())
                        return
                    if sample.finished:
                        ended.add(index)
                    choices.append(choice(job, sample))
                if choices:
                    yield self.chunk(choices)
            if self.include_usage:
                yield self.chunk([], usage_of(self.jobs, self.finals))
        except APIError as exc:
            yield sse(exc.body())
        finally:
            await outputs.aclose()
            _end_stream_span(self.span, self.rid, self.jobs, self.finals)
        yield "data: [DONE]\n\n"


def _end_stream_span(
    span: Any, rid: str, jobs: list[Job], finals: dict[int, RequestOutput]
) -> None:
    if span is None:
        return
    from cluster.tracing import end_api_span

    reasons = [o.finish_reason or "" for f in finals.values() for o in f.outputs]
    end_api_span(span, rid, usage_of(jobs, finals), reasons)


def sse(body: dict[str, Any]) -> str:
    import json

    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def prime(
    outputs: AsyncGenerator[tuple[Job, RequestOutput], None],
) -> tuple[Job, RequestOutput] | None:
    """The first output: raises the request's ``APIError`` before a stream starts."""
    try:
        return await outputs.__anext__()
    except StopAsyncIteration:
        return None


async def chain(
    first: tuple[Job, RequestOutput] | None, rest: AsyncGenerator[tuple[Job, RequestOutput], None]
) -> AsyncGenerator[tuple[Job, RequestOutput], None]:
    try:
        if first is not None:
            yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def collect(
    outputs: AsyncGenerator[tuple[Job, RequestOutput], None],
) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for job, out in outputs:
        finals[id(job)] = out
    for final in finals.values():
        for sample in final.outputs:
            if sample.finish_reason == "error":
                raise api_error(ValueError(sample.error or "generation failed"))
    return finals


def usage_of(jobs: list[Job], finals: dict[int, RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(job.prompt_ids) for job in jobs)
    completion = sum(len(out.token_ids) for final in finals.values() for out in final.outputs)
    cached = sum(final.num_cached_tokens for final in finals.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def new_logprobs(sample: CompletionOutput) -> list[TokenLogprobs] | None:
    """The logprobs of the tokens the last step added."""
    if sample.logprobs is None:
        return None
    return sample.logprobs[len(sample.logprobs) - len(sample.new_token_ids) :]


def _top(lp: TokenLogprobs) -> list[tuple[int, float]]:
    """Entries best first (the sampled token is in ``lp`` even when not among the top)."""
    return sorted(lp.items(), key=lambda kv: (-kv[1], kv[0]))


def _finite(value: float | None) -> float:
    if value is None or value != value:
        return -9999.0
    return max(float(value), -9999.0)


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprobs] | None, k: int
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object (tokens, their logprobs, ``k`` best, offsets)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = 0
    for tid, lp in zip(token_ids, logprobs or [], strict=False):
        text = _token_text(tokenizer, tid)
        tokens.append(text)
        token_logprobs.append(_finite(lp.get(tid)))
        tops.append({_token_text(tokenizer, t): _finite(v) for t, v in _top(lp)[:k]})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprobs] | None, k: int
) -> list[dict[str, Any]]:
    """Chat's ``logprobs.content``: each token with its bytes and its ``k`` best."""
    content = []
    for tid, lp in zip(token_ids, logprobs or [], strict=False):
        text = _token_text(tokenizer, tid)
        content.append(
            {
                "token": text,
                "logprob": _finite(lp.get(tid)),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {
                        "token": (t_text := _token_text(tokenizer, t)),
                        "logprob": _finite(v),
                        "bytes": list(t_text.encode()),
                    }
                    for t, v in _top(lp)[:k]
                ],
            }
        )
    return content
