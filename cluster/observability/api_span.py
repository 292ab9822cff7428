"""The ingress span of one API request: ``{operation} {model}`` with the OpenTelemetry GenAI
attributes, joining the caller's W3C ``traceparent`` when it sent one. The parent of the
request's spans in the SchedulerActor and the workers (``request_trace``).

The one place an API span is opened and ended. A handler runs inside it::

    with APISpan(tracer, "chat", request, headers) as span:
        ...                                   # an exception ends the span as an error
        span.record(body["id"], body["usage"], reasons)
        return body                           # ends it with the response
    # or, streaming:
        return span.stream(chunks)            # ends it when the stream ends

Without a tracer (tracing off) every method is a no-op.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

from kv_transfer.tracing import extract, inject

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

# Request fields recorded as ``gen_ai.request.<name>`` when set.
_REQUEST_FIELDS = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty")


class APISpan:
    """One API request's span; ends exactly once."""

    def __init__(
        self,
        tracer: Tracer | None,
        operation: str,
        request: Any,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.span: Span | None = None
        self._streaming = False
        self._failed: BaseException | None = None  # what broke its stream after the 200
        if tracer is None:
            return
        from opentelemetry.trace import SpanKind

        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "tandem",
            "gen_ai.request.model": request.model,
            "gen_ai.request.choice.count": request.n,
            "tandem.stream": request.stream,
        }
        for name in _REQUEST_FIELDS:
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
        self.span = tracer.start_span(
            f"{operation} {request.model}",
            context=extract(lowered),
            kind=SpanKind.SERVER,
            attributes=attributes,
        )

    @property
    def context(self) -> dict[str, str] | None:
        """The span as a W3C carrier for the engine (its spans become children), or None."""
        return None if self.span is None else inject(self.span)

    def __enter__(self) -> APISpan:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.end(error=exc)
        elif not self._streaming:
            self.end()

    def record(
        self,
        response_id: str | None = None,
        usage: dict[str, Any] | None = None,
        finish_reasons: list[str] | None = None,
    ) -> None:
        """The response's id, token usage and finish reasons (before the span ends)."""
        span = self.span
        if span is None or not span.is_recording():
            return
        if response_id:
            span.set_attribute("gen_ai.response.id", response_id)
        if usage:
            span.set_attribute("gen_ai.usage.input_tokens", usage["prompt_tokens"])
            span.set_attribute("gen_ai.usage.output_tokens", usage["completion_tokens"])
            cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
            span.set_attribute("tandem.usage.cached_tokens", cached)
        if finish_reasons:
            span.set_attribute("gen_ai.response.finish_reasons", finish_reasons)

    def stream(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """Hand the span to a response stream: it ends when the stream does (its producer
        ``record``s the outcome first), not when the handler returns."""
        self._streaming = True
        return self._stream(chunks)

    def failed(self, error: BaseException) -> None:
        """The stream failed after its 200 went out (it says so in an event and ends
        normally): the span ends as that error, found by error-rate queries as a whole
        response's failure is."""
        self._failed = error

    async def _stream(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self.end(self._failed)
            close = getattr(chunks, "aclose", None)
            if close is not None:  # now, not when the collector finds it: it holds the
                await close()  # requests' streams, whose closing aborts what still runs

    def end(self, error: BaseException | None = None) -> None:
        """End the span (once), as an error when ``error`` is given (its HTTP status too)."""
        span, self.span = self.span, None
        if span is None or not span.is_recording():
            return
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            status = getattr(error, "status", 500)
            span.set_attribute("error.type", type(error).__name__)
            span.set_attribute("http.response.status_code", status)
            span.set_status(Status(StatusCode.ERROR, str(getattr(error, "message", "error"))))
        span.end()
