"""``EventStream``: the HTTP API's server-sent-event response, which always closes its body.

Starlette's ``StreamingResponse`` leaves its body iterator as it stopped: on a client gone
under ASGI spec 2.4 (it raises ``ClientDisconnect``), or before the first chunk under 2.3
(the task reading the body is cancelled before it has begun, so no ``finally`` of the body
runs). The body holds the request's engine outputs: left unclosed, its requests went on
generating for nobody until the collector found the stream, which a reference cycle can
delay without bound. This response closes the body when it ends, however it ends.
"""

from __future__ import annotations

from typing import Any

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
