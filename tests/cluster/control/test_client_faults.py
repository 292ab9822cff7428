"""Clients of the batched stream in trouble, on a real Ray cluster (tests/cluster/conftest):
a client that dies mid-stream (a driver's process, an ingress replica) -- Ray does not end its
stream on the SchedulerActor, so its keep-alives stopping is what tells: after
``client_timeout_s`` its requests are aborted and every block is freed, long before they would
have finished -- while a client that is only busy keeps its requests; a late submit of a
dropped client fails instead of waiting forever; an id reused right after an abort gets its
own outputs, not the old request's; a duplicate id is refused without hurting the first."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import RayCluster, assert_clean, wait_until
from tests.cluster.control.helpers import BOTH, cluster_config

ray = pytest.importorskip("ray")

from cluster.control.client import ClusterClient  # noqa: E402
from cluster.control.launch import build_cluster, shutdown_cluster  # noqa: E402
from scheduler import Request, SamplingParams  # noqa: E402

TIMEOUT_S = 2.0  # the clusters' client_timeout_s

CLIENT = """
import asyncio, sys, time
import ray
from cluster.control.client import ClusterClient
from scheduler import SamplingParams

ray.init(address=sys.argv[1], namespace="tandem-tests", _node_ip_address="127.0.0.1",
         log_to_driver=False)
client = ClusterClient(ray.get_actor(sys.argv[2]))

async def main():
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    async for out in client.generate_async([5, 6, 7, 8], params, request_id="orphan"):
        if len(out.outputs[0].token_ids) >= 2:
            print("streaming", flush=True)
            time.sleep(3600)  # the process is killed while its request runs

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def cluster(ray_cluster: RayCluster, tiny_model: Path) -> Any:
    config = cluster_config(tiny_model, [BOTH], client_timeout_s=TIMEOUT_S)
    handle = build_cluster(config, name="troubled-clients", namespace="tandem-tests")
    yield handle
    shutdown_cluster(handle)


@pytest.fixture
def client(cluster: Any) -> Any:
    yield ClusterClient(cluster)
    ray.get(cluster.set_fault_injection.remote("c-0", 0.0, 0.0))
    assert_clean(cluster)


def test_a_dead_clients_requests_are_aborted(
    ray_cluster: RayCluster, cluster: Any, client: ClusterClient, tmp_path: Path
) -> None:
    """(The module's cluster: ``client`` only cleans up after it -- this test's client is
    another process.)"""
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(CLIENT))
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    ray.get(cluster.set_fault_injection.remote("c-0", 0.0, 0.05))  # 400 steps: 20 s
    child = subprocess.Popen(
        [sys.executable, str(script), ray_cluster.cluster.address, "troubled-clients"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "streaming"
        assert ray.get(cluster.live_request_ids.remote()) == ["orphan"]
        child.kill()  # no goodbye, no abort: the process is just gone
        killed = time.monotonic()
    finally:
        child.kill()
        child.wait()
    try:
        wait_until(lambda: not ray.get(cluster.live_request_ids.remote()), 15, "the abort")
        assert time.monotonic() - killed < 10  # client_timeout_s and a reaper round, not 20 s
    finally:
        ray.get(cluster.set_fault_injection.remote("c-0", 0.0, 0.0))


def _tokens(final: Any) -> list[int]:
    return list(final.outputs[0].token_ids)


async def _final(client: ClusterClient, prompt: list[int], params: Any, rid: str) -> Any:
    final = None
    async for out in client.generate_async(prompt, params, request_id=rid):
        final = out
    return final


def test_a_busy_client_keeps_its_requests(cluster: Any, client: ClusterClient) -> None:
    """Keep-alives come from a thread: an event loop blocked for longer than
    client_timeout_s is a busy client, not a dead one."""
    ray.get(cluster.set_fault_injection.remote("c-0", 0.0, 0.05))
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)  # about 6 s

    async def run() -> Any:
        final, blocked = None, False
        async for out in client.generate_async([5, 6, 7], params, request_id="busy"):
            if not blocked:
                time.sleep(2 * TIMEOUT_S)  # the loop sends nothing meanwhile
                blocked = True
            final = out
        return final

    import asyncio

    final = asyncio.run(run())
    assert final.outputs[0].finish_reason == "length" and len(_tokens(final)) == 120


def test_a_dropped_clients_late_submit_fails(cluster: Any, client: ClusterClient) -> None:
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    ray.get(cluster.submit.remote(Request("first", [5, 6], params), "gone", None, 0))
    ray.get(cluster.unsubscribe.remote("gone"))  # dropped, as when it timed out
    assert "first" not in ray.get(cluster.live_request_ids.remote())  # its request ended
    with pytest.raises(ray.exceptions.RayTaskError, match="was dropped"):
        ray.get(cluster.submit.remote(Request("late", [5, 6], params), "gone", None, 1))
    assert "late" not in ray.get(cluster.live_request_ids.remote())


def test_an_id_reused_after_an_abort_gets_its_own_outputs(
    cluster: Any, client: ClusterClient
) -> None:
    import asyncio

    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[Any, Any]:
        async with aclosing(client.generate_async([9, 8, 7], long, request_id="y")) as stream:
            async for out in stream:
                if out.outputs[0].token_ids:
                    break  # leaving aborts "y"; its final output is still on its way
        reused = await _final(client, [4, 5, 6], short, "y")
        fresh = await _final(client, [4, 5, 6], short, "z")
        return reused, fresh

    reused, fresh = asyncio.run(run())
    assert reused.outputs[0].finish_reason == "length"
    assert _tokens(reused) == _tokens(fresh) and len(_tokens(reused)) == 6


def test_a_duplicate_id_is_refused_and_the_first_goes_on(
    cluster: Any, client: ClusterClient
) -> None:
    import asyncio

    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ray.get(cluster.set_fault_injection.remote("c-0", 0.0, 0.05))  # the first takes 1.5 s

    async def run() -> Any:
        first = asyncio.ensure_future(_final(client, [3, 4, 5], params, "dup"))
        await asyncio.sleep(0.2)  # the first is streaming
        with pytest.raises(ValueError, match="already in use"):
            await _final(client, [6, 7], params, "dup")
        return await first

    final = asyncio.run(asyncio.wait_for(run(), 60))
    assert final.outputs[0].finish_reason == "length" and len(_tokens(final)) == 30


def test_requests_submitted_together_are_refused_one_by_one(
    cluster: Any, client: ClusterClient
) -> None:
    """Streams opened in the same turn of the event loop go to the actor in one
    ``submit_many``: the one it refuses raises its own error, the others run to the end."""
    import asyncio

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def run() -> list[Any]:
        subscription = client._subscription()

        async def collect(request: Request) -> list[Any]:
            return [out async for out in subscription.stream(request)]

        ok = [Request(f"together{i}", [5, 6, 7 + i], params) for i in range(6)]
        # Past max_model_len: refused by the actor (the client's own checks are bypassed).
        bad = Request("too-long", [5] * (client.max_model_len + 8), params)
        requests = [*ok[:3], bad, *ok[3:]]
        return await asyncio.gather(*(collect(r) for r in requests), return_exceptions=True)

    results = asyncio.run(asyncio.wait_for(run(), 60))
    refused = results.pop(3)
    assert isinstance(refused, ValueError) and "max_model_len" in str(refused)
    for outputs in results:
        assert not isinstance(outputs, BaseException), outputs
        assert outputs[-1].finish_reason is not None
        assert outputs[-1].finish_reason.value == "length"
        assert sum(len(o.new_token_ids) for o in outputs) == 4
    assert_clean(cluster)


def test_a_stream_cancelled_just_as_its_submit_succeeds_aborts_its_request(
    cluster: Any, client: ClusterClient
) -> None:
    """The consumer is cancelled (its HTTP client left) after the cluster placed the request
    and before the consumer resumed: the request is aborted, not run to its end for nobody
    (it was neither taken back, never having left, nor marked running yet)."""
    import asyncio

    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    ray.get(cluster.set_fault_injection.remote("c-0", 0.0, 0.05))  # it would take 20 s

    async def run() -> list[str]:
        subscription = client._subscription()
        submit = subscription._submit
        consumer: list[asyncio.Task[Any]] = []

        def cancel_when_placed(*args: Any) -> asyncio.Future[None]:
            future = submit(*args)
            # Runs before the consumer's own wake-up (added later, when it awaits).
            future.add_done_callback(lambda f: consumer[0].cancel())
            return future

        subscription._submit = cancel_when_placed  # type: ignore[method-assign]
        stream = subscription.stream(Request("placed-then-left", [5, 6, 7], params))
        consumer.append(asyncio.ensure_future(stream.__anext__()))
        with pytest.raises(asyncio.CancelledError):
            await consumer[0]
        await asyncio.sleep(1.0)  # the abort is on its way
        return list(ray.get(cluster.live_request_ids.remote()))

    assert "placed-then-left" not in asyncio.run(asyncio.wait_for(run(), 60))


def test_only_an_actor_dead_for_good_is_gone(ray_cluster: RayCluster) -> None:
    """``actor_gone``, what the Serve ingress's health check asks of its cluster (to let go of
    one that ``tandem down`` killed): a live actor is not gone, nor one that restarts (a
    SchedulerActor's restart keeps its handle); one killed without restart is."""
    import asyncio

    from cluster.control.client import actor_gone

    @ray.remote(num_cpus=0, max_restarts=-1)
    class StandIn:
        def pid(self) -> int:
            return os.getpid()

    actor = StandIn.remote()
    first = ray.get(actor.pid.remote())
    assert not asyncio.run(actor_gone(actor, 30))
    ray.kill(actor, no_restart=False)  # it restarts: the same handle serves again
    assert not asyncio.run(actor_gone(actor, 30))

    def restarted() -> bool:
        try:
            return bool(ray.get(actor.pid.remote()) != first)
        except ray.exceptions.ActorUnavailableError:  # (restarting still)
            return False

    wait_until(restarted, 30, "the actor to restart")
    assert not asyncio.run(actor_gone(actor, 30))
    ray.kill(actor)  # for good, as `tandem down` does
    wait_until(lambda: asyncio.run(actor_gone(actor, 30)), 30, "the killed actor to be gone")
