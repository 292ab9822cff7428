"""The OpenAI-compatible API's logic, independent of the web framework: validate a request
against the model, run it through the cluster (``ClusterClient``: tokenization, ``n`` fan-out,
incremental detokenization and stop strings happen here, in the ingress), and shape the
responses -- whole, or as the chunks of a stream (the shapes: ``cluster.openai_stream``).

``cluster.serve`` puts it behind FastAPI and Ray Serve (HTTP) and the gRPC proxy; errors are
``APIError``s (``cluster.errors``) with the status code and OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import copy
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from cluster.client import ClusterClient
from cluster.errors import APIError, UnknownModelError, api_error
from cluster.openai_protocol import ChatCompletionRequest, CompletionRequest
from cluster.openai_stream import (
    Job,
    SSEStream,
    chain,
    chat_logprobs,
    collect,
    completion_logprobs,
    new_logprobs,
    prime,
    usage_of,
)
from cluster.outputs import CompletionOutput, RequestOutput
from scheduler import LoRARequest
from scheduler.outputs import TokenLogprobs


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

    def _completion_jobs(self, req: CompletionRequest) -> list[Job]:
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
            jobs.append(Job(ids, text, params, i * req.n))
        return jobs

    def _chat_job(self, req: ChatCompletionRequest) -> Job:
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
        return Job(ids, None, req.sampling_params(max_tokens, req.num_logprobs), 0)

    # -- running -----------------------------------------------------------------------------
    async def _run(
        self,
        request_id: str,
        jobs: list[Job],
        lora: LoRARequest | None,
        priority: int,
        span: Any = None,
    ) -> AsyncGenerator[tuple[Job, RequestOutput], None]:
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
        queue: asyncio.Queue[tuple[Job, RequestOutput] | BaseException | None] = asyncio.Queue()

        async def pump(job: Job, stream: AsyncGenerator[RequestOutput, None]) -> None:
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
            first = await prime(outputs)
            return self._completion_stream(req, rid, jobs, first, outputs, span)
        finals = await collect(outputs)
        choices = []
        for job in jobs:
            final = finals[id(job)]
            for out in final.outputs:
                text = (job.text or "") + out.text if req.echo else out.text
                choices.append(
                    {
                        "index": job.first_index + out.index,
                        "text": text,
                        "logprobs": completion_logprobs(
                            self.tokenizer, out.token_ids, out.logprobs, job.params.logprobs
                        )
                        if job.params.logprobs is not None
                        else None,
                        "finish_reason": out.finish_reason,
                        "stop_reason": out.stop_reason,
                    }
                )
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": sorted(choices, key=lambda c: c["index"]),
            "usage": usage_of(jobs, finals),
        }

    def _completion_stream(
        self,
        req: CompletionRequest,
        rid: str,
        jobs: list[Job],
        first: tuple[Job, RequestOutput] | None,
        outputs: AsyncGenerator[tuple[Job, RequestOutput], None],
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

        def choice(job: Job, sample: CompletionOutput) -> dict[str, Any]:
            return {
                "index": job.first_index + sample.index,
                "text": sample.new_text,
                "logprobs": completion_logprobs(
                    self.tokenizer, sample.new_token_ids, new_logprobs(sample), job.params.logprobs
                )
                if job.params.logprobs is not None
                else None,
                "finish_reason": sample.finish_reason,
                "stop_reason": sample.stop_reason,
            }

        stream = SSEStream(rid, "text_completion", req.model, jobs, req.stream_options, span)
        return stream.run(chain(first, outputs), prologue, choice)

    def _chat_logprobs(
        self, ids: list[int], logprobs: list[TokenLogprobs] | None, req: ChatCompletionRequest
    ) -> dict[str, Any] | None:
        if not req.logprobs:
            return None
        return {"content": chat_logprobs(self.tokenizer, ids, logprobs, req.top_logprobs or 0)}

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
            first = await prime(outputs)
            return self._chat_stream(req, rid, job, first, outputs, span)
        finals = await collect(outputs)
        final = finals[id(job)]
        choices = [
            {
                "index": out.index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": self._chat_logprobs(out.token_ids, out.logprobs, req),
                "finish_reason": out.finish_reason,
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
            "usage": usage_of([job], finals),
        }

    def _chat_stream(
        self,
        req: ChatCompletionRequest,
        rid: str,
        job: Job,
        first: tuple[Job, RequestOutput] | None,
        outputs: AsyncGenerator[tuple[Job, RequestOutput], None],
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

        def choice(job: Job, sample: CompletionOutput) -> dict[str, Any]:
            new = sample.new_token_ids
            return {
                "index": sample.index,
                "delta": {"content": sample.new_text} if sample.new_text else {},
                "logprobs": self._chat_logprobs(new, new_logprobs(sample), req),
                "finish_reason": sample.finish_reason,
                "stop_reason": sample.stop_reason,
            }

        stream = SSEStream(rid, "chat.completion.chunk", req.model, [job], req.stream_options, span)
        return stream.run(chain(first, outputs), prologue, choice)


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
