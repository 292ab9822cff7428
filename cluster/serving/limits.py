"""The HTTP API's body limit: a pure ASGI middleware that answers 413 before a body over
``serve.max_request_body_bytes`` is parsed -- at once from its ``Content-Length``, or, for a
chunked body, as soon as the bytes received pass the limit. (Serve's HTTP proxy has read the
body into its memory by then, whatever this replica answers: a limit in front of Serve bounds
that, docs/deploy.md.)

Serve freezes the FastAPI app when the ingress class is decorated, so the limit cannot be a
constructor argument: each ingress replica (a process of its own) sets it with
``set_max_body_bytes`` when it starts, and the middleware reads it per request.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from cluster.serving.errors import APIError

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
_limit = {"max_body_bytes": DEFAULT_MAX_BODY_BYTES}


def set_max_body_bytes(limit: int) -> None:
    """This process's body limit (the ingress replica's ``serve.max_request_body_bytes``)."""
    _limit["max_body_bytes"] = limit


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than the limit of {limit} bytes")


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a chunked body passes the limit mid-read (an
    ``HTTPException``, so FastAPI's body parsing lets it through to the app's handler for it,
    instead of making it a 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413)
        self.limit = limit


class BodyLimit:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = _limit["max_body_bytes"]
        for name, value in scope.get("headers", ()):
            if name.lower() == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0  # malformed: the server (or the parser) answers it
                if declared > limit:
                    await _refuse(send, limit)
                    return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge:  # read outside a route's body parsing (the app has no handler)
            if not started:
                await _refuse(send, limit)


async def _refuse(send: Send, limit: int) -> None:
    error = body_too_large(limit)
    body = json.dumps(error.body()).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
