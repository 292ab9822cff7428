"""``tandem.v1.Generate`` (cluster/proto/tandem.proto) on the ingress: the request becomes a
``CompletionRequest`` (the HTTP API's validation, word for word), runs through
``OpenAIServing``'s public methods, and each streamed step becomes a ``GenerateResponse``;
``APIError`` statuses map to gRPC status codes.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

import grpc
from pydantic import ValidationError

from cluster.observability.api_span import APISpan
from cluster.serving.auth import check_api_key
from cluster.serving.errors import (
    APIError,
    api_error,
    body_path,
    ended_by_cluster,
    sample_error,
)
from cluster.serving.openai_protocol import CompletionRequest
from cluster.serving.openai_serving import OpenAIServing

STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


def completion_request(message: Any) -> CompletionRequest:
    """The HTTP body equivalent of a ``GenerateRequest`` (unset optional fields stay unset)."""
    # proto3 has no unset string: "" means no model given (the served one, as over HTTP).
    body: dict[str, Any] = {"model": message.model or None, "stream": True}
    if message.prompt_token_ids:
        body["prompt"] = list(message.prompt_token_ids)
    else:
        body["prompt"] = message.prompt
    body["max_tokens"] = message.max_tokens if message.HasField("max_tokens") else None
    for name in ("temperature", "top_p", "top_k", "min_p", "seed"):
        if message.HasField(name):
            body[name] = getattr(message, name)
    if message.stop:
        body["stop"] = list(message.stop)
    if message.stop_token_ids:
        body["stop_token_ids"] = list(message.stop_token_ids)
    body.update(
        min_tokens=message.min_tokens,
        ignore_eos=message.ignore_eos,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        priority=message.priority,
    )
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as exc:
        fields = [
            ".".join(body_path(list(e["loc"]), body, e["type"] == "missing")) or "request"
            for e in exc.errors()
        ]
        problems = [f"{f}: {e['msg']}" for f, e in zip(fields, exc.errors(), strict=True)]
        raise APIError(400, "; ".join(problems), param=fields[0]) from None


def _metadata(grpc_context: Any, key: str) -> str | None:
    if grpc_context is None:
        return None
    for k, v in grpc_context.invocation_metadata():
        if k.lower() == key:
            return str(v)
    return None


async def generate_stream(
    serving: Callable[[], Awaitable[OpenAIServing]],
    api_key: str | None,
    message: Any,
    grpc_context: Any,
) -> AsyncGenerator[Any, None]:
    """The ``GenerateResponse`` stream of one call. ``serving``: the ingress's (connects on
    first use; a failure to connect is this call's error, with its status code). The call is
    an ingress span as an HTTP request is, in the caller's trace (``traceparent`` in the
    call's metadata), so the request's trace begins at the ingress here too."""
    from cluster.proto import tandem_pb2

    span: APISpan | None = None
    try:
        check_api_key(api_key, _metadata(grpc_context, "authorization"))
        request = completion_request(message)
        api = await serving()
        request.model = request.model or api.model_name  # the served one, as over HTTP
        headers = {} if grpc_context is None else dict(grpc_context.invocation_metadata())
        span = APISpan(api.tracer, "text_completion", request, headers)
        lora = await api.resolve(request.model)
        jobs = await api.completion_jobs(request)
        if len(jobs) != 1:
            raise APIError(400, "one prompt per call")
        job = jobs[0]
        rid = f"grpc-{uuid.uuid4().hex}"
        outputs = await api.run(rid, jobs, lora, request.priority, span.context)
        async with aclosing(outputs):  # the caller leaving aborts the request
            async for _, out in outputs:
                sample = out.outputs[0]
                if ended_by_cluster(sample):
                    raise sample_error(sample)
                if not (sample.new_token_ids or sample.new_text or sample.finished):
                    continue
                response = tandem_pb2.GenerateResponse(
                    request_id=rid,
                    text=sample.new_text,
                    token_ids=sample.new_token_ids,
                    finish_reason=sample.finish_reason or "",
                    stop_reason="" if sample.stop_reason is None else str(sample.stop_reason),
                )
                if sample.finished:
                    usage = tandem_pb2.Usage(
                        prompt_tokens=len(job.prompt_ids),
                        completion_tokens=len(sample.token_ids),
                        cached_tokens=out.num_cached_tokens,
                    )
                    response.usage.CopyFrom(usage)
                    span.record(rid, _usage(usage), [sample.finish_reason or ""])
                yield response
    except Exception as exc:
        error = exc if isinstance(exc, APIError) else api_error(exc)  # 500: no details leak
        if span is not None:
            span.end(error)
        if grpc_context is None:
            raise error from None
        grpc_context.set_code(STATUS_CODES.get(error.status, grpc.StatusCode.INTERNAL))
        grpc_context.set_details(error.message)
        raise error from None
    finally:
        if span is not None:  # (once: not again after an error; the caller left: as is)
            span.end()


def _usage(usage: Any) -> dict[str, Any]:
    """A ``Usage`` message as the HTTP API's usage object (what ``APISpan.record`` reads)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class _KeyCheck(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The API key, checked from a call's metadata before its message is read -- as the HTTP
    API checks it before the body (``auth.KeyCheck``): without the key, a caller cannot make
    this replica receive a message of up to the size limit on each of its concurrent calls.
    (``generate_stream`` checks it again: the same check behind Serve's proxy.)"""

    def __init__(self, api_key: str) -> None:
        self._api_key = api_key

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        metadata = details.invocation_metadata or ()
        authorization = next((str(v) for k, v in metadata if k.lower() == "authorization"), None)
        try:
            check_api_key(self._api_key, authorization)
        except APIError as exc:
            message = exc.message

            async def refuse(request_iterator: Any, context: Any) -> None:
                # A client-streaming handler: it ends the call without reading the message.
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

            return grpc.stream_unary_rpc_method_handler(refuse)
        return await continuation(details)


class IngressGenerateServer:
    """``tandem.v1.Generate`` served by an ingress replica itself: over TLS (Serve's gRPC
    proxy has none), or plaintext bound to ``host`` (the proxy binds every interface). A
    ``grpc.aio`` server on the replica's event loop, bound to ``host:port`` with
    ``SO_REUSEPORT``, so the replicas on one node share the port and the kernel spreads
    connections over them. Same validation, auth and status codes as the proxied service."""

    def __init__(
        self,
        serving: Callable[[], Awaitable[OpenAIServing]],
        api_key: str | None,
        address: str,
        certfile: str | None,
        keyfile: str | None,
        max_message_bytes: int,
        max_concurrent_calls: int,
    ) -> None:
        from pathlib import Path

        self._serving = serving
        self._api_key = api_key
        self.address = address
        self.failure: BaseException | None = None  # why it could not start (health check)
        self._options = [
            ("grpc.so_reuseport", 1),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        self._max_concurrent_calls = max_concurrent_calls
        self.tls = certfile is not None and keyfile is not None
        self._credentials = (
            grpc.ssl_server_credentials([(Path(keyfile).read_bytes(), Path(certfile).read_bytes())])
            if certfile is not None and keyfile is not None
            else None
        )
        self._server: Any = None

    async def start(self) -> None:
        from cluster.proto import tandem_pb2_grpc

        server = grpc.aio.server(
            options=self._options,
            maximum_concurrent_rpcs=self._max_concurrent_calls,
            interceptors=None if self._api_key is None else [_KeyCheck(self._api_key)],
        )
        tandem_pb2_grpc.add_GenerateServicer_to_server(self, server)
        try:
            if self._credentials is None:
                server.add_insecure_port(self.address)
            else:
                server.add_secure_port(self.address, self._credentials)
            await server.start()
        except BaseException as exc:
            self.failure = exc
            raise
        self._server = server

    async def stop(self, grace: float | None = None) -> None:
        """Take no new call; those in flight get ``grace`` seconds to end (None: ended now)."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace=grace)

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        try:
            stream = generate_stream(self._serving, self._api_key, request, context)
            async with aclosing(stream):  # closed now (the caller left): aborts the request
                async for response in stream:
                    yield response
        except APIError as exc:  # generate_stream set the code; end the call with it
            code = STATUS_CODES.get(exc.status, grpc.StatusCode.INTERNAL)
            await context.abort(code, exc.message)
