"""The OpenAI-compatible API's logic, independent of the web framework and of the engine:
validate a request against the model, run it through an ``EngineClient`` (tokenization, ``n``
fan-out, incremental detokenization and stop strings happen there, in the ingress's process),
and answer with the shapes of ``cluster.serving.openai_responses``.

A request's path: ``completion`` / ``chat`` open its ``APISpan``, build its jobs, ``run`` them
(one merged stream), and answer whole or as a stream. ``cluster.serving.app`` puts this behind
FastAPI and Ray Serve, ``cluster.serving.grpc_api`` behind gRPC; errors are ``APIError``s
(``cluster.serving.errors``) with the status code and OpenAI's error body.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any

from cluster.engine.outputs import CompletionOutput, RequestOutput
from cluster.engine.protocol import EngineClient
from cluster.engine.streams import merge_streams
from cluster.observability.api_span import APISpan
from cluster.serving.agent_fields import NamedToolChoice
from cluster.serving.errors import APIError, api_error, ended_by_cluster, sample_error
from cluster.serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
)
from cluster.serving.openai_responses import (
    Finals,
    Job,
    Outputs,
    chat_chunks,
    chat_response,
    completion_chunks,
    completion_response,
    finish_reasons,
)
from cluster.serving.request_checks import RequestChecks
from cluster.serving.serving_admin import ModelsAndOperations
from cluster.serving.sse import ClosingGenerator
from cluster.serving.tool_calls import (
    ToolPlan,
    parser_for,
    template_messages,
    template_supports_tools,
)
from scheduler import LoRARequest

logger = logging.getLogger(__name__)


class OpenAIServing(RequestChecks, ModelsAndOperations):
    """Serves ``/v1/models``, completions, chat completions, adapters, health and metrics for
    one engine (a cluster's ``ClusterClient`` or the in-process ``AsyncLLM``).

    Tokenization and chat-template rendering run on ``preprocess_threads`` threads, off the
    event loop (the tokenizer releases the GIL), so a long prompt never delays another
    request's first byte; a prompt with more characters than ``max_model_len`` tokens could
    hold is refused before it is tokenized."""

    def __init__(
        self,
        engine: EngineClient,
        served_model_name: str,
        tracer: Any = None,
        preprocess_threads: int = 2,
        lora_adapter_root: str | None = None,
        tool_call_parser: str | None = None,
        sampling_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        # The model's, for the fields a request leaves unset (``generation_config``); a
        # default ``max_tokens`` caps what is otherwise the room left in the context.
        self.sampling_defaults = dict(sampling_defaults or {})
        self.tracer = tracer  # an OpenTelemetry tracer while tracing is on
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name
        self.max_model_len = engine.max_model_len
        # None: this tokenizer gives no sound bound (docs/serve.md); the prefix guard remains.
        self.max_prompt_chars = self.tokenizer.max_chars(self.max_model_len)
        self.created = int(time.time())
        # Runtime-loaded adapters must lie below it (None: any path -- the in-process engine,
        # whose caller is trusted; the HTTP app gates the route and always sets one).
        self.lora_adapter_root = lora_adapter_root
        self._preprocess = ThreadPoolExecutor(preprocess_threads, "tandem-preprocess")
        self._closed = False
        # The format ``tool_choice: auto`` parses (the template's own, or the override).
        self.tool_parser = parser_for(self.tokenizer.chat_template, tool_call_parser)

    def close(self) -> None:
        """Let go of its threads (its engine is gone: the owner made a new one)."""
        self._closed = True
        self._preprocess.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        gone = APIError(503, "the cluster went away; a new one is being connected: retry")
        if self._closed:
            raise gone
        try:
            return await asyncio.get_running_loop().run_in_executor(self._preprocess, fn, *args)
        except asyncio.CancelledError:
            if self._closed:  # its queued work was cancelled by ``close``, not its caller
                raise gone from None
            raise

    async def completion_jobs(self, req: CompletionRequest) -> list[Job]:
        """One ``Job`` per prompt (tokenized, checked, with its sampling params); 400s."""
        self._check_logit_bias(req.logit_bias_ids())
        self._check_priority(req.priority)
        for prompt in req.prompts():
            if isinstance(prompt, str):
                self._check_chars(len(prompt), "prompt")
        jobs: list[Job] = await self._off_loop(self._completion_jobs, req)
        return jobs

    def _completion_jobs(self, req: CompletionRequest) -> list[Job]:
        self._check_structured(req)
        jobs = []
        for i, prompt in enumerate(req.prompts()):
            text: str | None
            if isinstance(prompt, str):
                ids, text = self._encode(prompt, "prompt", req.add_special_tokens), prompt
            else:
                ids, text = list(prompt), None
            # Checked before echo decodes the ids: one past the tokenizer's integer type
            # (2**32 and up) makes decode raise OverflowError, a 500 instead of this 400.
            self._check_ids(ids, "prompt")
            if text is None and req.echo:
                text = self.tokenizer.decode(ids, skip_special_tokens=False)
            # echo with max_tokens 0: one token is generated (and dropped) to get the
            # prompt's logprobs, as vLLM does.
            wanted = 1 if req.echo_only else req.max_tokens
            if req.echo_only and req.min_tokens:
                raise APIError(
                    400,
                    "min_tokens must be 0 with max_tokens 0 (echo: the prompt alone)",
                    param="min_tokens",
                )
            max_tokens = self._max_tokens(len(ids), wanted, "prompt", req.min_tokens)
            params = req.sampling_params(
                max_tokens, req.logprobs, req.echo_logprobs, self.sampling_defaults
            )
            jobs.append(Job(ids, text, params, i * req.n, echo_only=req.echo_only))
        return jobs

    async def chat_job(self, req: ChatCompletionRequest) -> Job:
        """The conversation rendered with the chat template, checked; 400s."""
        self._check_logit_bias(req.logit_bias_ids())
        self._check_priority(req.priority)
        messages = [m.as_template_input() for m in req.messages]
        self._check_chars(sum(len(m["content"]) for m in messages), "messages")
        job: Job = await self._off_loop(self._chat_job, req, messages)
        return job

    def _render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> str:
        # chat_template_kwargs override the request's own settings, as in vLLM
        options = {"add_generation_prompt": add_generation_prompt, **(template_kwargs or {})}
        try:
            text: str = self.tokenizer.apply_chat_template(messages, **options)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        except Exception as exc:  # a template that fails on these messages
            raise APIError(400, f"the chat template failed: {exc}", param="messages") from None
        return text

    def _chat_job(self, req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> Job:
        self._check_structured(req)
        tools = req.tool_dicts() if req.tool_mode not in (None, "none") else None
        text = self._render_with_tools(
            messages, tools, req.add_generation_prompt, req.chat_template_kwargs
        )
        # The template writes BOS itself when the model wants one (add_special_tokens off).
        ids = self._encode(text, "messages", req.add_special_tokens)
        self._check_ids(ids, "messages")
        field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        max_tokens = self._max_tokens(
            len(ids), req.requested_max_tokens, "messages", req.min_tokens, field
        )
        params = req.sampling_params(max_tokens, req.num_logprobs, None, self.sampling_defaults)
        if req.tool_mode == "auto" and self.tool_parser == "hermes":
            # The <tool_call> tags may be special tokens: the parser must see them (vLLM).
            params = params.model_copy(update={"skip_special_tokens": False})
        return Job(ids, None, params, 0)

    # -- tokens (vLLM's /tokenize and /detokenize) ------------------------------------------
    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        """The ids a prompt (or a conversation, through the chat template) becomes, as a
        completion or chat request would send them: ``count``, ``max_model_len``, ``tokens``
        and, when asked, ``token_strs``. 404 for an unknown model; a text longer than the
        context is counted whole (as vLLM does)."""
        if req.model is not None:
            await self.resolve(req.model)
        # As vLLM: the whole text is counted, past the context too (clients tokenize to
        # truncate); the body limit bounds it.
        ids: list[int]
        if isinstance(req, TokenizeChatRequest):
            messages = [m.as_template_input() for m in req.messages]
            ids = await self._off_loop(self._tokenize_chat, req, messages)
        else:
            ids = await self._off_loop(self.tokenizer.encode, req.prompt, req.add_special_tokens)
        result: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        if req.return_token_strs:
            result["token_strs"] = [self.tokenizer.id_to_token(t) for t in ids]
        return result

    def _tokenize_chat(self, req: TokenizeChatRequest, messages: list[dict[str, Any]]) -> list[int]:
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
        text = self._render_with_tools(
            messages, tools, req.add_generation_prompt, req.chat_template_kwargs
        )
        return self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)

    def _render_with_tools(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> str:
        """Render a conversation with its tools and tool history (``template_messages``);
        a template that refuses the fallback prompt's system message gets it in the first
        user message instead."""
        template = self.tokenizer.chat_template
        rendered, extra = template_messages(messages, tools, template)
        kwargs = {**extra, **(template_kwargs or {})}
        try:
            return self._render_chat(rendered, add_generation_prompt, kwargs)
        except APIError:
            if not tools or template_supports_tools(template):
                raise
            rendered, extra = template_messages(messages, tools, template, system_role=False)
            return self._render_chat(rendered, add_generation_prompt, {**extra, **kwargs})

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        """The text of ``tokens`` (special tokens kept, as vLLM does); 400 naming the first id
        outside the vocabulary, 404 for an unknown model."""
        if req.model is not None:
            await self.resolve(req.model)
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(
                400, f"token id {bad} is outside the vocabulary (size {vocab})", param="tokens"
            )
        text = await self._off_loop(self.tokenizer.decode, req.tokens, False)
        return {"prompt": text}

    # -- running -----------------------------------------------------------------------------
    async def run(
        self,
        request_id: str,
        jobs: list[Job],
        lora: LoRARequest | None,
        priority: int,
        trace_context: dict[str, str] | None = None,
    ) -> Outputs:
        """Start every job and return their outputs, merged, as they come. Every job's first
        output is awaited here, so a request the engine refuses -- it raises, or its first
        output is a failed sample (a rejection, a failed admission) -- is an ``APIError``
        before any output: the status a whole response would have, never a 200 stream of one
        error event. Closing the returned stream aborts every job."""
        streams = [
            self.engine.generate_async(
                job.prompt_ids,
                job.params,
                request_id=f"{request_id}-{k}" if len(jobs) > 1 else request_id,
                lora_request=lora,
                priority=priority,
                trace_context=trace_context,
                prompt_index=k,
            )
            for k, job in enumerate(jobs)
        ]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        try:
            await asyncio.wait(firsts, return_when=asyncio.FIRST_EXCEPTION)
            for first in firsts:
                if first.done() and first.exception() is not None:
                    raise first.exception()  # type: ignore[misc]
        except BaseException as exc:
            # One refused (or the client left): the others stop where they are -- their
            # first outputs are cancelled, which aborts them, before their streams close (a
            # stream still running its __anext__ cannot be closed).
            for first in firsts:
                first.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
            if isinstance(exc, asyncio.CancelledError | StopAsyncIteration):
                raise
            raise api_error(exc) from None
        results = [first.result() for first in firsts]
        failed = [s for r in results for s in r.outputs if ended_by_cluster(s)]
        if failed:  # the others stop where they are (closing a stream aborts its job)
            await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
            raise sample_error(failed[0])
        # (its closing aborts every job read or not)
        return ClosingGenerator(
            _outputs(jobs, streams, results),
            lambda: asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True),
        )

    def tool_plan(self, req: ChatCompletionRequest) -> ToolPlan | None:
        """How the answer's tool calls are read (None: plain text)."""
        mode = req.tool_mode
        if mode is None or mode == "none":
            return None
        choice = req.tool_choice
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        names = tuple(tool.function.name for tool in req.tools or [])
        parallel = req.parallel_tool_calls is not False
        return ToolPlan(mode, self.tool_parser, name, names, parallel)

    # -- endpoints ---------------------------------------------------------------------------
    async def completion(
        self, req: CompletionRequest, trace_headers: dict[str, str] | None = None
    ) -> dict[str, Any] | Any:
        """``/v1/completions``: the response body, or (``stream``) its SSE chunks."""
        req.model = req.model or self.model_name  # optional, as in vLLM: the served model
        with APISpan(self.tracer, "text_completion", req, trace_headers) as span:
            lora = await self.resolve(req.model)
            jobs = await self.completion_jobs(req)
            rid = f"cmpl-{uuid.uuid4().hex}"
            outputs = await self.run(rid, jobs, lora, req.priority, span.context)
            if req.stream:
                chunks = completion_chunks(rid, req, jobs, outputs, span, self.tokenizer)
                return span.stream(chunks, outputs)
            body = completion_response(rid, req, jobs, await _collect(outputs), self.tokenizer)
            span.record(rid, body["usage"], finish_reasons(body))
            return body

    async def chat(
        self, req: ChatCompletionRequest, trace_headers: dict[str, str] | None = None
    ) -> dict[str, Any] | Any:
        """``/v1/chat/completions``: the response body, or (``stream``) its SSE chunks."""
        req.model = req.model or self.model_name  # optional, as in vLLM: the served model
        with APISpan(self.tracer, "chat", req, trace_headers) as span:
            lora = await self.resolve(req.model)
            job = await self.chat_job(req)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            outputs = await self.run(rid, [job], lora, req.priority, span.context)
            tools = self.tool_plan(req)
            if req.stream:
                chunks = chat_chunks(rid, req, job, outputs, span, self.tokenizer, tools)
                return span.stream(chunks, outputs)
            body = chat_response(rid, req, job, await _collect(outputs), self.tokenizer, tools)
            span.record(rid, body["usage"], finish_reasons(body))
            return body


async def _outputs(jobs: list[Job], streams: list[Any], firsts: list[RequestOutput]) -> Outputs:
    """The first outputs, then every job's later ones through the one merge helper."""
    try:
        for job, first in zip(jobs, firsts, strict=True):
            yield job, first
        live = [k for k, first in enumerate(firsts) if not first.finished]
        async with aclosing(merge_streams([streams[k] for k in live])) as merged:
            async for i, out in merged:
                yield jobs[live[i]], out
    finally:
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)


async def _collect(outputs: Outputs) -> Finals:
    """Every job's final output; a sample that failed makes the whole request fail at
    once, as a stream does: the other samples and prompts are aborted then (``outputs``
    closed), not run to their end for a response that is an error anyway."""
    finals: Finals = {}
    failed: CompletionOutput | None = None
    async with aclosing(outputs):
        try:
            async for job, out in outputs:
                finals[job.first_index] = out
                failed = next((s for s in out.outputs if ended_by_cluster(s)), None)
                if failed is not None:  # the cluster failed it (as the stream)
                    break
        except Exception as exc:  # e.g. the stream lost with the cluster: a 503, as streamed
            raise api_error(exc) from None
    if failed is not None:
        raise sample_error(failed)
    return finals
