"""The gRPC KV transport end to end, over mutual TLS with the certificate made for the cluster:
prefill and decode workers on different Ray nodes, the decode stages pulling their layers of
the leased blocks from the prefill worker's KV server;
tokens equal to a colocated run; a lease the decode side never pulls expires and frees the
prefill blocks. A real ``ray.cluster_utils.Cluster`` (tests/cluster/conftest)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

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

from cluster.control.client import ClusterClient  # noqa: E402
from cluster.control.launch import build_cluster, shutdown_cluster  # noqa: E402
from scheduler import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
TIMEOUT_S = 1.0  # the transfer deadline
LEASE_S = 4.0  # how long the prefill side holds blocks for a pull


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths (5 to 45 tokens), no shared prefixes, no EOS (token 2) inside."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(5 + (i * 13) % 41)] for i in range(count)]


def _instances(handle: Any) -> dict[str, Any]:
    instances: dict[str, Any] = ray.get(handle.stats.remote())["instances"]
    return instances


@pytest.fixture(scope="module")
def grpc_disagg(ray_cluster: RayCluster, tiny_model: Path) -> Iterator[Any]:
    """1 prefill + 1 decode instance on their own nodes, KV over gRPC. The decode instance has
    two pipeline stages: each pulls its own layer of every lease, which ends after both. The
    workers speak mutual TLS (kv_transfer.tls; plaintext is covered in tests/kv_transfer)."""
    config = cluster_config(
        tiny_model,
        [PREFILL, {**DECODE, "pp_size": 2}],
        router={"disaggregation": "always"},
        kv_transfer={
            "transport": "grpc",
            "timeout_s": TIMEOUT_S,
            "lease_s": LEASE_S,
            "tls": True,
        },
    )
    handle = build_cluster(config, name="grpc-disagg", namespace="tandem-tests")
    yield handle
    shutdown_cluster(handle)


@pytest.fixture(autouse=True)
def _no_leaks(grpc_disagg: Any) -> Iterator[None]:
    yield
    ray.get(grpc_disagg.set_fault_injection.remote("d-0", 0.0, 0.0))
    assert_clean(grpc_disagg)


def test_disaggregated_over_grpc_equals_colocated(
    grpc_disagg: Any, ray_cluster: RayCluster, tiny_model: Path
) -> None:
    health = ray.get(grpc_disagg.worker_health.remote())
    assert health["p-0"]["node_id"] == ray_cluster.prefill_node_id
    assert health["d-0"]["node_id"] == ray_cluster.decode_node_id
    prompts = _prompts(8)
    before = _instances(grpc_disagg)
    disaggregated = token_ids(ClusterClient(grpc_disagg).generate(prompts, GREEDY))
    after = _instances(grpc_disagg)
    # Each lease ended with its pulls (one per decode stage): the prefill blocks are free well
    # before a lease made during the run could have expired.
    wait_until(
        lambda: _instances(grpc_disagg)["p-0"]["num_requests"] == 0,
        timeout_s=LEASE_S / 2,
        what="the prefill instance to free the pulled blocks",
    )

    colocated = generate_colocated(tiny_model, prompts, GREEDY, "grpc-colocated")

    assert disaggregated == colocated
    handed_off = [t for t in disaggregated if len(t) > 1]  # EOS first: nothing to decode
    assert len(handed_off) >= 6
    # The KV crossed over gRPC: the decode instance computed no prompt token, every load
    # carried bytes, and the object store stayed empty (assert_clean).
    d_before, d_after = before["d-0"], after["d-0"]
    computed = d_after["num_prompt_tokens_computed"] - d_before["num_prompt_tokens_computed"]
    assert computed == 0
    assert d_after["num_kv_loads_started"] - d_before["num_kv_loads_started"] == len(handed_off)
    history = ray.get(grpc_disagg.transfer_history.remote())["d-0"]  # both stages' loads
    assert len(history) == 2 * len(handed_off)
    assert all(r.ok and r.num_bytes > 0 for r in history)


def test_a_lease_whose_pull_failed_is_released_at_once(grpc_disagg: Any, tiny_model: Path) -> None:
    """The decode side's fetch would start only after the lease: its load times out
    (TIMEOUT_S) and the prompt is recomputed. The decode side tells the source, which ends
    the lease and frees the blocks at once -- not when the lease runs out (no lease
    expires); the pull that finally comes finds no lease."""
    prompt = _prompts(1, seed=4)[0] + [7] * 20
    (expected,) = generate_in_process(tiny_model, [prompt], GREEDY)
    before = _instances(grpc_disagg)
    stages = ray.get(grpc_disagg.worker_health.remote())["p-0"]["stages"]
    expired = sum(int(h["kv_leases_expired"]) for h in stages)
    ray.get(grpc_disagg.set_fault_injection.remote("d-0", LEASE_S + 1.0, 0.0))
    started = time.monotonic()
    got = token_ids(ClusterClient(grpc_disagg).generate([prompt], GREEDY))[0]
    assert got == expected
    stats = _instances(grpc_disagg)
    d_before, d_after = before["d-0"], stats["d-0"]
    computed = d_after["num_prompt_tokens_computed"] - d_before["num_prompt_tokens_computed"]
    assert computed == len(prompt)
    wait_until(
        lambda: _instances(grpc_disagg)["p-0"]["num_requests"] == 0,
        timeout_s=LEASE_S + 5.0,
        what="the prefill blocks to be freed",
    )
    assert time.monotonic() - started < LEASE_S  # released, not expired
    stages = ray.get(grpc_disagg.worker_health.remote())["p-0"]["stages"]
    assert sum(int(h["kv_leases_expired"]) for h in stages) == expired
    history = ray.get(grpc_disagg.transfer_history.remote())["d-0"]  # both stages' loads
    failed = [r.req_id for r in history if not r.ok]
    assert len(failed) == 2 and len(set(failed)) == 1  # each stage's load timed out
