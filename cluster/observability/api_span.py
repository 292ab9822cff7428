"""The ingress span of one API request: ``{operation} {model}`` with the OpenTelemetry GenAI
attributes, joining the caller's W3C ``traceparent`` when it sent one. The parent of the
request's spans in the SchedulerActor and the workers (``request_trace``).

The one place an API span is opened and ended. A handler runs inside it::

    with APISpan(tracer, "chat", request, headers) as span:
        ...                                   # an exception ends the span as an error
        span.record(body["id"], body["usage"], reasons)
        return body                           # ends it with the response
    # or, streaming:
        return span.stream(chunks, outputs)   # ends it when the stream ends (or is
                                              # closed or dropped unread), closing outputs

Without a tracer (tracing off) every method is a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncGenerator, AsyncIterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

from kv_transfer.tracing import extract, inject

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

# Request fields recorded as ``gen_ai.request.<name>`` when set.
_REQUEST_FIELDS = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty")
_INT64 = range(-(2**63), 2**63)  # what an OTLP attribute's int holds


def _attribute(value: Any) -> Any:
    """``value`` as an OTLP exporter can send it: an int beyond int64 (the API takes seeds
    up to 2**64) as its decimal text -- the exporter drops such an attribute and logs a
    traceback for each span that has one."""
    if isinstance(value, int) and not isinstance(value, bool) and value not in _INT64:
        return str(value)
    return value


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
        self._read = False  # its stream began (from then on asyncio closes it if dropped)
        self._ended = False
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
                attributes[f"gen_ai.request.{name}"] = _attribute(value)
        max_tokens = getattr(request, "requested_max_tokens", None) or getattr(
            request, "max_tokens", None
        )
        if max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = _attribute(max_tokens)
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

    def stream(self, chunks: AsyncIterator[str], *closing: Any) -> AsyncIterator[str]:
        """Hand the span to a response stream: it ends when the stream does (its producer
        ``record``s the outcome first), not when the handler returns. ``closing``: async
        generators the stream reads through ``chunks`` (the requests' outputs, whose closing
        aborts what still runs), closed with it -- also when the server drops the stream
        before reading it (a client gone before the first byte): a generator never started
        runs no ``finally``, so the span would never end and the requests would run on."""
        self._streaming = True
        return _SpanStream(self, chunks, closing)

    def failed(self, error: BaseException) -> None:
        """The stream failed after its 200 went out (it says so in an event and ends
        normally): the span ends as that error, found by error-rate queries as a whole
        response's failure is."""
        self._failed = error

    async def _stream(
        self, chunks: AsyncIterator[str], closing: tuple[Any, ...]
    ) -> AsyncGenerator[str, None]:
        self._read = True
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            try:
                # now, not when the collector finds them: they hold the requests' streams,
                # whose closing aborts what still runs; and first: a producer left midway
                # (its client gone) records the outcome so far as it closes
                await _close_all((chunks, *closing))
            finally:
                self.end(self._failed)

    def end(self, error: BaseException | None = None) -> None:
        """End the span (once), as an error when ``error`` is given (its HTTP status too)."""
        span, self.span = self.span, None
        self._ended = True
        if span is None or not span.is_recording():
            return
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            status = getattr(error, "status", 500)
            span.set_attribute("error.type", type(error).__name__)
            span.set_attribute("http.response.status_code", status)
            span.set_status(Status(StatusCode.ERROR, str(getattr(error, "message", "error"))))
        span.end()


_closing: set[asyncio.Task[None]] = set()


class _SpanStream(AsyncGenerator[str, None]):
    """An ``APISpan``'s response stream (``APISpan._stream``). Closed or dropped before its
    first step, it still ends the span and closes what it would have read."""

    def __init__(self, span: APISpan, chunks: AsyncIterator[str], closing: tuple[Any, ...]):
        self._span = span
        self._streams = (chunks, *closing)
        self._gen = span._stream(chunks, closing)
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        dropped = weakref.finalize(self, _dropped, span, loop, self._streams)
        dropped.atexit = False

    def asend(self, value: None) -> Any:
        return self._gen.asend(value)

    def athrow(self, *args: Any) -> Any:
        return self._gen.athrow(*args)

    async def aclose(self) -> None:
        await self._gen.aclose()  # one that began ends its span and closes in its ``finally``
        if not self._span._read:
            _unread(self._span)
            await _close_all(self._streams)


def _unread(span: APISpan) -> None:
    if not span._ended:
        if span.span is not None:
            span.span.set_attribute("tandem.stream.unread", True)
        span.end()


async def _close_all(streams: tuple[Any, ...]) -> None:
    for stream in streams:
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()


def _dropped(
    span: APISpan, loop: asyncio.AbstractEventLoop | None, streams: tuple[Any, ...]
) -> None:
    """A span's stream was collected: if it was never read, end the span and close what
    it would have read (on its loop: the collector may run in any thread). One that began
    is asyncio's to close (its ``finally`` ends the span)."""
    if span._ended or span._read:
        return
    _unread(span)
    if loop is None or loop.is_closed():
        return

    def close() -> None:
        task = loop.create_task(_close_all(streams))
        _closing.add(task)  # held: the loop keeps only a weak reference to its tasks
        task.add_done_callback(_closing.discard)

    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
        loop.call_soon_threadsafe(close)
