"""The Ray Serve application: Tandem's OpenAI-compatible HTTP API and its gRPC service.

Two deployments::

    HTTP :8000 / gRPC :9000 ─▶ OpenAIIngress (N replicas: tokenize, validate, detokenize)
                                   │  token ids, straight to the actor (submit; one batched
                                   ▼  subscribe stream per replica)
                          TandemCluster (1 replica) finds or builds the SchedulerActor
                                                    (detached: it outlives redeploys) ─▶ workers

``build_app(args)`` builds the application from a ``ClusterConfig`` (``args`` are its fields),
so a Serve config file runs it as ``import_path: cluster.serving.app:build_app``. The ingress
scales on its own (``serve.ingress_replicas``); every replica asks the one SchedulerActor through
its ``ClusterClient`` (an ``EngineClient``). The routes only check the API key and call
``OpenAIServing``: the API's logic does not depend on FastAPI, Serve or the engine behind it.
"""

# No `from __future__ import annotations`: FastAPI reads the routes' annotations at run time
# (Serve rebinds the methods, so string annotations would not resolve).
import asyncio
import logging
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.config import ClusterConfig, served_model_name
from cluster.engine.generation_config import sampling_defaults
from cluster.serving.agent_fields import FieldError
from cluster.serving.auth import AdminAccess, KeyCheck, check_api_key, set_access
from cluster.serving.errors import APIError, api_error, body_path
from cluster.serving.limits import BodyLimit, BodyTooLarge, body_too_large, set_max_body_bytes
from cluster.serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    ScalePoolRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from cluster.serving.openai_serving import OpenAIServing
from cluster.serving.responses_api import create_response
from cluster.serving.responses_protocol import ResponsesRequest
from cluster.serving.sse import EventStream

if TYPE_CHECKING:
    from cluster.control.client import ClusterClient

logger = logging.getLogger(__name__)

GRPC_SERVICER = "cluster.proto.tandem_pb2_grpc.add_GenerateServicer_to_server"
# How often a replica that is stopping (a redeploy, a downscale, ``tandem serve``'s exit)
# looks whether its requests are done. Serve's default, 2 s, is also the least a stop takes:
# its first look comes after one period even when nothing runs. Still graceful: it waits
# for running requests as long as before (``graceful_shutdown_timeout_s``).
SHUTDOWN_POLL_S = 0.2
# How long a stopping replica's own gRPC server (TLS, or grpc_server: ingress) lets the calls
# in flight run on. Serve does not count those calls, so they are drained in ``__del__``, its
# last call on the replica. In effect: until they end, or until Serve kills the replica at its
# graceful_shutdown_timeout_s (20 s by default), as the HTTP requests are drained.
GRPC_SHUTDOWN_GRACE_S = 3600.0

app = FastAPI(
    title="Tandem",
    description="OpenAI-compatible API of a Tandem cluster (disaggregated prefill/decode).",
    version="0.1.0",
)
app.add_middleware(BodyLimit)
app.add_middleware(KeyCheck)  # (added last: runs first, before the body limit reads it)


@app.exception_handler(BodyTooLarge)
async def _body_too_large(request: HTTPRequest, exc: BodyTooLarge) -> JSONResponse:
    error = body_too_large(exc.limit)
    return JSONResponse(error.body(), status_code=413, headers={"connection": "close"})


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes (404), wrong methods (405): OpenAI's error body, which its clients
    read (not FastAPI's {"detail": ...})."""
    message = f"{exc.detail}: {request.method} {request.url.path}"
    error = APIError(exc.status_code, message)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


@app.exception_handler(APIError)
async def _api_error(request: HTTPRequest, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
    """400 (not FastAPI's 422), naming the field and what it allows."""
    return JSONResponse(validation_error(exc).body(), status_code=400)


def validation_error(exc: RequestValidationError) -> APIError:
    """The 400 for a body FastAPI refused. ``param`` is the field's path in the body as the
    client wrote it (``prompt``, ``messages.0.content``): pydantic's ``loc`` also names the
    union member each error came from (``prompt.list[constrained-int]``), which no client
    field is; a body that is no JSON at all has no field (FastAPI's loc is a char offset)."""
    problems, param = [], None
    for error in exc.errors():
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error") or error.get("msg", "invalid JSON")
            at = list(error.get("loc", ()))[1:]
            where = f" (at character {at[0]})" if at else ""
            problems.append(f"could not parse the JSON body: {reason}{where}")
            continue
        loc = list(error.get("loc", ()))
        if loc[:1] == ["body"]:
            loc = loc[1:]
        field = ".".join(body_path(loc, exc.body, error.get("type") == "missing")) or "body"
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError):  # a check across fields names the one at fault
            field = cause.param
        param = param or field
        problem = f"{field}: {error.get('msg', 'invalid')}"
        if problem not in problems:  # (each member of a union may refuse the same check)
            problems.append(problem)
    return APIError(400, "; ".join(problems) or "invalid request", param=param)


@app.exception_handler(Exception)
async def _internal_error(request: HTTPRequest, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    return JSONResponse(APIError(500, "internal server error").body(), status_code=500)


def _respond(result: dict[str, Any] | Any) -> Any:
    # (Above the ingress: Serve freezes the app, with what it references, when decorating.)
    if isinstance(result, dict):
        return JSONResponse(result)
    return EventStream(result)


@serve.deployment(
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=64,
    graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
)
class TandemCluster:
    """The app's way to its cluster: the running one named after the app (built if there is
    none). The cluster's lifetime is explicit: it outlives this replica, so redeploying the
    app -- new ingress replicas, a new ``serve`` section -- keeps it and its requests; it ends
    with ``tandem down`` (``tandem serve`` stops it on exit)."""

    def __init__(self, config: ClusterConfig) -> None:
        from cluster.control.launch import app_cluster_name, get_or_build_cluster

        self.name = app_cluster_name(serve.get_replica_context().app_name)
        self.handle = get_or_build_cluster(config, name=self.name)

    def scheduler(self) -> Any:
        return self.handle

    async def check_health(self) -> None:
        """Serve's health check: the SchedulerActor answers."""
        await asyncio.wait_for(self.handle.describe.remote(), timeout=30)


@serve.deployment(ray_actor_options={"num_cpus": 0}, graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
@serve.ingress(app)
class OpenAIIngress:
    """HTTP routes and the gRPC method; tokenization and detokenization happen here."""

    def __init__(self, cluster: Any, config: ClusterConfig) -> None:
        self._cluster = cluster
        self._config = config
        self._model_name = served_model_name(config)
        key = config.serve.api_key
        self._api_key = None if key is None else key.get_secret_value()
        self._serving: OpenAIServing | None = None
        self._client: ClusterClient | None = None  # the engine of _serving
        self._lock = asyncio.Lock()
        set_max_body_bytes(config.serve.max_request_body_bytes)
        self._admin = AdminAccess.from_config(config.serve)
        set_access(self._api_key, self._admin)
        self._grpc_server: Any = None
        s = config.serve
        if s.generation_config not in ("auto", "vllm"):  # a folder: there now, or no start
            try:
                sampling_defaults(s.generation_config, None)
            except (OSError, ValueError) as exc:
                raise type(exc)(f"serve.generation_config: {exc}") from None
        if s.grpc_port is not None and (s.ssl_certfile is not None or s.grpc_server == "ingress"):
            # Serve's gRPC proxy is plaintext only and binds every interface: with a
            # certificate, or asked to, this replica serves the gRPC API itself, on host
            # (tandem serve then starts no gRPC proxy).
            from cluster.serving.grpc_api import IngressGenerateServer

            host = f"[{s.host}]" if ":" in s.host else s.host  # an IPv6 address
            self._grpc_server = IngressGenerateServer(
                self.serving,
                self._api_key,
                f"{host}:{s.grpc_port}",
                s.ssl_certfile,
                s.ssl_keyfile,
                max_message_bytes=s.max_request_body_bytes,
                max_concurrent_calls=s.max_ongoing_requests,
            )
            self._grpc_start = asyncio.get_running_loop().create_task(self._start_grpc_server())
        if config.serve.allow_runtime_lora_updates:
            logger.warning(
                "runtime LoRA updates are on: clients with the admin key can make the workers "
                "load adapters from below %s (do not use in production)",
                config.serve.lora_adapter_root,
            )

    async def _start_grpc_server(self) -> None:
        server = self._grpc_server
        assert server is not None
        try:
            await server.start()
            logger.info("gRPC API%s on %s", " over TLS" if server.tls else "", server.address)
        except Exception:
            logger.exception("the gRPC API could not listen on %s", server.address)

    async def check_health(self) -> None:
        """Serve's health check: unhealthy (so replaced) if its gRPC server could not start.
        It also lets go of a cluster that is gone for good (``tandem down``): TandemCluster's
        own check then fails, Serve replaces it with one that builds the cluster anew, and the
        next request here connects to that one (it would otherwise fail on the dead one for
        as long as this replica lived)."""
        server = self._grpc_server
        if server is not None and server.failure is not None:
            raise RuntimeError(f"the gRPC API failed to start: {server.failure}")
        client = self._client
        if client is not None and await client.gone():
            logger.warning("the cluster is gone: the next request connects to its successor")
            if self._client is client:
                old, self._serving, self._client = self._serving, None, None
                if old is not None:
                    old.close()

    async def __del__(self) -> None:
        """Serve's last call on a replica that stops (a redeploy, a downscale, ``tandem
        serve``'s exit), once the requests Serve counts are done. The calls of the gRPC server
        this replica runs itself are not among them: they were cut mid-stream by the kill that
        follows (and their requests generated on for nobody until the cluster dropped this
        client). The server takes no new call now and lets those in flight end."""
        server = getattr(self, "_grpc_server", None)
        if server is None:
            return
        start = getattr(self, "_grpc_start", None)
        if start is not None:  # (a server that failed to start logged it)
            await asyncio.gather(start, return_exceptions=True)
        await server.stop(grace=GRPC_SHUTDOWN_GRACE_S)

    async def serving(self) -> OpenAIServing:
        """Connect to the SchedulerActor on first use (it is ready once the app is)."""
        if self._serving is None:
            async with self._lock:
                if self._serving is None:
                    from cluster.control.client import ClusterClient
                    from kv_transfer.tracing import init_tracing

                    try:
                        handle = await self._cluster.scheduler.remote()
                        info = await handle.model_info.remote()
                    except Exception as exc:  # a cluster gone, not replaced yet: 503
                        raise api_error(exc) from None
                    try:
                        defaults = sampling_defaults(
                            self._config.serve.generation_config, info.get("model_path")
                        )
                    except (OSError, ValueError) as exc:  # the model's own file: unreadable
                        logger.error("serve.generation_config: %s", exc)  # (it names a path)
                        why = "the model's generation_config.json cannot be read (see the log)"
                        raise APIError(500, f"serve.generation_config: {why}") from None
                    client = await asyncio.to_thread(ClusterClient, handle, None, info)
                    tracer = init_tracing(self._config.tracing, "ingress")
                    # In a thread: it reads the tokenizer's whole vocabulary (the prompt bound).
                    self._serving = await asyncio.to_thread(
                        OpenAIServing,
                        client,
                        self._model_name,
                        tracer,
                        preprocess_threads=self._config.serve.preprocess_threads,
                        lora_adapter_root=self._config.serve.lora_adapter_root,
                        tool_call_parser=self._config.serve.tool_call_parser,
                        sampling_defaults=defaults,
                    )
                    from cluster.control.heap import freeze_heap

                    freeze_heap()  # the tokenizer and its vocabulary tables: never garbage
                    self._client = client
        return self._serving

    def _authorize(self, request: HTTPRequest) -> None:
        check_api_key(self._api_key, request.headers.get("authorization"))

    def _authorize_admin(self, route: str, request: HTTPRequest) -> None:
        self._admin.check(route, request.headers.get("authorization"))

    # -- OpenAI ------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models(self, request: HTTPRequest) -> JSONResponse:
        self._authorize(request)
        return JSONResponse(await (await self.serving()).models())

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: HTTPRequest) -> Any:
        self._authorize(request)
        serving = await self.serving()
        return _respond(await serving.completion(body, dict(request.headers)))

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: HTTPRequest) -> Any:
        self._authorize(request)
        serving = await self.serving()
        return _respond(await serving.chat(body, dict(request.headers)))

    @app.post("/v1/responses")
    async def responses(self, body: ResponsesRequest, request: HTTPRequest) -> Any:
        """OpenAI's Responses API, run as a chat completion (``serving/responses_api.py``)."""
        self._authorize(request)
        serving = await self.serving()
        return _respond(await create_response(serving, body, dict(request.headers)))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(
        self, body: LoadLoRAAdapterRequest, request: HTTPRequest
    ) -> PlainTextResponse:
        self._authorize_admin("lora", request)
        serving = await self.serving()
        return PlainTextResponse(await serving.load_lora_adapter(body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(
        self, body: UnloadLoRAAdapterRequest, request: HTTPRequest
    ) -> PlainTextResponse:
        self._authorize_admin("lora", request)
        serving = await self.serving()
        return PlainTextResponse(await serving.unload_lora_adapter(body))

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest, request: HTTPRequest) -> JSONResponse:
        """vLLM's /tokenize: a prompt's (or a conversation's) token ids."""
        self._authorize(request)
        return JSONResponse(await (await self.serving()).tokenize(body))

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest, request: HTTPRequest) -> JSONResponse:
        """vLLM's /detokenize: the text of token ids."""
        self._authorize(request)
        return JSONResponse(await (await self.serving()).detokenize(body))

    # -- operations --------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> JSONResponse:
        """200 when every instance's workers answer; 503 naming the ones that do not."""
        try:
            serving = await self.serving()
        except Exception as exc:  # (an open route: what the API would answer, no more)
            error = api_error(exc).message
            return JSONResponse({"status": "unavailable", "error": error}, status_code=503)
        status, body = await serving.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        from cluster.observability.exposition import CONTENT_TYPE

        serving = await self.serving()
        return PlainTextResponse(await serving.metrics(), media_type=CONTENT_TYPE)

    @app.post("/admin/scale_pool")
    async def scale_pool(self, body: ScalePoolRequest, request: HTTPRequest) -> JSONResponse:
        """Resize a pool of instances while serving (the removed ones drain first)."""
        self._authorize_admin("scaling", request)
        serving = await self.serving()
        return JSONResponse(await serving.scale_pool(body))

    # -- gRPC (tandem.v1.Generate, through Serve's gRPC proxy) -------------------------------
    async def Generate(self, request: Any, grpc_context: Any = None) -> Any:
        from cluster.serving.grpc_api import generate_stream

        stream = generate_stream(self.serving, self._api_key, request, grpc_context)
        async with aclosing(stream):  # closed now when the caller leaves: aborts the request
            async for response in stream:
                yield response


def build_app(args: dict[str, Any] | None = None) -> Any:
    """The Serve application for a ``ClusterConfig`` (``args``: its fields, as in a Serve
    config file's ``args``; empty: the built-in model, one prefill and one decode instance)."""
    from cluster.config import default_cluster_config

    config = ClusterConfig.model_validate(args) if args else default_cluster_config()
    return build_app_from_config(config)


def build_app_from_config(config: ClusterConfig) -> Any:
    s = config.serve
    cluster = TandemCluster.bind(config)  # type: ignore[attr-defined]
    ingress = OpenAIIngress.options(  # type: ignore[attr-defined]
        num_replicas=s.ingress_replicas,
        max_ongoing_requests=s.max_ongoing_requests,
        ray_actor_options={"num_cpus": s.ingress_num_cpus},
    )
    return ingress.bind(cluster, config)
