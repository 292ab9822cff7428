"""``EventStream`` closes its body however the response ends: a client gone before the first
chunk (ASGI 2.3, the body's task cancelled before it began), a client gone mid-stream (ASGI
2.4, ``ClientDisconnect``), or the stream sent in full. Starlette's ``StreamingResponse``
closed it in none of the first two: the request's engine work went on for nobody."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.requests import ClientDisconnect

from cluster.serving.sse import EventStream


@pytest.fixture(autouse=True)
def no_collector() -> Iterator[None]:
    # A reference cycle keeps an unclosed body alive until the collector runs: off here, so
    # only an explicit close counts.
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class Body:
    """A body that waits forever for its first chunk and records being closed."""

    def __init__(self) -> None:
        self.closed = False

    def __aiter__(self) -> AsyncIterator[str]:
        return self

    async def __anext__(self) -> str:
        await asyncio.Event().wait()
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self.closed = True


def _scope(spec_version: str) -> dict[str, Any]:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}}


def test_closed_when_the_client_leaves_before_the_first_chunk() -> None:
    body = Body()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(EventStream(body)(_scope("2.3"), receive, send))
    assert body.closed
    assert not any(m.get("body") for m in sent)  # nothing was streamed


def test_closed_when_the_client_leaves_mid_stream() -> None:
    ended: list[str] = []

    async def chunks() -> AsyncIterator[str]:
        try:
            for i in range(100):
                yield f"data: {i}\n\n"
        finally:
            ended.append("finally")

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    async def send(message: dict[str, Any]) -> None:
        if message.get("body"):
            raise OSError("connection reset")

    async def main() -> None:
        # Checked inside the loop: asyncio.run closes every generator left open on exit.
        with pytest.raises(ClientDisconnect):
            await EventStream(chunks())(_scope("2.4"), receive, send)
        assert ended == ["finally"]  # the generator ran its ``finally``: it was closed

    asyncio.run(main())


def test_a_stream_sent_in_full_is_sent_and_closed() -> None:
    async def chunks() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        yield "data: [DONE]\n\n"

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    body = chunks()
    response = EventStream(body)
    asyncio.run(response(_scope("2.4"), receive, send))
    assert sent[0]["type"] == "http.response.start"
    assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")
    assert [m["body"] for m in sent[1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n", b""]
    assert body.ag_frame is None  # finished
