"""OpenTelemetry tracing: one trace per request, from the ingress (joining an incoming W3C
``traceparent``) through the SchedulerActor, exported over OTLP (gRPC or HTTP).

Each process that traces calls ``init_tracing(config.tracing, ...)`` once (the ingress
replicas, the SchedulerActor); it returns ``None`` when tracing is off, and every call site
checks for that first, so tracing off costs one ``is None`` test per event. The span context
crosses Ray calls as a W3C carrier dict (``inject`` / ``extract``).

Attribute names follow the OpenTelemetry GenAI conventions (``gen_ai.*``); ours are
``tandem.*``. The exporter reads the standard ``OTEL_EXPORTER_OTLP_*`` variables for whatever
``TracingConfig`` leaves unset.
"""

from __future__ import annotations

import atexit
import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

    from cluster.config import TracingConfig

logger = logging.getLogger(__name__)

_tracers: dict[str, Any] = {}
_provider: Any = None


def init_tracing(config: TracingConfig, component: str) -> Tracer | None:
    """This process's tracer for ``component`` (``ingress``, ``scheduler``), or None when
    tracing is off. The first call sets the process's provider and exporter."""
    global _provider
    if not config.enabled:
        return None
    if component in _tracers:
        tracer: Tracer = _tracers[component]
        return tracer
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if _provider is None:
        attributes = {"service.name": config.service_name, "tandem.component": component}
        node = _ray_node_id()
        if node is not None:
            attributes["tandem.node_id"] = node
        resource = Resource.create(attributes)
        sampler = ParentBased(TraceIdRatioBased(config.sampling_ratio))
        _provider = TracerProvider(resource=resource, sampler=sampler)
        _provider.add_span_processor(
            BatchSpanProcessor(_exporter(config), schedule_delay_millis=config.export_delay_ms)
        )
        atexit.register(_provider.shutdown)
    tracer = _provider.get_tracer(f"tandem.{component}")
    _tracers[component] = tracer
    return tracer


def _ray_node_id() -> str | None:
    try:
        import ray

        return str(ray.get_runtime_context().get_node_id()) if ray.is_initialized() else None
    except Exception:  # not in a Ray process
        return None


def _exporter(config: TracingConfig) -> Any:
    protocol = config.otlp_protocol or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    kwargs: dict[str, Any] = {}
    if config.otlp_endpoint:
        kwargs["endpoint"] = config.otlp_endpoint
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        if config.otlp_endpoint:
            kwargs["insecure"] = config.otlp_endpoint.startswith("http://") or "://" not in (
                config.otlp_endpoint
            )
        return OTLPSpanExporter(**kwargs)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPSpanExporter,
        )

        return HTTPSpanExporter(**kwargs)
    raise ValueError(f"OTLP protocol {protocol!r}: use grpc or http/protobuf")


def flush(timeout_ms: int = 5000) -> bool:
    """Export what is buffered now (tests, shutdown)."""
    return True if _provider is None else bool(_provider.force_flush(timeout_ms))


def inject(span: Span) -> dict[str, str]:
    """A W3C trace-context carrier naming ``span`` as the parent."""
    from opentelemetry.trace import set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(span))
    return carrier


def extract(carrier: dict[str, str] | None) -> Any:
    """The context in a carrier (HTTP headers or ``inject``'s dict); None if there is none."""
    if not carrier:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


def start_api_span(
    tracer: Tracer | None, operation: str, request: Any, headers: dict[str, str] | None
) -> Span | None:
    """The ingress span of one API request (``{operation} {model}``, GenAI conventions),
    joining the caller's ``traceparent`` when it sent one."""
    if tracer is None:
        return None
    from opentelemetry.trace import SpanKind

    attributes: dict[str, Any] = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": "tandem",
        "gen_ai.request.model": request.model,
        "gen_ai.request.choice.count": request.n,
        "tandem.stream": request.stream,
    }
    for name in ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty"):
        value = getattr(request, name, None)
        if value is not None:
            attributes[f"gen_ai.request.{name}"] = value
    max_tokens = getattr(request, "requested_max_tokens", None) or getattr(
        request, "max_tokens", None
    )
    if max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = max_tokens
    if request.stop:
        stops = [request.stop] if isinstance(request.stop, str) else list(request.stop)
        attributes["gen_ai.request.stop_sequences"] = stops
    lowered = {k.lower(): v for k, v in (headers or {}).items()}
    return tracer.start_span(
        f"{operation} {request.model}",
        context=extract(lowered),
        kind=SpanKind.SERVER,
        attributes=attributes,
    )


def end_api_span(
    span: Span | None,
    response_id: str | None = None,
    usage: dict[str, Any] | None = None,
    finish_reasons: list[str] | None = None,
    error: BaseException | None = None,
) -> None:
    if span is None or not span.is_recording():
        return
    from opentelemetry.trace import Status, StatusCode

    if response_id:
        span.set_attribute("gen_ai.response.id", response_id)
    if usage:
        span.set_attribute("gen_ai.usage.input_tokens", usage["prompt_tokens"])
        span.set_attribute("gen_ai.usage.output_tokens", usage["completion_tokens"])
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        span.set_attribute("tandem.usage.cached_tokens", cached)
    if finish_reasons:
        span.set_attribute("gen_ai.response.finish_reasons", finish_reasons)
    if error is not None:
        status = getattr(error, "status", 500)
        span.set_attribute("error.type", type(error).__name__)
        span.set_attribute("http.response.status_code", status)
        span.set_status(Status(StatusCode.ERROR, str(getattr(error, "message", "error"))))
    span.end()
