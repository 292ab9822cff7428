"""The order of a client's ops as the central actor receives them (``Subscription``). A real
Ray actor stands in for the central scheduler: it records each ``submit_many`` call's ops
and holds the first call until told to answer."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.cluster.conftest import RayCluster

ray = pytest.importorskip("ray")


class _Central:
    def __init__(self) -> None:
        self.calls: list[list[tuple[Any, ...]]] = []
        self.answer = asyncio.Event()

    async def submit_many(self, client_id: str, items: list[Any]) -> list[None]:
        ops = [
            ("submit", i[0].request_id, i[2])
            if isinstance(i, tuple)
            else ("abort", getattr(i, "request_id", i))  # (an id, or an op naming one)
            for i in items
        ]
        self.calls.append(ops)
        if len(self.calls) == 1:
            await self.answer.wait()  # the first call stays on its way
        return [None] * len(items)

    def release(self) -> None:
        self.answer.set()

    def recorded(self) -> list[list[tuple[Any, ...]]]:
        return self.calls

    async def subscribe(self, client_id: str) -> Any:
        await asyncio.sleep(3600)
        yield []

    def keepalive(self, client_id: str) -> None:
        return None

    def unsubscribe(self, client_id: str) -> None:
        return None

    def abort(self, request_id: str, reason: Any = None, *aimed: Any) -> None:
        self.calls.append([("direct abort", request_id)])


def test_an_id_reused_while_its_left_submit_is_on_its_way_is_not_aborted(
    ray_cluster: RayCluster,
) -> None:
    """A caller leaves while its submit is on its way and reuses the id at once: the new
    submit waits for the first call; once the first is placed, its abort goes ahead of the
    new submit (it went after it, and ended the new request instead of the old one, which
    then ran to its end for nobody)."""
    from cluster.control.subscription import Subscription
    from scheduler import Request, SamplingParams

    central = ray.remote(_Central).options(num_cpus=0, max_concurrency=8).remote()

    def request() -> Request:
        return Request("x", [1, 2], SamplingParams(max_tokens=4), eos_token_id=0)

    async def consume(sub: Subscription) -> None:
        async for _ in sub.stream(request()):
            pass

    async def main() -> list[list[tuple[Any, ...]]]:
        sub = Subscription(central, "client-1")
        first = asyncio.ensure_future(consume(sub))
        deadline = time.monotonic() + 30
        while not await central.recorded.remote():  # the first submit is on its way
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        second = asyncio.ensure_future(consume(sub))  # the id again, at once
        await asyncio.sleep(0.2)
        await central.release.remote()
        while len(await central.recorded.remote()) < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        second.cancel()
        sub.task.cancel()
        await asyncio.gather(second, sub.task, return_exceptions=True)
        calls: list[list[tuple[Any, ...]]] = await central.recorded.remote()
        return calls

    calls = asyncio.run(main())
    assert calls[0] == [("submit", "x", 0)]
    assert calls[1] == [("abort", "x"), ("submit", "x", 1)]


def test_a_request_on_a_subscription_just_ended_is_a_retryable_503() -> None:
    """A subscription that ended (the central actor dropped its client, or its stream
    broke) between the client's check and a request's start: the request fails with a
    ``StreamLostError`` (503, retryable), not a bare ``RuntimeError`` (a bug's 500)."""
    from cluster.control.subscription import Subscription
    from cluster.errors import StreamLostError
    from cluster.serving.errors import api_error
    from scheduler import Request, SamplingParams

    async def main() -> None:
        sub = Subscription.__new__(Subscription)
        sub.client_id, sub.request_ids = "client-1", {}
        sub.task = asyncio.get_running_loop().create_future()
        sub.task.set_result(None)  # (ended)
        outputs = sub.stream(Request("r", [1, 2, 3], SamplingParams(max_tokens=2)))
        with pytest.raises(StreamLostError, match="has ended") as lost:
            await outputs.__anext__()
        assert api_error(lost.value).status == 503

    asyncio.run(main())
