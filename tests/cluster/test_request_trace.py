"""The span tree of a disaggregated request, built in process with an in-memory exporter
(the multi-node, over-the-wire version is tests/cluster/test_serve_tracing.py)."""

from __future__ import annotations

import time
from typing import Any

import pytest

sdk = pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

from cluster.openai_protocol import ChatCompletionRequest  # noqa: E402
from cluster.request_trace import RequestTrace  # noqa: E402
from cluster.tracing import end_api_span, extract, inject, start_api_span  # noqa: E402


@pytest.fixture
def traced() -> Any:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_disaggregated_request_span_tree(traced: Any) -> None:
    tracer, exporter = traced
    caller = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    )
    api = start_api_span(tracer, "chat", req, {"TraceParent": caller})
    trace = RequestTrace(tracer, extract(inject(api)), "r1", 10, time.monotonic())
    trace.scheduled("p-0", "prefill", "node-p")
    trace.handed_off("d-0", "node-d", "grpc", 3)
    trace.tokens(1, 4, "p-0", "node-p")  # the first token, from the prefill instance
    trace.kv_loaded(0.02, 4096, True)
    trace.tokens(2, 4, "d-0", "node-d")
    trace.finish("length", None)
    usage = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    end_api_span(api, "chatcmpl-1", usage, ["length"])

    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {
        "chat m",
        "tandem.request",
        "tandem.queue",
        "tandem.prefill",
        "tandem.kv_transfer",
        "tandem.decode",
    }
    root = spans["chat m"]
    assert root.context.trace_id == int("ab" * 16, 16) and root.parent.span_id == int("cd" * 8, 16)
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.usage.output_tokens"] == 3
    assert tuple(root.attributes["gen_ai.response.finish_reasons"]) == ("length",)
    request = spans["tandem.request"]
    assert request.parent.span_id == root.context.span_id
    for name in ("tandem.queue", "tandem.prefill", "tandem.kv_transfer", "tandem.decode"):
        assert spans[name].parent.span_id == request.context.span_id
        assert spans[name].context.trace_id == root.context.trace_id
    assert spans["tandem.prefill"].attributes["tandem.node_id"] == "node-p"
    assert spans["tandem.prefill"].attributes["tandem.cached_tokens"] == 4
    assert spans["tandem.decode"].attributes["tandem.node_id"] == "node-d"
    assert spans["tandem.decode"].attributes["gen_ai.usage.output_tokens"] == 3
    kv = spans["tandem.kv_transfer"].attributes
    assert kv["tandem.kv.transport"] == "grpc" and kv["tandem.kv.bytes"] == 4096
    assert kv["tandem.kv.blocks"] == 3 and kv["tandem.kv.outcome"] == "ok"
    assert [e.name for e in request.events] == ["first_token"]


def test_failed_load_and_abort_are_events(traced: Any) -> None:
    tracer, exporter = traced
    trace = RequestTrace(tracer, None, "r2", 5, time.monotonic())
    trace.scheduled("p-0", "prefill", None)
    trace.handed_off("d-0", None, "ray", 2)
    trace.tokens(1, 0, "p-0", None)
    trace.kv_loaded(2.0, 0, False)
    trace.moved("instance d-0: a worker died")
    trace.finish("abort", None)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    events = [e.name for e in spans["tandem.request"].events]
    assert events == ["first_token", "recompute_fallback", "moved", "abort"]
    assert spans["tandem.kv_transfer"].status.is_ok is False
    assert not spans["tandem.request"].parent  # no caller: a root span


def test_tracing_off_makes_no_spans() -> None:
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    )
    assert start_api_span(None, "chat", req, {}) is None
    end_api_span(None)  # a no-op
