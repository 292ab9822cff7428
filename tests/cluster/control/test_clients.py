"""``Clients``: a client's outbox and its stream from the SchedulerActor. A client that
subscribes again while its earlier stream still runs there (it saw that stream fail: a
connection lost for a while, not the actor) gets its outbox: the earlier stream stops taking
from it, and its end drops nobody."""

from __future__ import annotations

import asyncio

import pytest

from cluster.control.clients import Clients
from scheduler.outputs import EngineCoreOutput


def test_a_client_subscribing_again_takes_over_its_outbox_and_stays() -> None:
    dropped: list[str] = []
    clients = Clients({}, lambda rid: True, timeout_s=30.0, on_drop=dropped.append)

    async def main() -> None:
        old = clients.stream("c")
        first = asyncio.ensure_future(old.__anext__())
        for _ in range(3):
            await asyncio.sleep(0)  # the first stream waits for outputs
        new = clients.stream("c")
        second = asyncio.ensure_future(new.__anext__())
        for _ in range(3):
            await asyncio.sleep(0)
        assert first.done() and isinstance(first.exception(), StopAsyncIteration)
        assert dropped == [] and not clients.outbox("c").closed  # not dropped by its end
        out = EngineCoreOutput("r", [7])
        clients.outbox("c").put("tag", out, 0)
        assert await asyncio.wait_for(second, 5) == [("tag", out, 0)]  # the new one has it
        await old.aclose()
        assert dropped == []
        await new.aclose()  # the latest stream's end drops the client
        assert dropped == ["c"]

    asyncio.run(main())


def test_a_batch_taken_by_a_stream_taken_over_goes_to_the_new_one() -> None:
    clients = Clients({}, lambda rid: True, timeout_s=30.0)

    async def main() -> None:
        old = clients.stream("c")
        clients.outbox("c").put("tag", EngineCoreOutput("r", [7]), 0)
        await old.__anext__()  # the first stream hands a batch on (and stops at its yield)
        new = clients.stream("c")
        second = asyncio.ensure_future(new.__anext__())
        for _ in range(3):
            await asyncio.sleep(0)  # the second stream waits for outputs
        out = EngineCoreOutput("r", [8, 9])
        clients.outbox("c").put("tag", out, 1)
        with pytest.raises(StopAsyncIteration):  # the first goes on: takes it, puts it back
            await old.__anext__()
        assert await asyncio.wait_for(second, 5) == [("tag", out, 1)]
        await new.aclose()

    asyncio.run(main())


def test_an_ask_for_tokens_a_broken_stream_took_is_made_again_on_the_new_stream() -> None:
    """The central actor asked a client for the tokens it has of requests on a dead engine
    (``ask_resume``), and the client's stream, broken on its side, took the ask: the client
    subscribed again and nothing asked again -- the requests waited out their resume time and
    failed instead of moving. A new stream of a client whose old one still runs here asks
    again for every request still waiting."""
    from cluster.control.migration import Migration

    central = Migration()
    central._orphans = {("c", 7): ("r@1", "d-0", "its engine died")}
    central.clients = Clients(
        {}, lambda rid: True, timeout_s=30.0, on_resubscribe=central._ask_again
    )

    async def main() -> None:
        old = central.clients.stream("c")
        taken = asyncio.ensure_future(old.__anext__())
        await asyncio.sleep(0.01)
        assert central.clients.ask_resume("c", "d-0", [7])
        # yielded by the old stream, whose client had left it: lost
        assert await asyncio.wait_for(taken, 5) == {"resume": [("d-0", [7])]}
        new = central.clients.stream("c")  # the client subscribes again
        assert await asyncio.wait_for(new.__anext__(), 1) == {"resume": [("d-0", [7])]}
        await old.aclose()
        await new.aclose()

    asyncio.run(main())


def test_a_stream_taken_over_leaves_the_wake_up_of_an_ask_to_the_new_one() -> None:
    """An old stream (its link broken) that wakes for an ask, sees it was taken over and
    leaves, cleared the wake-up: the new stream slept on with the ask unsent."""
    clients = Clients({}, lambda rid: True, timeout_s=30.0)

    async def main() -> None:
        old = clients.stream("c")
        clients.outbox("c").put("tag", EngineCoreOutput("r", [7]), 0)
        await old.__anext__()  # the old one at its yield (sending into a broken link)
        new = clients.stream("c")
        clients.outbox("c").put("tag", EngineCoreOutput("r", [8]), 1)
        await new.__anext__()  # the new one at its yield too
        assert clients.ask_resume("c", "d-0", [7])
        with pytest.raises(StopAsyncIteration):
            await old.__anext__()  # takes the wake-up, sees the new one, leaves
        assert await asyncio.wait_for(new.__anext__(), 1) == {"resume": [("d-0", [7])]}
        await old.aclose()
        await new.aclose()

    asyncio.run(main())
