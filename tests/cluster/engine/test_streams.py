"""``merge_streams``: every item of every stream, tagged, with at most one item read ahead per
stream; errors surface; leaving early cancels and closes every stream. ``Mailbox``: items in
order, a waiting consumer woken by a put, a cancelled one leaving nothing behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

import pytest

from cluster.engine.streams import Mailbox, merge_streams


class Source:
    """A stream that records how far it has been read and whether it was closed."""

    def __init__(self, items: list[int], delay_s: float = 0.0, fail_at: int | None = None):
        self.items, self.delay_s, self.fail_at = items, delay_s, fail_at
        self.produced = 0
        self.closed = False

    async def stream(self) -> AsyncGenerator[int, None]:
        try:
            for k, item in enumerate(self.items):
                await asyncio.sleep(self.delay_s)
                if k == self.fail_at:
                    raise RuntimeError(f"stream failed at {k}")
                self.produced += 1
                yield item
        finally:
            self.closed = True


@pytest.mark.parametrize("num_streams", [1, 3])
def test_every_item_once_in_stream_order(num_streams: int) -> None:
    sources = [
        Source([10 * i + k for k in range(4)], delay_s=0.001 * i) for i in range(num_streams)
    ]

    async def run() -> list[tuple[int, int]]:
        return [x async for x in merge_streams([s.stream() for s in sources])]

    merged = asyncio.run(run())
    for i in range(num_streams):
        assert [item for index, item in merged if index == i] == [10 * i + k for k in range(4)]
    assert len(merged) == 4 * num_streams
    assert all(s.closed for s in sources)


def test_a_stream_is_not_read_ahead_of_the_consumer() -> None:
    """While the consumer holds an item of a stream, that stream is not asked for its next."""
    sources = [Source(list(range(5))), Source(list(range(5)))]

    async def run() -> None:
        async for index, item in merge_streams([s.stream() for s in sources]):
            await asyncio.sleep(0.005)  # a slow consumer: the other stream may run ahead by one
            assert sources[index].produced == item + 1

    asyncio.run(run())


def test_an_error_is_raised_and_the_other_streams_are_closed() -> None:
    sources = [Source(list(range(100)), delay_s=0.001), Source([1, 2, 3], fail_at=1)]

    async def run() -> None:
        async for _ in merge_streams([s.stream() for s in sources]):
            pass

    with pytest.raises(RuntimeError, match="stream failed at 1"):
        asyncio.run(run())
    assert all(s.closed for s in sources)
    assert sources[0].produced < 100


@pytest.mark.parametrize("num_streams", [1, 2])
def test_leaving_early_closes_every_stream(num_streams: int) -> None:
    sources = [Source(list(range(100)), delay_s=0.001) for _ in range(num_streams)]

    async def run() -> int:
        seen = 0
        async with aclosing(merge_streams([s.stream() for s in sources])) as merged:
            async for _ in merged:
                seen += 1
                if seen == 3:
                    break
        return seen

    assert asyncio.run(run()) == 3
    assert all(s.closed for s in sources)
    assert sum(s.produced for s in sources) <= 3 + num_streams  # at most one read ahead each


def test_no_streams_is_an_empty_merge() -> None:
    async def run() -> list[tuple[int, int]]:
        return [x async for x in merge_streams([])]

    assert asyncio.run(run()) == []


def test_mailbox_keeps_order_and_takes_what_is_there_without_waiting() -> None:
    async def main() -> None:
        box: Mailbox[int] = Mailbox()
        assert box.empty() and box.qsize() == 0
        for i in range(3):
            box.put_nowait(i)
        assert box.qsize() == 3
        assert [await box.get(), box.get_nowait(), await box.get()] == [0, 1, 2]
        assert box.empty()
        with pytest.raises(asyncio.QueueEmpty):
            box.get_nowait()

    asyncio.run(main())


def test_mailbox_wakes_a_waiting_consumer_once_per_put() -> None:
    async def main() -> None:
        box: Mailbox[str] = Mailbox()
        got: list[str] = []

        async def consume(n: int) -> None:
            for _ in range(n):
                got.append(await box.get())

        task = asyncio.ensure_future(consume(3))
        await asyncio.sleep(0)  # the consumer waits on an empty box
        box.put_nowait("a")
        await asyncio.sleep(0)
        assert got == ["a"]
        box.put_nowait("b")
        box.put_nowait("c")  # two puts before the consumer runs: both arrive, in order
        await asyncio.wait_for(task, 1.0)
        assert got == ["a", "b", "c"]

    asyncio.run(main())


def test_mailbox_consumer_cancelled_while_waiting_leaves_no_waiter() -> None:
    async def main() -> None:
        box: Mailbox[int] = Mailbox()
        task = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert box._waiter is None  # the cancelled consumer's waiter went with it
        box.put_nowait(1)  # no wake-up owed to the cancelled consumer; the item stays
        assert box.qsize() == 1
        assert await asyncio.wait_for(box.get(), 1.0) == 1

    asyncio.run(main())
