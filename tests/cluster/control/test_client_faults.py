"""A client that dies mid-stream (a driver's process, an ingress replica): Ray does not end
its stream on the SchedulerActor, so the client's keep-alives stopping is what tells; after
``client_timeout_s`` its requests are aborted and every block is freed, long before they
would have finished. A real Ray cluster (tests/cluster/conftest)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.cluster.conftest import RayCluster, assert_clean, wait_until
from tests.cluster.control.helpers import BOTH, cluster_config

ray = pytest.importorskip("ray")

from cluster.control.launch import build_cluster, shutdown_cluster  # noqa: E402

CLIENT = """
import asyncio, sys, time
import ray
from cluster.control.client import ClusterClient
from scheduler import SamplingParams

ray.init(address=sys.argv[1], namespace="tandem-tests", _node_ip_address="127.0.0.1",
         log_to_driver=False)
client = ClusterClient(ray.get_actor("clients"))

async def main():
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    async for out in client.generate_async([5, 6, 7, 8], params, request_id="orphan"):
        if len(out.outputs[0].token_ids) >= 2:
            print("streaming", flush=True)
            time.sleep(3600)  # the process is killed while its request runs

asyncio.run(main())
"""


def test_a_dead_clients_requests_are_aborted(
    ray_cluster: RayCluster, tiny_model: Path, tmp_path: Path
) -> None:
    config = cluster_config(tiny_model, [BOTH], client_timeout_s=2.0)
    handle = build_cluster(config, name="clients", namespace="tandem-tests")
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(CLIENT))
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    try:
        ray.get(handle.set_fault_injection.remote("c-0", 0.0, 0.05))  # 400 steps: 20 s
        child = subprocess.Popen(
            [sys.executable, str(script), ray_cluster.cluster.address],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "streaming"
            assert ray.get(handle.live_request_ids.remote()) == ["orphan"]
            child.kill()  # no goodbye, no abort: the process is just gone
            killed = time.monotonic()
        finally:
            child.kill()
            child.wait()
        wait_until(lambda: not ray.get(handle.live_request_ids.remote()), 15, "the abort")
        assert time.monotonic() - killed < 10  # client_timeout_s and a reaper round, not 20 s
        ray.get(handle.set_fault_injection.remote("c-0", 0.0, 0.0))
        assert_clean(handle)
    finally:
        shutdown_cluster(handle)
