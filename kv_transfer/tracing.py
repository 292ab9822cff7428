"""OpenTelemetry tracing for every process that emits spans: one trace per request, from the
ingress (joining an incoming W3C ``traceparent``) through the SchedulerActor to the workers'
KV saves and loads, exported over OTLP (gRPC or HTTP).

It lives in the lowest layer that emits spans (the KV connector's worker side), so the data
plane and the control plane share it without an upward import; OpenTelemetry itself is
imported only when tracing is on. Each process that traces calls
``init_tracing(config, component)`` once (the ingress replicas, the SchedulerActor, the
workers); it returns ``None`` when tracing is off, and every call site checks for that first,
so tracing off costs one ``is None`` test per event. The span context crosses Ray calls as a
W3C carrier dict (``inject`` / ``extract``).

Attribute names follow the OpenTelemetry GenAI conventions (``gen_ai.*``); ours are
``tandem.*``. The exporter reads the standard ``OTEL_EXPORTER_OTLP_*`` variables for whatever
``TracingConfig`` leaves unset.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

logger = logging.getLogger(__name__)


class TracingConfig(BaseModel):
    """OpenTelemetry tracing (``ClusterConfig.tracing``). Unset exporter fields fall back to the
    standard ``OTEL_EXPORTER_OTLP_*`` environment variables."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    otlp_endpoint: str | None = Field(
        None,
        description="Collector address, e.g. http://127.0.0.1:4317 (gRPC) or "
        "http://127.0.0.1:4318/v1/traces (HTTP).",
    )
    otlp_protocol: Literal["grpc", "http/protobuf"] | None = None
    sampling_ratio: float = Field(1.0, ge=0.0, le=1.0, description="Share of traces kept.")
    service_name: str = Field("tandem", min_length=1)
    export_delay_ms: int = Field(
        2000, ge=10, le=60_000, description="Longest wait before buffered spans are sent."
    )


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
        # The exporter first, the provider kept only once whole: an exporter that cannot be
        # made (an OTLP protocol it does not speak) must fail every call, not leave a
        # provider without it for the next call -- whose tracer then dropped every span of
        # the process without a word.
        processor = BatchSpanProcessor(
            _exporter(config), schedule_delay_millis=config.export_delay_ms
        )
        attributes = {"service.name": config.service_name, "tandem.component": component}
        node = _ray_node_id()
        if node is not None:
            attributes["tandem.node_id"] = node
        resource = Resource.create(attributes)
        sampler = ParentBased(TraceIdRatioBased(config.sampling_ratio))
        provider = TracerProvider(resource=resource, sampler=sampler, id_generator=_id_generator())
        provider.add_span_processor(processor)
        atexit.register(provider.shutdown)
        _provider = provider
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


# Ids the next span started in this context takes (``given_ids``), instead of random ones.
_given: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "tandem_given_span_ids", default=None
)
PARENT_KEY = "tandem-parent"  # a root carrier's entry: the root's own parent (traceparent)


def _id_generator() -> Any:
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class Ids(RandomIdGenerator):
        """Random ids, but for a span started under ``given_ids``."""

        def generate_span_id(self) -> int:
            given = _given.get()
            return super().generate_span_id() if given is None else given[1]

        def generate_trace_id(self) -> int:
            given = _given.get()
            return super().generate_trace_id() if given is None else given[0]

    return Ids()


@contextlib.contextmanager
def given_ids(trace_id: int, span_id: int) -> Iterator[None]:
    """Spans started inside take these ids (at most one should): a span made again in
    another process -- a restarted central scheduler's root of a request in flight, whose
    children elsewhere name it as their parent."""
    token = _given.set((trace_id, span_id))
    try:
        yield
    finally:
        _given.reset(token)


def root_carrier(span: Span) -> dict[str, str]:
    """``inject(span)``, plus the span's own parent (``PARENT_KEY``), so that a process
    holding the carrier can have the span made again, in place (``remade_root``)."""
    carrier = inject(span)
    parent = getattr(span, "parent", None)  # an SDK span's parent SpanContext
    if parent is not None and parent.is_valid:
        flags = int(parent.trace_flags)
        carrier[PARENT_KEY] = f"00-{parent.trace_id:032x}-{parent.span_id:016x}-{flags:02x}"
    return carrier


def sampled(carrier: dict[str, str] | None) -> bool:
    """Whether a W3C carrier names a sampled span (its ``traceparent``'s flags)."""
    parent = (carrier or {}).get("traceparent", "")
    try:
        return bool(int(parent.rsplit("-", 1)[1], 16) & 1)
    except (IndexError, ValueError):
        return False


def remade_root(carrier: dict[str, str]) -> tuple[int, int, Any] | None:
    """From a ``root_carrier``: (trace id, span id) of the root it names and the context of
    the root's parent (None: it had none); None if the carrier names no span."""
    from opentelemetry.trace import get_current_span

    root = get_current_span(extract(carrier)).get_span_context()
    if not root.is_valid or not root.trace_flags.sampled:  # (an unsampled root: none made)
        return None
    parent = extract({"traceparent": carrier[PARENT_KEY]}) if PARENT_KEY in carrier else None
    return root.trace_id, root.span_id, parent
