"""Async streams: merging several into one (the one place the front end fans streams in: the
``n`` samples of a request in ``ClusterClient``, the prompts of a request in
``OpenAIServing``), and ``Mailbox``, the queue between a stream's producer and its consumer."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")


async def merge_streams(
    streams: Sequence[AsyncIterator[T]],
) -> AsyncGenerator[tuple[int, T], None]:
    """Every stream's items as they arrive, each with its stream's index.

    A stream is asked for its next item only once its previous one has been taken, so an item
    that its stream updates in place is never changed before the consumer has seen it, and no
    copy is needed. The first error of any stream is raised here. When the merge ends --
    exhausted, an error, or the consumer closing it early -- whatever is pending is cancelled
    and every stream is closed. Close it explicitly when leaving a loop over it early
    (``contextlib.aclosing``)."""
    if len(streams) == 1:  # the common case: straight through, no tasks
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await _close(streams[0])
        return
    pending: dict[asyncio.Future[Any], int] = {
        asyncio.ensure_future(_next(s)): i for i, s in enumerate(streams)
    }
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):  # stream order on ties
                index = pending.pop(future)
                ended, item = future.result()
                if ended:
                    continue
                yield index, item
                pending[asyncio.ensure_future(_next(streams[index]))] = index
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.gather(*(_close(s) for s in streams), return_exceptions=True)


async def _next(stream: AsyncIterator[T]) -> tuple[bool, T | None]:
    """(ended, item): the end of a stream as a value, since a task cannot carry
    ``StopAsyncIteration`` out."""
    try:
        return False, await stream.__anext__()
    except StopAsyncIteration:
        return True, None


async def _close(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


class Mailbox(Generic[T]):
    """One consumer's queue of a request's outputs: ``asyncio.Queue``'s ``put_nowait`` /
    ``get`` / ``get_nowait`` / ``empty`` without its general machinery (getter and putter
    deques, bounds, task counting). A stream hands over an item per request per step, so this
    is on every token's path: an item that is already there is taken without suspending, and
    a put wakes the consumer only while it waits. One consumer only."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # (cancelled with its consumer)
                waiter.set_result(None)

    async def get(self) -> T:
        items = self._items
        while not items:
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                if self._waiter is waiter:  # cancelled: no put owes it a wake-up
                    self._waiter = None
        return items.popleft()

    def get_nowait(self) -> T:
        """The first item; ``asyncio.QueueEmpty`` if there is none."""
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)
