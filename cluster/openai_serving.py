"""The OpenAI-compatible API's logic, independent of the web framework: validate a request
against the model, run it through the cluster (``ClusterClient``: tokenization, ``n`` fan-out,
incremental detokenization and stop strings happen here, in the ingress), and shape the
responses -- whole, or as the chunks of a stream.

``cluster.serve`` puts it behind FastAPI and Ray Serve (HTTP) and the gRPC proxy; errors are
``APIError``s with the status code and OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from cluster.client import ClusterClient
from cluster.errors import OverloadedError, UnknownModelError
from cluster.openai_protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from cluster.outputs import CompletionOutput, RequestOutput
from scheduler import LoRARequest, SamplingParams
from scheduler.outputs import TokenLogprobs

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error with its HTTP status and OpenAI's JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:  # crosses Ray (the gRPC proxy) intact
        return (type(self), (self.status, self.message, self.param, self.headers))

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES.get(self.status, "APIError"),
                "param": self.param,
                "code": self.status,
            }
        }


def api_error(exc: BaseException, param: str | None = None) -> APIError:
    """The API error for what the cluster raised (internal failures: 500, no details)."""
    if isinstance(exc, APIError):
        return exc
    cause = getattr(exc, "cause", None)  # a RayTaskError: the actor's own exception
    if isinstance(cause, BaseException):
        exc = cause
    if isinstance(exc, OverloadedError):
        return APIError(429, str(exc), headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, UnknownModelError):
        return APIError(404, str(exc), param="model")
    if "no live decode-capable instance" in str(exc):  # every decode instance is gone
        return APIError(503, str(exc))
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), param=param)
    logger.exception("internal error", exc_info=exc)
    return APIError(500, "internal server error")


@dataclass
class _Job:
    """One prompt of a request: its ids, its text (for echo) and its first choice index."""

    prompt_ids: list[int]
    text: str | None
    params: SamplingParams
    first_index: int


class OpenAIServing:
    """Serves ``/v1/models``, completions and chat completions for one cluster."""

    def __init__(self, client: ClusterClient, served_model_name: str, tracer: Any = None) -> None:
        self.client = client
        self.tracer = tracer  # an OpenTelemetry tracer while tracing is on
        self.tokenizer = client.tokenizer
        self.model_name = served_model_name
        self.max_model_len = client.max_model_len
        self.created = int(time.time())

    # -- models ------------------------------------------------------------------------------
    async def adapters(self) -> dict[str, LoRARequest]:
        result: dict[str, LoRARequest] = await self.client.handle.lora_adapters.remote()
        return result

    async def models(self) -> dict[str, Any]:
        def card(name: str, parent: str | None, root: str) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "tandem",
                "root": root,
                "parent": parent,
                "max_model_len": self.max_model_len,
            }

        cards = [card(self.model_name, None, self.model_name)]
        for name, lora in sorted((await self.adapters()).items()):
            cards.append(card(name, self.model_name, lora.lora_path))
        return {"object": "list", "data": cards}

    async def resolve(self, model: str) -> LoRARequest | None:
        """The adapter a model name stands for (None: the base model); 404 if unknown."""
        if model == self.model_name:
            return None
        lora = (await self.adapters()).get(model)
        if lora is None:
            raise api_error(UnknownModelError(model))
        return lora

    # -- validation --------------------------------------------------------------------------
    def _max_tokens(self, prompt_len: int, requested: int | None, prompt_param: str) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {prompt_len} tokens; at least one must be left to generate.",
                param=prompt_param,
            )
        if requested is None:
            return room
        if requested > room:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                f"{requested} in the completion). Please reduce the length of the prompt or "
                "max_tokens.",
                param="max_tokens",
            )
        return requested

    def _check_ids(self, ids: list[int], param: str) -> None:
        try:
            self.client.factory.validate(ids)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None

    def _completion_jobs(self, req: CompletionRequest) -> list[_Job]:
        jobs = []
        for i, prompt in enumerate(req.prompts()):
            text: str | None
            if isinstance(prompt, str):
                ids, text = self.tokenizer.encode(prompt), prompt
            else:
                ids = list(prompt)
                text = self.tokenizer.decode(ids, skip_special_tokens=False) if req.echo else None
            self._check_ids(ids, "prompt")
            max_tokens = self._max_tokens(len(ids), req.max_tokens, "prompt")
            params = req.sampling_params(max_tokens, req.logprobs)
            jobs.append(_Job(ids, text, params, i * req.n))
        return jobs

    def _chat_job(self, req: ChatCompletionRequest) -> _Job:
        messages = [m.as_template_input() for m in req.messages]
        try:
            ids = self.tokenizer.encode_chat(
                messages,
                add_generation_prompt=req.add_generation_prompt,
                **(req.chat_template_kwargs or {}),
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        except Exception as exc:  # a template that fails on these messages
            raise APIError(400, f"the chat template failed: {exc}", param="messages") from None
        self._check_ids(ids, "messages")
        max_tokens = self._max_tokens(len(ids), req.requested_max_tokens, "messages")
        return _Job(ids, None, req.sampling_params(max_tokens, req.num_logprobs), 0)

    # -- running -----------------------------------------------------------------------------
    async def _run(
        self,
        request_id: str,
        jobs: list[_Job],
        lora: LoRARequest | None,
        priority: int,
        span: Any = None,
    ) -> AsyncGenerator[tuple[_Job, RequestOutput], None]:
        """Every job's outputs as they come, merged. The first output of each job is awaited
        before anything is yielded, so a request the cluster refuses is an ``APIError`` here
        (not a broken stream). Leaving early aborts every job."""
        carrier = None
        if span is not None:
            from cluster.tracing import inject

            carrier = inject(span)
        streams = [
            self.client.generate_async(
                job.prompt_ids,
                job.params,
                request_id=f"{request_id}-{k}" if len(jobs) > 1 else request_id,
                lora_request=lora,
                priority=priority,
                trace_context=carrier,
            )
            for k, job in enumerate(jobs)
        ]
        try:
            firsts = await asyncio.gather(*(s.__anext__() for s in streams))
        except BaseException as exc:
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
            if isinstance(exc, asyncio.CancelledError | StopAsyncIteration):
                raise
            raise api_error(exc) from None
        if len(jobs) == 1:  # the common case: straight through, no copies
            yield jobs[0], firsts[0]
            try:
                if not firsts[0].finished:
                    async for out in streams[0]:
                        yield jobs[0], out
            finally:
                await streams[0].aclose()
            return
        for job, first in zip(jobs, firsts, strict=True):
            yield job, copy.deepcopy(first)
        queue: asyncio.Queue[tuple[_Job, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(job: _Job, stream: AsyncGenerator[RequestOutput, None]) -> None:
            try:
                async for out in stream:  # a copy: the stream updates its output in place
                    queue.put_nowait((job, copy.deepcopy(out)))
            except BaseException as exc:
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(None)

        pairs = zip(jobs, streams, firsts, strict=True)
        tasks = [asyncio.ensure_future(pump(j, s)) for j, s, f in pairs if not f.finished]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            closing = (s.aclose() for s in streams)
            await asyncio.gather(*closing, return_exceptions=True)

    # -- completions -------------------------------------------------------------------------
    async def completion(
        self, req: CompletionRequest, trace_headers: dict[str, str] | None = None
    ) -> dict[str, Any] | AsyncIterator[str]:
        from cluster.tracing import start_api_span

        span = start_api_span(self.tracer, "text_completion", req, trace_headers)
        return await _traced(self._completion(req, span), span)

    async def _completion(
        self, req: CompletionRequest, span: Any
    ) -> dict[str, Any] | AsyncIterator[str]:
        lora = await self.resolve(req.model)
        jobs = self._completion_jobs(req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        outputs = self._run(rid, jobs, lora, req.priority, span)
        if req.stream:
            first = await _prime(outputs)
            return self._completion_stream(req, rid, jobs, first, outputs, span)
        finals = await _collect(outputs)
        choices = []
        for job in jobs:
            final = finals[id(job)]
            for out in final.outputs:
                text = (job.text or "") + out.text if req.echo else out.text
                choices.append(
                    {
                        "index": job.first_index + out.index,
                        "text": text,
                        "logprobs": self._completion_logprobs(
                            out.token_ids, out.logprobs, job.params.logprobs
                        )
                        if job.params.logprobs is not None
                        else None,
                        "finish_reason": _finish(out),
                        "stop_reason": out.stop_reason,
                    }
                )
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": sorted(choices, key=lambda c: c["index"]),
            "usage": _usage(jobs, finals),
        }

    def _completion_stream(
        self,
        req: CompletionRequest,
        rid: str,
        jobs: list[_Job],
        first: tuple[_Job, RequestOutput] | None,
        outputs: AsyncGenerator[tuple[_Job, RequestOutput], None],
        span: Any = None,
    ) -> AsyncIterator[str]:
        prologue = (
            [
                {
                    "index": job.first_index + i,
                    "text": job.text or "",
                    "logprobs": None,
                    "finish_reason": None,
                }
                for job in jobs
                for i in range(req.n)
            ]
            if req.echo
            else None
        )

        def choice(job: _Job, sample: CompletionOutput) -> dict[str, Any]:
            return {
                "index": job.first_index + sample.index,
                "text": sample.new_text,
                "logprobs": self._completion_logprobs(
                    sample.new_token_ids, _new_logprobs(sample), job.params.logprobs
                )
                if job.params.logprobs is not None
                else None,
                "finish_reason": _finish(sample),
                "stop_reason": sample.stop_reason,
            }

        stream = _Stream(rid, "text_completion", req.model, jobs, req.stream_options, span)
        return stream.run(_chain(first, outputs), prologue, choice)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: list[TokenLogprobs] | None, k: int
    ) -> dict[str, Any]:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        offset = 0
        for tid, lp in zip(token_ids, logprobs or [], strict=False):
            text = self._token_text(tid)
            tokens.append(text)
            token_logprobs.append(_finite(lp.get(tid)))
            tops.append({self._token_text(t): _finite(v) for t, v in _top(lp)[:k]})
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    # -- chat --------------------------------------------------------------------------------
    async def chat(
        self, req: ChatCompletionRequest, trace_headers: dict[str, str] | None = None
    ) -> dict[str, Any] | AsyncIterator[str]:
        from cluster.tracing import start_api_span

        span = start_api_span(self.tracer, "chat", req, trace_headers)
        return await _traced(self._chat(req, span), span)

    async def _chat(
        self, req: ChatCompletionRequest, span: Any
    ) -> dict[str, Any] | AsyncIterator[str]:
        lora = await self.resolve(req.model)
        job = self._chat_job(req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        outputs = self._run(rid, [job], lora, req.priority, span)
        if req.stream:
            first = await _prime(outputs)
            return self._chat_stream(req, rid, job, first, outputs, span)
        finals = await _collect(outputs)
        final = finals[id(job)]
        choices = [
            {
                "index": out.index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": {"content": self._chat_logprobs(out.token_ids, out.logprobs, req)}
                if req.logprobs
                else None,
                "finish_reason": _finish(out),
                "stop_reason": out.stop_reason,
            }
            for out in final.outputs
        ]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": _usage([job], finals),
        }

    def _chat_stream(
        self,
        req: ChatCompletionRequest,
        rid: str,
        job: _Job,
        first: tuple[_Job, RequestOutput] | None,
        outputs: AsyncGenerator[tuple[_Job, RequestOutput], None],
        span: Any = None,
    ) -> AsyncIterator[str]:
        prologue = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(req.n)
        ]

        def choice(job: _Job, sample: CompletionOutput) -> dict[str, Any]:
            new = sample.new_token_ids
            return {
                "index": sample.index,
                "delta": {"content": sample.new_text} if sample.new_text else {},
                "logprobs": {"content": self._chat_logprobs(new, _new_logprobs(sample), req)}
                if req.logprobs
                else None,
                "finish_reason": _finish(sample),
                "stop_reason": sample.stop_reason,
            }

        stream = _Stream(rid, "chat.completion.chunk", req.model, [job], req.stream_options, span)
        return stream.run(_chain(first, outputs), prologue, choice)

    def _chat_logprobs(
        self, token_ids: list[int], logprobs: list[TokenLogprobs] | None, req: ChatCompletionRequest
    ) -> list[dict[str, Any]]:
        k = req.top_logprobs or 0
        content = []
        for tid, lp in zip(token_ids, logprobs or [], strict=False):
            text = self._token_text(tid)
            content.append(
                {
                    "token": text,
                    "logprob": _finite(lp.get(tid)),
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {
                            "token": (t_text := self._token_text(t)),
                            "logprob": _finite(v),
                            "bytes": list(t_text.encode()),
                        }
                        for t, v in _top(lp)[:k]
                    ],
                }
            )
        return content


class _Stream:
    """The SSE chunks of one streamed request (completions or chat; ``choice`` shapes one
    sample's delta): a chunk per step with the choices that moved, ``finish_reason`` once per
    choice, an error body if generation fails, the usage chunk (``include_usage``) or usage on
    every chunk (``continuous_usage_stats`` too, like vLLM), then ``[DONE]``."""

    def __init__(
        self,
        rid: str,
        obj: str,
        model: str,
        jobs: list[_Job],
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
            usage = _usage(self.jobs, self.finals)
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
        outputs: AsyncGenerator[tuple[_Job, RequestOutput], None],
        prologue: list[dict[str, Any]] | None,
        choice: Callable[[_Job, CompletionOutput], dict[str, Any]],
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
                yield self.chunk([], _usage(self.jobs, self.finals))
        except APIError as exc:
            yield sse(exc.body())
        finally:
            await outputs.aclose()
            _end_stream_span(self.span, self.rid, self.jobs, self.finals)
        yield "data: [DONE]\n\n"


# -- helpers ---------------------------------------------------------------------------------
async def _traced(result: Any, span: Any) -> Any:
    """Await a handler; end its ingress span with the outcome (a stream ends it itself)."""
    if span is None:
        return await result
    from cluster.tracing import end_api_span

    try:
        body = await result
    except BaseException as exc:
        end_api_span(span, error=exc)
        raise
    if isinstance(body, dict):
        reasons = [c["finish_reason"] or "" for c in body["choices"]]
        end_api_span(span, body["id"], body["usage"], reasons)
    return body


def _end_stream_span(
    span: Any, rid: str, jobs: list[_Job], finals: dict[int, RequestOutput]
) -> None:
    if span is None:
        return
    from cluster.tracing import end_api_span

    reasons = [o.finish_reason or "" for f in finals.values() for o in f.outputs]
    end_api_span(span, rid, _usage(jobs, finals), reasons)


def sse(body: dict[str, Any]) -> str:
    import json

    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


async def _prime(
    outputs: AsyncGenerator[tuple[_Job, RequestOutput], None],
) -> tuple[_Job, RequestOutput] | None:
    """The first output: raises the request's ``APIError`` before a stream starts."""
    try:
        return await outputs.__anext__()
    except StopAsyncIteration:
        return None


async def _chain(
    first: tuple[_Job, RequestOutput] | None, rest: AsyncGenerator[tuple[_Job, RequestOutput], None]
) -> AsyncGenerator[tuple[_Job, RequestOutput], None]:
    try:
        if first is not None:
            yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


async def _collect(
    outputs: AsyncGenerator[tuple[_Job, RequestOutput], None],
) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for job, out in outputs:
        finals[id(job)] = out
    for final in finals.values():
        for sample in final.outputs:
            if sample.finish_reason == "error":
                raise api_error(ValueError(sample.error or "generation failed"))
    return finals


def _finish(out: CompletionOutput) -> str | None:
    return out.finish_reason


def _usage(jobs: list[_Job], finals: dict[int, RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(job.prompt_ids) for job in jobs)
    completion = sum(len(out.token_ids) for final in finals.values() for out in final.outputs)
    cached = sum(final.num_cached_tokens for final in finals.values())
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _new_logprobs(sample: CompletionOutput) -> list[TokenLogprobs] | None:
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
