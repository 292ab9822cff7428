"""``APISpan``: an API request's span ends exactly once -- with the response, as an error when
the handler raises, or when a stream it was handed to ends."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode

from cluster.observability.api_span import APISpan
from cluster.serving.errors import APIError
from cluster.serving.openai_protocol import CompletionRequest

USAGE = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


@pytest.fixture
def traced() -> tuple[Any, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def _request(stream: bool = False) -> CompletionRequest:
    return CompletionRequest.model_validate(
        {"model": "m", "prompt": "hi", "max_tokens": 2, "temperature": 0.5, "stream": stream}
    )


def test_a_whole_response_ends_the_span_with_its_outcome(traced: Any) -> None:
    tracer, exporter = traced
    with APISpan(tracer, "text_completion", _request()) as span:
        assert span.context is not None and "traceparent" in span.context
        span.record("cmpl-1", USAGE, ["length"])
        assert exporter.get_finished_spans() == ()  # not before the handler leaves
    (done,) = exporter.get_finished_spans()
    assert done.name == "text_completion m"
    assert done.attributes["gen_ai.request.temperature"] == 0.5
    assert done.attributes["gen_ai.request.max_tokens"] == 2
    assert done.attributes["gen_ai.response.id"] == "cmpl-1"
    assert done.attributes["gen_ai.usage.output_tokens"] == 2
    assert done.status.status_code == StatusCode.UNSET


def test_an_error_ends_the_span_as_an_error_with_its_status(traced: Any) -> None:
    tracer, exporter = traced
    with pytest.raises(APIError), APISpan(tracer, "text_completion", _request()):
        raise APIError(429, "overloaded")
    (done,) = exporter.get_finished_spans()
    assert done.status.status_code == StatusCode.ERROR
    assert done.attributes["http.response.status_code"] == 429
    assert done.attributes["error.type"] == "APIError"


def test_a_stream_ends_the_span_when_it_ends(traced: Any) -> None:
    tracer, exporter = traced

    async def chunks(span: APISpan) -> AsyncIterator[str]:
        for k in range(3):
            yield f"chunk {k}"
        span.record("cmpl-2", USAGE, ["stop"])

    with APISpan(tracer, "text_completion", _request(stream=True)) as span:
        stream = span.stream(chunks(span))
    assert exporter.get_finished_spans() == ()  # the handler returned; the stream goes on

    async def drain() -> list[str]:
        return [c async for c in stream]

    assert asyncio.run(drain()) == ["chunk 0", "chunk 1", "chunk 2"]
    (done,) = exporter.get_finished_spans()
    assert tuple(done.attributes["gen_ai.response.finish_reasons"]) == ("stop",)


def test_ending_twice_exports_one_span(traced: Any) -> None:
    tracer, exporter = traced
    span = APISpan(tracer, "chat", _request())
    span.end()
    span.end(error=RuntimeError("late"))
    (done,) = exporter.get_finished_spans()
    assert done.status.status_code == StatusCode.UNSET


def test_a_stream_dropped_unread_ends_its_span_and_closes_what_it_reads(traced: Any) -> None:
    """A server that drops the stream before its first step (the client left before the first
    byte): the span still ends, and what the stream would have read is closed (that aborts the
    requests), on the loop the stream was made on."""
    tracer, exporter = traced
    closed: list[str] = []

    class Outputs:
        async def aclose(self) -> None:
            closed.append("outputs")

    async def chunks() -> AsyncIterator[str]:
        yield "never"

    async def main() -> None:
        with APISpan(tracer, "chat", _request(stream=True)) as span:
            stream = span.stream(chunks(), Outputs())
        assert exporter.get_finished_spans() == ()
        del stream  # collected: never started
        for _ in range(3):
            await asyncio.sleep(0)

    asyncio.run(main())
    (done,) = exporter.get_finished_spans()
    assert done.attributes["tandem.stream.unread"] is True
    assert closed == ["outputs"]


def test_a_stream_read_to_its_end_closes_what_it_reads_once(traced: Any) -> None:
    tracer, exporter = traced
    closed: list[str] = []

    class Outputs:
        async def aclose(self) -> None:
            closed.append("outputs")

    async def chunks() -> AsyncIterator[str]:
        yield "a"

    async def main() -> list[str]:
        with APISpan(tracer, "chat", _request(stream=True)) as span:
            stream = span.stream(chunks(), Outputs())
        read = [c async for c in stream]
        del stream
        await asyncio.sleep(0)
        return read

    assert asyncio.run(main()) == ["a"]
    (done,) = exporter.get_finished_spans()
    assert "tandem.stream.unread" not in done.attributes
    assert closed == ["outputs"]


def test_a_stream_left_midway_ends_its_span_with_what_its_producer_recorded(
    traced: Any,
) -> None:
    """The client went after the first chunk: the producer records the usage so far as it
    is closed -- which came after the span had ended, so the span had none."""
    tracer, exporter = traced

    async def chunks(span: APISpan) -> AsyncIterator[str]:
        try:
            for k in range(3):
                yield f"chunk {k}"
        finally:
            span.record("cmpl-3", USAGE, ["abort"])

    with APISpan(tracer, "text_completion", _request(stream=True)) as span:
        stream = span.stream(chunks(span))

    async def leave() -> None:
        assert await anext(stream) == "chunk 0"
        await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(leave())
    (done,) = exporter.get_finished_spans()
    assert done.attributes["gen_ai.usage.output_tokens"] == 2
    assert tuple(done.attributes["gen_ai.response.finish_reasons"]) == ("abort",)


def test_ints_beyond_int64_are_recorded_as_text_the_exporter_can_send(traced: Any) -> None:
    """The API takes seeds up to 2**64 (and any top_k); OTLP's ints are int64, and its
    encoder dropped such an attribute with a logged traceback for every span."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    tracer, exporter = traced
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "seed": 2**64 - 1, "top_k": 2**63}
    with APISpan(tracer, "text_completion", CompletionRequest.model_validate(body)):
        pass
    (done,) = exporter.get_finished_spans()
    assert done.attributes["gen_ai.request.seed"] == str(2**64 - 1)
    assert done.attributes["gen_ai.request.top_k"] == str(2**63)
    assert done.attributes["gen_ai.request.max_tokens"] == 2  # in range: still an int
    encoded = encode_spans([done]).resource_spans[0].scope_spans[0].spans[0].attributes
    sent = {a.key: a.value for a in encoded}
    assert sent["gen_ai.request.seed"].string_value == str(2**64 - 1)
    assert sent["gen_ai.request.max_tokens"].int_value == 2
