"""``EventStream``: the HTTP API's server-sent-event response, which always closes its body.

Starlette's ``StreamingResponse`` leaves its body iterator as it stopped: on a client gone
under ASGI spec 2.4 (it raises ``ClientDisconnect``), or before the first chunk under 2.3
(the task reading the body is cancelled before it has begun, so no ``finally`` of the body
runs). The body holds the request's engine outputs: left unclosed, its requests went on
generating for nobody until the collector found the stream, which a reference cycle can
delay without bound. This response closes the body when it ends, however it ends.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Generic, TypeVar

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response of ``chunks`` (an async iterator of strings) that
    closes ``chunks`` (``aclose``) once sent, failed or cancelled."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close: Any = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                with anyio.CancelScope(shield=True):  # runs when the request was cancelled
                    await close()


T = TypeVar("T")


class ClosingGenerator(AsyncGenerator[T, None], Generic[T]):
    """``gen``, whose closing also runs ``on_close`` -- however early: an async generator
    closed (or dropped) before its first step runs no ``finally``, so what it reads from
    (engine streams, a chat stream under another API) would stay open and its requests run
    on with no one to read them."""

    def __init__(self, gen: AsyncGenerator[T, None], on_close: Callable[[], Awaitable[Any]]):
        self._gen, self._on_close = gen, on_close

    def asend(self, value: None) -> Any:
        return self._gen.asend(value)

    def athrow(self, *args: Any) -> Any:
        return self._gen.athrow(*args)

    async def aclose(self) -> None:
        try:
            await self._gen.aclose()
        finally:
            await self._on_close()
