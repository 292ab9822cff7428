"""The NIXL KV transport end to end: a prefill instance split into two pipeline stages hands
off to a decode instance with one (each decode read takes the layers of both prefill stages'
leases), prefill and decode workers on different Ray nodes; tokens equal to a colocated run
with no prompt token recomputed; the readers' notifications free the prefill blocks at once;
a lease nobody reads in time expires (the decode side recomputes); a prefill worker killed
before the read, and one killed mid-read (recompute, nothing leaked); UCX forced onto TCP
(no kernel copy) still correct; a probe of a peer that cannot be reached does not hold the
worker's steps. A real ``ray.cluster_utils.Cluster`` (tests/cluster/conftest).
Skipped without the ``nixl`` extra."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kv_transfer.nixl_transport import MISSING, nixl_available
from tests.cluster.conftest import RayCluster, assert_clean, wait_until
from tests.cluster.control.helpers import (
    DECODE,
    PREFILL,
    cluster_config,
    generate_colocated,
    generate_in_process,
    token_ids,
)

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.skipif(not nixl_available(), reason=MISSING)

from cluster.control.client import ClusterClient  # noqa: E402
from cluster.control.launch import build_cluster, shutdown_cluster  # noqa: E402
from scheduler import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
TIMEOUT_S = 1.0  # the transfer deadline
LEASE_S = 4.0  # how long the prefill side holds blocks for a read


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths (5 to 45 tokens), no shared prefixes, no EOS (token 2) inside."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(5 + (i * 13) % 41)] for i in range(count)]


def _instances(handle: Any) -> dict[str, Any]:
    instances: dict[str, Any] = ray.get(handle.stats.remote())["instances"]
    return instances


@pytest.fixture(scope="module")
def nixl_pp(ray_cluster: RayCluster, tiny_model: Path) -> Iterator[Any]:
    """A prefill instance of two pipeline stages, a decode instance of one, KV over NIXL."""
    config = cluster_config(
        tiny_model,
        [{**PREFILL, "pp_size": 2}, DECODE],
        router={"disaggregation": "always"},
        kv_transfer={"transport": "nixl", "timeout_s": TIMEOUT_S, "lease_s": LEASE_S},
    )
    handle = build_cluster(config, name="nixl-pp", namespace="tandem-tests")
    yield handle
    shutdown_cluster(handle)


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "nixl_pp" in request.fixturenames:
        handle = request.getfixturevalue("nixl_pp")
        ray.get(handle.set_fault_injection.remote("d-0", 0.0, 0.0))
        assert_clean(handle)


def test_pipeline_prefill_to_plain_decode_equals_colocated(
    nixl_pp: Any, ray_cluster: RayCluster, tiny_model: Path
) -> None:
    described = ray.get(nixl_pp.describe.remote())
    assert described["kv_transport"] == "nixl"
    health = ray.get(nixl_pp.worker_health.remote())
    assert health["p-0"]["node_id"] == ray_cluster.prefill_node_id
    assert health["d-0"]["node_id"] == ray_cluster.decode_node_id
    prompts = _prompts(8)
    before = _instances(nixl_pp)
    disaggregated = token_ids(ClusterClient(nixl_pp).generate(prompts, GREEDY))
    after = _instances(nixl_pp)
    direct = ray.get(nixl_pp.worker_health.remote())["d-0"]["kv_direct_reads"]
    # Each lease ended with the read's notification: the prefill blocks are free well before
    # a lease made during the run could have expired.
    wait_until(
        lambda: _instances(nixl_pp)["p-0"]["num_requests"] == 0,
        timeout_s=LEASE_S / 2,
        what="the prefill instance to free the blocks that were read",
    )

    colocated = generate_colocated(tiny_model, prompts, GREEDY, "nixl-colocated")

    assert disaggregated == colocated
    handed_off = [t for t in disaggregated if len(t) > 1]  # EOS first: nothing to decode
    assert len(handed_off) >= 6
    # The KV came by NIXL reads: the decode instance computed no prompt token, every load
    # carried bytes, the object store stayed empty (assert_clean).
    d_before, d_after = before["d-0"], after["d-0"]
    computed = d_after["num_prompt_tokens_computed"] - d_before["num_prompt_tokens_computed"]
    assert computed == 0
    assert d_after["num_kv_loads_started"] - d_before["num_kv_loads_started"] == len(handed_off)
    history = ray.get(nixl_pp.transfer_history.remote())["d-0"]
    assert len(history) == len(handed_off)  # one read of both prefill stages' layers each
    assert all(r.ok and r.num_bytes > 0 for r in history)
    # The "nodes" are processes of this machine: each read was the same-node kernel copy,
    # from both prefill stages' processes at once (kv_transfer/cma.py).
    assert direct - health["d-0"]["kv_direct_reads"] == len(handed_off)


def test_a_request_that_ends_at_its_first_token_frees_the_prefill_blocks_at_once(
    nixl_pp: Any, tiny_model: Path
) -> None:
    """Nothing to hand off (its first token is a stop token): nobody will read its KV, so
    the prefill worker ends the lease at once rather than at its expiry (as vLLM frees the
    blocks of a request that is not LENGTH_CAPPED)."""
    prompt = _prompts(1, seed=12)[0] + [9] * 12
    (expected,) = generate_in_process(tiny_model, [prompt], GREEDY)
    params = GREEDY.model_copy(update={"stop_token_ids": (expected[0],)})
    started = time.monotonic()
    (got,) = token_ids(ClusterClient(nixl_pp).generate([prompt], params))
    assert got == expected[:1]
    wait_until(
        lambda: _instances(nixl_pp)["p-0"]["num_requests"] == 0,
        timeout_s=LEASE_S / 2,
        what="the prefill instance to free the blocks nobody will read",
    )
    assert time.monotonic() - started < LEASE_S  # not the lease's expiry
    # Nor for a request that asks for one token: prefilled with no hand-off, its KV (saved
    # all the same) was held until the lease ran out.
    started = time.monotonic()
    one = GREEDY.model_copy(update={"max_tokens": 1})
    (got,) = token_ids(ClusterClient(nixl_pp).generate([prompt[:-1]], one))
    assert len(got) == 1
    wait_until(
        lambda: _instances(nixl_pp)["p-0"]["num_requests"] == 0,
        timeout_s=LEASE_S / 2,
        what="the prefill instance to free the blocks of a one-token request",
    )
    assert time.monotonic() - started < LEASE_S


def test_kv_the_decode_side_has_cached_is_let_go_at_once(nixl_pp: Any, tiny_model: Path) -> None:
    """The same prompt twice: the second time the decode instance's prefix cache holds the
    whole prompt, so it reads nothing -- and tells the prefill instance (through the central
    scheduler) to end the lease now instead of at its expiry."""
    prompt = _prompts(1, seed=13)[0][:4] * 6  # 24 tokens: whole blocks
    client = ClusterClient(nixl_pp)
    first = token_ids(client.generate([prompt], GREEDY))
    wait_until(
        lambda: _instances(nixl_pp)["p-0"]["num_requests"] == 0,
        timeout_s=LEASE_S / 2,
        what="the first request's lease to end with its read",
    )
    loads = _instances(nixl_pp)["d-0"]["num_kv_loads_started"]
    started = time.monotonic()
    assert token_ids(client.generate([prompt], GREEDY)) == first
    assert _instances(nixl_pp)["d-0"]["num_kv_loads_started"] == loads  # nothing read
    wait_until(
        lambda: _instances(nixl_pp)["p-0"]["num_requests"] == 0,
        timeout_s=LEASE_S / 2,
        what="the prefill instance to let go of KV the decode instance had cached",
    )
    assert time.monotonic() - started < LEASE_S  # not the lease's expiry


def _expired(handle: Any, iid: str) -> int:
    stages = ray.get(handle.worker_health.remote())[iid]["stages"]
    return sum(int(s["kv_leases_expired"]) for s in stages)


def test_a_lease_whose_read_failed_is_released_at_once(nixl_pp: Any, tiny_model: Path) -> None:
    """The decode side would read only after its deadline: the load fails, the prompt is
    recomputed, and no read is ever posted. The decode side tells the source, which frees
    the request's blocks at once -- not when the lease runs out (no lease expires)."""
    prompt = _prompts(1, seed=4)[0] + [7] * 20
    (expected,) = generate_in_process(tiny_model, [prompt], GREEDY)
    before = _instances(nixl_pp)
    expired = _expired(nixl_pp, "p-0")
    ray.get(nixl_pp.set_fault_injection.remote("d-0", LEASE_S + 1.0, 0.0))
    started = time.monotonic()
    got = token_ids(ClusterClient(nixl_pp).generate([prompt], GREEDY))[0]
    assert got == expected
    stats = _instances(nixl_pp)
    d_before, d_after = before["d-0"], stats["d-0"]
    computed = d_after["num_prompt_tokens_computed"] - d_before["num_prompt_tokens_computed"]
    assert computed == len(prompt)
    wait_until(
        lambda: _instances(nixl_pp)["p-0"]["num_requests"] == 0,
        timeout_s=LEASE_S + 5.0,
        what="the prefill blocks to be freed",
    )
    assert time.monotonic() - started < LEASE_S  # released, not expired
    assert _expired(nixl_pp, "p-0") == expired
    history = ray.get(nixl_pp.transfer_history.remote())["d-0"]
    assert not history[-1].ok and history[-1].num_bytes == 0


def _late_read(
    handle: Any, model: Path, seed: int, victim: str
) -> tuple[list[int], list[int], ClusterClient, int]:
    """For a kill before the read: a prompt and its undisturbed tokens, reads on d-0 that
    start 0.5 s late, a client, and the pid of the worker ``victim`` to kill."""
    prompt = _prompts(1, seed=seed)[0] + [5] * 16
    (expected,) = generate_in_process(model, [prompt], GREEDY)
    ray.get(handle.set_fault_injection.remote("d-0", 0.5, 0.0))  # reads start late
    pid = int(ray.get(handle.worker_health.remote())[victim]["pid"])
    return prompt, expected, ClusterClient(handle), pid


def test_a_decode_worker_killed_before_its_read_leaves_nothing_held(
    ray_cluster: RayCluster, tiny_model: Path
) -> None:
    """The reader dies with the request's blocks leased on the prefill side: the request
    ends (recomputed once the worker is back, or with an error -- never a hang), and the
    prefill worker frees the blocks at once: the failed decode instance reports the loads it
    had in flight unread, and their source releases them (they were held until the lease
    ran out)."""
    config = cluster_config(
        tiny_model,
        [PREFILL, {**DECODE, "max_restarts": 1}],
        router={"disaggregation": "always"},
        kv_transfer={"transport": "nixl", "timeout_s": 2.0, "lease_s": LEASE_S},
    )
    handle = build_cluster(config, name="nixl-kill-reader", namespace="tandem-tests")
    try:
        prompt, expected, client, pid = _late_read(handle, tiny_model, 19, victim="d-0")
        expired = _expired(handle, "p-0")
        killed: list[float] = []

        async def run() -> Any:
            final = None
            async for out in client.generate_async(prompt, GREEDY):
                if not killed:  # the prefill instance's token: its blocks are leased now
                    os.kill(pid, signal.SIGKILL)
                    killed.append(time.monotonic())
                final = out
            return final

        final = asyncio.run(asyncio.wait_for(run(), 120))
        sample = final.outputs[0]
        assert sample.finish_reason in ("length", "error"), sample
        if sample.finish_reason == "length":
            assert list(sample.token_ids) == expected  # recomputed on the restarted worker
        else:
            assert sample.error
        wait_until(
            lambda: _instances(handle)["p-0"]["num_requests"] == 0,
            timeout_s=LEASE_S + 10.0,
            what="the prefill side to free the blocks of the dead reader",
        )
        assert time.monotonic() - killed[0] < LEASE_S  # released, not expired
        assert _expired(handle, "p-0") == expired
        assert _instances(handle)["p-0"]["kv_cache_usage"] == 0.0
        wait_until(lambda: _instances(handle)["d-0"]["alive"], timeout_s=60, what="d-0 to rejoin")
        ray.get(handle.set_fault_injection.remote("d-0", 0.0, 0.0))
        assert_clean(handle)
    finally:
        shutdown_cluster(handle)


@pytest.mark.parametrize("copy", [True, False], ids=["same-node-copy", "nixl-read"])
def test_a_prefill_worker_killed_before_the_read_then_restarted(
    ray_cluster: RayCluster, tiny_model: Path, copy: bool
) -> None:
    """The source dies with the request's blocks leased: the decode side's read fails (or
    runs into its deadline), it recomputes, and nothing is left behind. Ray restarts the
    worker: its new NIXL agent reaches the decode worker before the instance serves again,
    so later hand-offs read (no recompute). Both ways of reading on one machine: the
    same-node copy (the restarted worker's process is attached anew) and NIXL READs."""
    config = cluster_config(
        tiny_model,
        [{**PREFILL, "max_restarts": 1}, DECODE],
        router={"disaggregation": "always"},
        kv_transfer={
            "transport": "nixl",
            "timeout_s": 2.0,
            "lease_s": LEASE_S,
            "same_node_copy": copy,
        },
    )
    handle = build_cluster(config, name="nixl-kill", namespace="tandem-tests")
    try:
        prompt, expected, client, pid = _late_read(handle, tiny_model, 9, victim="p-0")

        async def run() -> list[int]:
            tokens: list[int] = []
            async for out in client.generate_async(prompt, GREEDY):
                if not tokens:  # the prefill instance's token: its blocks are leased now
                    os.kill(pid, signal.SIGKILL)
                tokens += out.outputs[0].new_token_ids
            return tokens

        assert asyncio.run(run()) == expected
        stats = _instances(handle)
        assert stats["d-0"]["num_prompt_tokens_computed"] >= len(prompt)  # recomputed
        history = ray.get(handle.transfer_history.remote())["d-0"]
        assert not history[-1].ok
        ray.get(handle.set_fault_injection.remote("d-0", 0.0, 0.0))

        def rejoined() -> bool:
            failures = ray.get(handle.stats.remote())["failures"]
            events = [(f["instance_id"], f["event"]) for f in failures]
            return events == [("p-0", "failed"), ("p-0", "rejoined")]

        wait_until(rejoined, 60, "p-0 to fail and rejoin")
        prompts = _prompts(3, seed=5)
        expected_after = generate_in_process(tiny_model, prompts, GREEDY)
        before = _instances(handle)["d-0"]["num_prompt_tokens_computed"]
        copies = ray.get(handle.worker_health.remote())["d-0"]["kv_direct_reads"]
        assert token_ids(client.generate(prompts, GREEDY)) == expected_after
        assert _instances(handle)["d-0"]["num_prompt_tokens_computed"] == before  # all read
        history = ray.get(handle.transfer_history.remote())["d-0"]
        assert all(r.ok and r.num_bytes > 0 for r in history[-len(prompts) :])
        after = ray.get(handle.worker_health.remote())["d-0"]["kv_direct_reads"]
        assert after - copies == (len(prompts) if copy else 0)
        assert_clean(handle)
    finally:
        shutdown_cluster(handle)


def test_a_prefill_worker_killed_mid_read(ray_cluster: RayCluster, tiny_model: Path) -> None:
    """The source dies while the decode worker's READ runs. Over UCX's TCP transport a READ
    needs the source to answer, so the source is stopped (SIGSTOP) once its blocks are
    leased, the READ is posted to it and cannot finish, and then the source is killed: the
    read fails (the connection breaks, or the deadline passes), the decode side recomputes
    the prompt, the client's tokens are the undisturbed ones, and nothing is leaked."""
    config = cluster_config(
        tiny_model,
        [PREFILL, DECODE],
        router={"disaggregation": "always"},
        kv_transfer={
            "transport": "nixl",
            "timeout_s": 3.0,
            "lease_s": LEASE_S,
            "ucx_tls": "tcp",
        },
    )
    handle = build_cluster(config, name="nixl-kill-mid-read", namespace="tandem-tests")
    try:
        client = ClusterClient(handle)
        warm = _prompts(1, seed=21)[0]  # one hand-off first: the endpoint is connected
        assert token_ids(client.generate([warm], GREEDY)) == generate_in_process(
            tiny_model, [warm], GREEDY
        )
        prompt = _prompts(1, seed=22)[0] + [6] * 16
        (expected,) = generate_in_process(tiny_model, [prompt], GREEDY)
        health = ray.get(handle.worker_health.remote())
        pid, reads_before = health["p-0"]["pid"], health["d-0"]["kv_reads_started"]
        loads_before = _instances(handle)["d-0"]["num_kv_loads_started"]
        ray.get(handle.set_fault_injection.remote("d-0", 0.3, 0.0))  # reads start late

        async def run() -> list[int]:
            tokens: list[int] = []
            async for out in client.generate_async(prompt, GREEDY):
                if not tokens:  # the prefill instance's token: its blocks are leased now
                    os.kill(pid, signal.SIGSTOP)
                    # The decode side starts the load, and posts the READ 0.3 s later.
                    deadline = time.monotonic() + 30
                    while _instances(handle)["d-0"]["num_kv_loads_started"] == loads_before:
                        assert time.monotonic() < deadline, "no load started"
                        await asyncio.sleep(0.02)
                    await asyncio.sleep(0.8)
                    os.kill(pid, signal.SIGKILL)
                tokens += out.outputs[0].new_token_ids
            return tokens

        assert asyncio.run(run()) == expected
        health = ray.get(handle.worker_health.remote())
        # The READ was posted (to the stopped source) before it failed: a read, not a
        # refusal to start one.
        assert health["d-0"]["kv_reads_started"] == reads_before + 1
        history = ray.get(handle.transfer_history.remote())["d-0"]
        assert not history[-1].ok and history[-1].num_bytes == 0
        # Found by the broken connection (0.05 s after the kill here, which came about 0.9 s
        # into the load), well before the deadline (3 s; the lease's margin: about 2.7 s).
        assert history[-1].seconds < 2.0
        stats = _instances(handle)
        assert stats["d-0"]["num_prompt_tokens_computed"] >= len(prompt)  # recomputed
        ray.get(handle.set_fault_injection.remote("d-0", 0.0, 0.0))
        assert_clean(handle)
    finally:
        shutdown_cluster(handle)


def test_ucx_over_tcp_only_is_still_correct(ray_cluster: RayCluster, tiny_model: Path) -> None:
    """Where a same-node kernel copy is not permitted (no ptrace rights in a pod), UCX carries
    the reads over TCP: slower, the same tokens."""
    config = cluster_config(
        tiny_model,
        [PREFILL, DECODE],
        router={"disaggregation": "always"},
        kv_transfer={"transport": "nixl", "timeout_s": 5.0, "ucx_tls": "tcp"},
    )
    handle = build_cluster(config, name="nixl-tcp", namespace="tandem-tests")
    try:
        prompts = _prompts(4, seed=3)
        expected = generate_in_process(tiny_model, prompts, GREEDY)
        health = ray.get(handle.worker_health.remote())
        for iid in ("p-0", "d-0"):
            assert (health[iid]["kv_transport"], health[iid]["ucx_tls"]) == ("nixl", "tcp")
        got = token_ids(ClusterClient(handle).generate(prompts, GREEDY))
        assert got == expected
        stats = _instances(handle)
        assert stats["d-0"]["num_prompt_tokens_computed"] == 0  # every prompt was read
        health = ray.get(handle.worker_health.remote())
        assert health["d-0"]["kv_reads_started"] >= 3  # NIXL READs, no same-node copy
        assert health["d-0"]["kv_direct_reads"] == 0
        assert_clean(handle)
    finally:
        shutdown_cluster(handle)


def test_auto_falls_back_to_ray_when_nixl_cannot_start(
    ray_cluster: RayCluster, tiny_model: Path
) -> None:
    """``transport: auto`` where NIXL imports but cannot run (here: UCX given no usable
    transport): the workers fall back, the cluster says ``ray``, and hand-offs work."""
    config = cluster_config(
        tiny_model,
        [PREFILL, DECODE],
        router={"disaggregation": "always"},
        kv_transfer={"transport": "auto", "ucx_tls": "no-such-transport"},
    )
    handle = build_cluster(config, name="nixl-auto", namespace="tandem-tests")
    try:
        assert ray.get(handle.describe.remote())["kv_transport"] == "ray"
        health = ray.get(handle.worker_health.remote())
        assert {health[i]["kv_transport"] for i in ("p-0", "d-0")} == {"ray"}
        # The running cluster still matches the config it was built from (a redeployment
        # with the same config reuses it): ``auto`` is what was asked for.
        assert ray.get(handle.settings.remote()) == config.cluster_settings()
        prompts = _prompts(3, seed=6)
        expected = generate_in_process(tiny_model, prompts, GREEDY)
        assert token_ids(ClusterClient(handle).generate(prompts, GREEDY)) == expected
        assert _instances(handle)["d-0"]["num_prompt_tokens_computed"] == 0  # read via ray
        text = ray.get(handle.metrics_text.remote())
        assert "tandem:kv_transport_info{model_name=" in text and 'transport="ray"' in text
        assert_clean(handle)
    finally:
        shutdown_cluster(handle)


# A NIXL agent in a process of its own: it publishes its peer info to the file named by its
# argument, then waits (stopped by the test, it is a peer that cannot be reached).
_PEER_PROCESS = """
import pickle, sys, time
import torch
from kv_transfer.nixl_transport import NixlWorkerConnector
from kv_transfer.blocks import allocate_kv_caches
connector = NixlWorkerConnector(same_node_copy=False)
connector.register_kv_caches(allocate_kv_caches(2, 8, 4, 2, 16, torch.float32), range(2))
open(sys.argv[1], "wb").write(pickle.dumps(connector.peer_info()))
print("ready", flush=True)
time.sleep(120)
"""


def test_a_probe_of_a_peer_that_cannot_be_reached_does_not_hold_the_workers_steps(
    ray_cluster: RayCluster, tiny_model: Path, tmp_path: Path
) -> None:
    """A new instance probes every live one (``transport: auto``); a probe waits up to its
    timeout for a peer that does not answer. On the worker's default concurrency group (one
    thread: the steps') nothing else ran meanwhile; the probe has a group of its own."""
    import pickle
    import subprocess
    import sys

    from cluster.control.placement import (
        InstanceSpec,
        connect_kv_peers,
        worker_class,
        worker_kwargs,
        worker_options,
    )

    peer_file = tmp_path / "peer"
    source = subprocess.Popen(
        [sys.executable, "-c", _PEER_PROCESS, str(peer_file)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    try:
        assert source.stdout is not None
        while (line := source.stdout.readline()) and line.strip() != "ready":
            pass
        assert line.strip() == "ready", "the peer process did not start"
        peer = pickle.loads(peer_file.read_bytes())
        os.kill(source.pid, signal.SIGSTOP)  # alive, never answering

        config = cluster_config(tiny_model, [PREFILL, DECODE], kv_transfer={"transport": "nixl"})
        pool = config.pools[1]
        options = worker_options(pool) | {"resources": {}, "num_cpus": 0}
        worker = worker_class().options(**options).remote(**worker_kwargs(config, pool))
        try:
            ray.get(worker.load_model.remote())
            ray.get(worker.init_kv_cache.remote(8))

            class Unreachable:  # the stopped peer's instance: nothing to call on it
                def add_kv_peers(self, peers: list[Any]) -> None:
                    pass

                def kv_probe(self, peer: Any, timeout_s: float) -> None:
                    return None

            class InProcess:
                worker = Unreachable()

            reader = InstanceSpec("d-0", pool, None, worker, {})
            stopped = InstanceSpec("p-0", config.pools[0], InProcess(), None, {}, kv_peers=[peer])

            async def main() -> list[str]:
                connecting = asyncio.ensure_future(
                    connect_kv_peers([reader, stopped], [reader], probe=True)
                )
                await asyncio.sleep(1.0)  # the probe is waiting for the stopped peer
                assert not connecting.done()
                await worker.kv_peer.remote()  # a call on the steps' thread
                assert not connecting.done(), "the worker's steps waited for the probe"
                return await connecting

            errors = asyncio.run(main())
            assert len(errors) == 1 and "d-0[0] -> p-0[0]" in errors[0]
            assert "timed out" in errors[0]
        finally:
            ray.kill(worker)
    finally:
        source.kill()
        source.wait()
