"""Every shape of OpenAI's responses, in one module: whole completions and chat completions,
the SSE chunks of a stream (``SSEStream``, fed by ``completion_chunks`` / ``chat_chunks``), the
usage block and logprobs. ``cluster.serving.openai_serving`` validates and runs requests and
answers with these. ``Job`` is one prompt of a request; ``Finals`` holds each job's latest
``RequestOutput`` by its first choice index."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from actors.model.tokenizer import Tokenizer
from cluster.engine.outputs import CompletionOutput, RequestOutput
from cluster.observability.api_span import APISpan
from cluster.serving.errors import api_error, ended_by_cluster, sample_error
from cluster.serving.openai_protocol import ChatCompletionRequest, CompletionRequest
from cluster.serving.sampling_fields import StreamOptions
from cluster.serving.tool_calls import ToolPlan
from cluster.serving.tool_streams import ToolStream
from scheduler import SamplingParams
from scheduler.outputs import TokenLogprobs
from scheduler.request import PromptLogprob


@dataclass
class Job:
    """One prompt of a request: its ids, its text (for echo) and its first choice index."""

    prompt_ids: list[int]
    text: str | None
    params: SamplingParams
    first_index: int
    echo_only: bool = False  # echo with max_tokens 0: what is generated is not shown


Finals = dict[int, RequestOutput]  # job.first_index -> the job's latest output
Outputs = AsyncGenerator[tuple[Job, RequestOutput], None]


# -- whole responses -----------------------------------------------------------------------------
def completion_response(
    rid: str, req: CompletionRequest, jobs: list[Job], finals: Finals, tokenizer: Tokenizer
) -> dict[str, Any]:
    choices = []
    for job in jobs:
        final = finals[job.first_index]
        for out in final.outputs:
            ids, text, lps = (
                ([], "", []) if job.echo_only else (out.token_ids, out.text, out.logprobs)
            )
            logprobs = _completion_logprobs(tokenizer, job, ids, lps)
            if req.echo:
                text = (job.text or "") + text
                if logprobs is not None:
                    logprobs = _with_prompt(tokenizer, job, final.prompt_logprobs, logprobs)
            choice: dict[str, Any] = {
                "index": job.first_index + out.index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": _echo_reason(job, out.finish_reason),
                "stop_reason": None if job.echo_only else out.stop_reason,
            }
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_body(
                    tokenizer, job.prompt_ids, final.prompt_logprobs, req.prompt_logprobs
                )
            choices.append(choice)
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": sorted(choices, key=lambda c: c["index"]),
        "usage": usage_of(jobs, finals),
    }


def chat_response(
    rid: str,
    req: ChatCompletionRequest,
    job: Job,
    finals: Finals,
    tokenizer: Tokenizer,
    tools: ToolPlan | None = None,
) -> dict[str, Any]:
    choices = []
    for out in finals[job.first_index].outputs:
        message: dict[str, Any] = {"role": "assistant", "content": out.text}
        finish_reason = out.finish_reason
        if tools is not None:
            content, calls, finish_reason = tools.parse(out.text, out.finish_reason)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [call.as_openai() for call in calls]
        choices.append(
            {
                "index": out.index,
                "message": message,
                "logprobs": _chat_logprobs(tokenizer, req, out.token_ids, out.logprobs),
                "finish_reason": finish_reason,
                "stop_reason": out.stop_reason,
            }
        )
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": usage_of([job], finals),
    }
    if req.prompt_logprobs is not None:
        prompt = finals[job.first_index].prompt_logprobs
        k = req.prompt_logprobs
        body["prompt_logprobs"] = prompt_logprobs_body(tokenizer, job.prompt_ids, prompt, k)
    return body


def finish_reasons(body: dict[str, Any]) -> list[str]:
    return [c["finish_reason"] or "" for c in body["choices"]]


# -- streams -------------------------------------------------------------------------------------
def completion_chunks(
    rid: str,
    req: CompletionRequest,
    jobs: list[Job],
    outputs: Outputs,
    span: APISpan,
    tokenizer: Tokenizer,
) -> AsyncIterator[str]:
    """The SSE stream of a completion (``echo``: each choice's first chunk starts with its
    prompt, and its logprobs with the prompt's)."""
    echoed: set[int] = set()
    offsets: dict[int, int] = {}  # per choice: where its next token's text starts

    def choice(job: Job, sample: CompletionOutput) -> dict[str, Any]:
        index = job.first_index + sample.index
        ids, text = sample.new_token_ids, sample.new_text
        lps: list[TokenLogprobs] | None = new_logprobs(sample)
        if job.echo_only:
            ids, text, lps = [], "", []
        start = offsets.get(index, 0)
        logprobs = _completion_logprobs(tokenizer, job, ids, lps, start)
        if req.echo and index not in echoed:
            echoed.add(index)
            text = (job.text or "") + text
            if logprobs is not None:
                prompt = stream.finals[job.first_index].prompt_logprobs
                logprobs = _with_prompt(tokenizer, job, prompt, logprobs)
        offsets[index] = _end_offset(logprobs, start)
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": _echo_reason(job, sample.finish_reason),
            "stop_reason": None if job.echo_only else sample.stop_reason,
        }

    stream = SSEStream(rid, "text_completion", req.model, jobs, req.stream_options, span)
    return stream.run(outputs, None, choice)


def chat_chunks(
    rid: str,
    req: ChatCompletionRequest,
    job: Job,
    outputs: Outputs,
    span: APISpan,
    tokenizer: Tokenizer,
    tools: ToolPlan | None = None,
) -> AsyncIterator[str]:
    """The SSE stream of a chat completion (the assistant role first, then content deltas;
    with ``tools``, ``tool_calls`` deltas as well)."""
    prologue = [
        {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        for i in range(req.n)
    ]

    streams: dict[int, ToolStream] = {}

    def choice(job: Job, sample: CompletionOutput) -> dict[str, Any]:
        new = sample.new_token_ids
        delta: dict[str, Any] = {"content": sample.new_text} if sample.new_text else {}
        finish_reason = sample.finish_reason
        if tools is not None:
            stream = streams.get(sample.index) or streams.setdefault(sample.index, tools.stream())
            content, calls = stream.feed(sample.new_text)
            if sample.finished:
                more, last = stream.finish()
                content, calls = content + more, calls + last
                finish_reason = tools.finish_reason(finish_reason, stream)
            delta = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = calls
        return {
            "index": sample.index,
            "delta": delta,
            "logprobs": _chat_logprobs(tokenizer, req, new, new_logprobs(sample)),
            "finish_reason": finish_reason,
            "stop_reason": sample.stop_reason,
        }

    stream = SSEStream(rid, "chat.completion.chunk", req.model, [job], req.stream_options, span)
    return stream.run(outputs, prologue, choice)


class SSEStream:
    """The SSE chunks of one streamed request (completions or chat; ``choice`` shapes one
    sample's delta): a chunk per step with the choices that moved, ``finish_reason`` once per
    choice, an error body if generation fails, the usage chunk (``include_usage``) or usage on
    every chunk (``continuous_usage_stats`` too, like vLLM), then ``[DONE]``. The outcome goes
    on the request's span when the stream ends."""

    def __init__(
        self,
        rid: str,
        obj: str,
        model: str | None,
        jobs: list[Job],
        options: StreamOptions | None,
        span: APISpan,
    ) -> None:
        self.rid, self.obj, self.model, self.jobs, self.span = rid, obj, model, jobs, span
        self.created = int(time.time())
        self.include_usage = options is not None and bool(options.include_usage)
        self.continuous = self.include_usage and bool(options and options.continuous_usage_stats)
        self.finals: Finals = {}

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
        outputs: Outputs,
        prologue: list[dict[str, Any]] | None,
        choice: Callable[[Job, CompletionOutput], dict[str, Any]],
    ) -> AsyncIterator[str]:
        ended: set[int] = set()  # choice indexes whose finish_reason went out
        try:
            if prologue:
                yield self.chunk(prologue)
            async for job, out in outputs:
                self.finals[job.first_index] = out
                choices = []
                for sample in out.outputs:
                    index = job.first_index + sample.index
                    if index in ended or not (sample.new_token_ids or sample.finished):
                        continue
                    if ended_by_cluster(sample):  # the cluster failed (or ended) it
                        raise sample_error(sample)
                    if sample.finished:
                        ended.add(index)
                    choices.append(choice(job, sample))
                if choices:
                    yield self.chunk(choices)
            if self.include_usage:
                yield self.chunk([], usage_of(self.jobs, self.finals))
        except Exception as exc:
            # After the 200 went out, an error is an event of the stream (then [DONE], as
            # vLLM does), never a cut-off body: a stream lost with the cluster's scheduler is
            # a 503 the client may retry; anything else a 500.
            error = api_error(exc)
            self.span.failed(error)
            yield sse(error.body())
        finally:
            await outputs.aclose()
            reasons = [o.finish_reason or "" for f in self.finals.values() for o in f.outputs]
            self.span.record(self.rid, usage_of(self.jobs, self.finals), reasons)
        yield "data: [DONE]\n\n"


def sse(body: dict[str, Any]) -> str:
    import json

    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def usage_of(jobs: list[Job], finals: Finals) -> dict[str, Any]:
    prompt = sum(len(job.prompt_ids) for job in jobs)
    completion = sum(
        len(out.token_ids)
        for job in jobs
        if not job.echo_only and job.first_index in finals
        for out in finals[job.first_index].outputs
    )
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


def _completion_top(
    tokenizer: Tokenizer, lp: TokenLogprobs, token_id: int, k: int
) -> dict[str, float]:
    """The legacy completions' ``top_logprobs`` entry: the ``k`` best and the token itself
    (up to k + 1 entries, as OpenAI and vLLM give them; chat's ``top_logprobs`` stop at k)."""
    entries = _top(lp)[:k]
    if token_id in lp and all(t != token_id for t, _ in entries):
        entries.append((token_id, lp[token_id]))
    return {_token_text(tokenizer, t): _finite(v) for t, v in entries}


def _finite(value: float | None) -> float:
    if value is None or value != value:
        return -9999.0
    return max(float(value), -9999.0)


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(
    tokenizer: Tokenizer,
    job: Job,
    token_ids: list[int],
    logprobs: list[TokenLogprobs] | None,
    start: int = 0,
) -> dict[str, Any] | None:
    if job.params.logprobs is None:
        return None
    return completion_logprobs(tokenizer, token_ids, logprobs, job.params.logprobs, start)


def _echo_reason(job: Job, reason: str | None) -> str | None:
    """echo with max_tokens 0 ends with length (the generated token is dropped), unless it
    was aborted or failed."""
    if job.echo_only and reason not in (None, "abort", "error"):
        return "length"
    return reason


def _end_offset(logprobs: dict[str, Any] | None, start: int) -> int:
    """Where the next token's text starts (offsets run over the whole returned text)."""
    if not logprobs or not logprobs["tokens"]:
        return start
    return int(logprobs["text_offset"][-1]) + len(logprobs["tokens"][-1])


def _chat_logprobs(
    tokenizer: Tokenizer,
    req: ChatCompletionRequest,
    token_ids: list[int],
    logprobs: list[TokenLogprobs] | None,
) -> dict[str, Any] | None:
    if not req.logprobs:
        return None
    return {"content": chat_logprobs(tokenizer, token_ids, logprobs, req.top_logprobs or 0)}


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: list[int],
    logprobs: list[TokenLogprobs] | None,
    k: int,
    start: int = 0,
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object (tokens, their logprobs, ``k`` best, offsets
    from ``start``: what came before them in the returned text, token by token)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = start
    for tid, lp in zip(token_ids, logprobs or [], strict=False):
        text = _token_text(tokenizer, tid)
        tokens.append(text)
        token_logprobs.append(_finite(lp.get(tid)))
        tops.append(_completion_top(tokenizer, lp, tid, k))
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _with_prompt(
    tokenizer: Tokenizer,
    job: Job,
    prompt: list[PromptLogprob | None] | None,
    generated: dict[str, Any],
) -> dict[str, Any]:
    """``echo``'s logprobs: the prompt's tokens first (the first has none: null), then the
    generated ones, offsets counted over the whole returned text."""
    assert job.params.logprobs is not None
    k = job.params.logprobs
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for position, token_id in enumerate(job.prompt_ids):
        entry = prompt[position] if prompt is not None and position < len(prompt) else None
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
        else:
            lp = entry[0]
            values.append(_finite(lp.get(token_id)))
            tops.append(_completion_top(tokenizer, lp, token_id, k))
    shift = offset - (generated["text_offset"][0] if generated["text_offset"] else 0)
    return {
        "tokens": tokens + generated["tokens"],
        "token_logprobs": values + generated["token_logprobs"],
        "top_logprobs": tops + generated["top_logprobs"],
        "text_offset": offsets + [shift + o for o in generated["text_offset"]],
    }


def prompt_logprobs_body(
    tokenizer: Tokenizer,
    prompt_ids: list[int],
    prompt: list[PromptLogprob | None] | None,
    k: int,
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, null for the first, else ``{token id:
    {"logprob", "rank", "decoded_token"}}`` for the prompt's own token (its computed rank)
    and the top-k (ranked by their order)."""
    body: list[dict[str, dict[str, Any]] | None] = []
    for position, entry in enumerate(prompt or []):
        if entry is None:
            body.append(None)
            continue
        lp, own_rank = entry
        own = prompt_ids[position]
        item: dict[str, dict[str, Any]] = {}
        ranked = _top(lp)  # (echo may have asked the engine for more than k)
        kept = ranked[:k] + [(t, v) for t, v in ranked[k:] if t == own]
        for place, (token_id, value) in enumerate(kept, start=1):
            item[str(token_id)] = {
                "logprob": _finite(value),
                "rank": own_rank if token_id == own else place,
                "decoded_token": _token_text(tokenizer, token_id),
            }
        body.append(item)
    return body


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
                # The token's own bytes: part of a character decodes to U+FFFD alone.
                "bytes": list(tokenizer.token_bytes(tid)),
                "top_logprobs": [
                    {
                        "token": _token_text(tokenizer, t),
                        "logprob": _finite(v),
                        "bytes": list(tokenizer.token_bytes(t)),
                    }
                    for t, v in _top(lp)[:k]
                ],
            }
        )
    return content
