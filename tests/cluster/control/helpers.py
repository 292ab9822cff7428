"""Shared pieces of the disaggregated-cluster tests (P/D over the object store and over gRPC):
the pools, a config builder, and the reference runs their tokens are compared with."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig
from scheduler import SamplingParams
from tests.cluster.conftest import assert_clean

BLOCK_SIZE = 4
NUM_BLOCKS = 160
PREFILL = {"name": "p", "role": "prefill", "resources": {"prefill": 0.01}, "num_blocks": NUM_BLOCKS}
DECODE = {"name": "d", "role": "decode", "resources": {"decode": 0.01}, "num_blocks": NUM_BLOCKS}
BOTH = {"name": "c", "role": "both", "num_blocks": NUM_BLOCKS}


def random_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of random token ids (3-255), of lengths 1 to 61, the same per seed."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(1 + (i * 37) % 61)] for i in range(count)]


async def until(predicate: Any, timeout_s: float = 20.0) -> None:
    """Wait in an event loop for ``predicate`` (a blocking call: run in a thread) to hold."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(predicate):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def cluster_config(model: Path, pools: list[dict[str, Any]], **extra: Any) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {"model": str(model), "block_size": BLOCK_SIZE, "pools": pools, **extra}
    )


def token_ids(outputs: list[Any]) -> list[list[int]]:
    """The first completion's tokens of each output."""
    return [o.outputs[0].token_ids for o in outputs]


# generate_colocated's results by (model, prompts, params): a reference run is greedy or
# seeded, so the same one asked again (test_grpc_cluster's and test_nixl_cluster's, the nixl
# and ray runs of test_pd_cluster) is not worth another cluster.
_COLOCATED: dict[tuple[str, str, str], list[list[int]]] = {}


def generate_colocated(
    model: Path, prompts: list[list[int]], params: SamplingParams, name: str
) -> list[list[int]]:
    """Build a one-instance (``BOTH``) cluster named ``name``, generate ``prompts``, check that
    it left nothing behind, and shut it down. The same run again (same model, prompts and
    params) gives the first one's tokens without a cluster."""
    from cluster.control.client import ClusterClient
    from cluster.control.launch import build_cluster, shutdown_cluster

    key = (str(model), repr(prompts), params.model_dump_json())
    if key in _COLOCATED:
        return [list(t) for t in _COLOCATED[key]]
    handle = build_cluster(cluster_config(model, [BOTH]), name=name, namespace="tandem-tests")
    try:
        tokens = token_ids(ClusterClient(handle).generate(prompts, params))
        assert_clean(handle)
    finally:
        shutdown_cluster(handle)
    _COLOCATED[key] = [list(t) for t in tokens]
    return tokens


def generate_in_process(
    model: Path, prompts: list[list[int]], params: SamplingParams
) -> list[list[int]]:
    """The same generation by the in-process engine, with the clusters' cache shape."""
    from cluster.engine.llm import LLM

    llm = LLM(str(model), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, progress=False)
    return token_ids(llm.generate(prompts, params))
