"""``Clients``: a client's outbox and its stream from the SchedulerActor. A client that
subscribes again while its earlier stream still runs there (it saw that stream fail: a
connection lost for a while, not the actor) gets its outbox: the earlier stream stops taking
from it, and its end drops nobody."""

from __future__ import annotations

import asyncio
import contextlib

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
        with pytest.raises(StopAsyncIteration):  # the first goes on: sees the new one, leaves it
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


def test_a_batch_a_stream_held_when_taken_over_never_lands_after_the_requests_final() -> None:
    """An old stream (its link broken) took a batch, then yielded a notice; taken over at that
    yield, it put the batch back behind what came meanwhile -- the request's final (no
    position: an error), which merged away its finish reason: the request never ended. A
    stream now takes a batch only when it has nothing else to yield and still streams."""
    from scheduler.request import FinishReason

    clients = Clients({}, lambda rid: True, timeout_s=30.0)

    async def main() -> None:
        old = clients.stream("c")
        box = clients.outbox("c")
        box.put(1, EngineCoreOutput("r", [5]), 0)
        clients.notify_engines({"d-0": None})
        assert "engines" in await old.__anext__()  # the old one at its yield, a batch due
        new = clients.stream("c")
        second = asyncio.ensure_future(new.__anext__())
        await asyncio.sleep(0)
        box.put(1, EngineCoreOutput("r", [], FinishReason.ERROR, error="x"), None)
        with pytest.raises(StopAsyncIteration):
            await old.__anext__()
        batches = [await asyncio.wait_for(second, 1)]
        with contextlib.suppress(TimeoutError):  # (the final was lost: none comes)
            while not any(o.finished for b in batches for _, o, _ in b):
                batches.append(await asyncio.wait_for(new.__anext__(), 0.5))
        tokens = [t for b in batches for _, o, _ in b for t in o.new_token_ids]
        finals = [o.finish_reason for b in batches for _, o, _ in b if o.finished]
        assert tokens == [5] and finals == [FinishReason.ERROR], batches
        await old.aclose()
        await new.aclose()

    asyncio.run(main())


def test_a_resubscribing_client_hears_of_an_engine_that_joins_as_it_takes_over() -> None:
    """The new stream's list of engines was read before it took the outbox over: an engine
    that joined in between was told only to the old stream (its link broken), and the
    client's requests there got no tokens. The list is read as the stream takes over."""
    clients = Clients({}, lambda rid: True, timeout_s=30.0)
    engines = {"d-0": "h0"}

    def listed() -> dict[str, object]:
        return {"engines": dict(engines)}

    async def main() -> None:
        old = clients.stream("c", listed)
        assert await old.__anext__() == {"engines": {"d-0": "h0"}}
        waiting = asyncio.ensure_future(old.__anext__())  # (its link broke)
        await asyncio.sleep(0)
        new = clients.stream("c", listed)  # Ray reports each item when it comes:
        engines["d-1"] = "h1"  # d-1 joins while the new one's first item is on its way
        clients.notify_engines(dict(engines))
        seen = [await asyncio.wait_for(new.__anext__(), 1)]
        for _ in range(3):
            await asyncio.sleep(0)  # the old stream runs
        assert waiting.done()
        with contextlib.suppress(TimeoutError):
            seen.append(await asyncio.wait_for(new.__anext__(), 0.2))
        assert any("d-1" in s.get("engines", {}) for s in seen), seen
        await old.aclose()
        await new.aclose()

    asyncio.run(main())


def test_a_submit_of_a_dropped_client_is_a_retryable_503() -> None:
    """A submit on its way when the central actor dropped its client (silent for
    ``client_timeout_s``, or its stream ended) failed with a bare ``RuntimeError``: the API
    answered 500 "internal server error" (and logged a bug) while the same client's open
    requests got the ``StreamLostError``'s 503. It is a 503 the client may retry -- and not
    an ``UnavailableError``, which a subscription takes for a central actor restarting and
    waits up to a minute for."""
    import pickle

    from cluster.errors import ClientDroppedError, UnavailableError
    from cluster.serving.errors import api_error

    clients = Clients({}, lambda rid: True, 5.0)
    clients.outbox("c")
    clients.drop("c")
    with pytest.raises(ClientDroppedError, match="was dropped") as caught:
        clients.outbox("c")
    exc = pickle.loads(pickle.dumps(caught.value))  # (it crosses Ray as a value)
    assert type(exc) is ClientDroppedError and isinstance(exc, RuntimeError)
    assert not isinstance(exc, UnavailableError)
    assert api_error(exc).status == 503
