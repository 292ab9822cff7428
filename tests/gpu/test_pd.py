"""P/D on one GPU: a prefill and a decode instance sharing the GPU (half each), every request
disaggregated, KV handed off by the default transport; the tokens equal a colocated instance's
on the same GPU and the in-process GPU engine's (float32, greedy)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.actors.conftest import make_checkpoint
from tests.gpu.conftest import needs_cuda

pytestmark = needs_cuda

ray = pytest.importorskip("ray")

BLOCK = 16
POOL = {"num_gpus": 0.5, "device": "cuda", "num_blocks": 128}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gpu-pd"), "llama", seed=5)


@pytest.fixture(scope="module")
def one_gpu_ray() -> Iterator[None]:
    tmp = tempfile.mkdtemp(prefix="tandem-ray-")
    os.environ["RAY_TMPDIR"] = tmp
    ray.init(
        num_cpus=4,
        num_gpus=1,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        namespace="tandem-gpu-tests",
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def _generate(
    model: Path, pools: list[dict[str, Any]], prompts: list[list[int]], **extra: Any
) -> list[list[int]]:
    from cluster.config import ClusterConfig
    from cluster.control.client import ClusterClient
    from cluster.control.launch import build_cluster, shutdown_cluster
    from scheduler import SamplingParams
    from tests.cluster.conftest import assert_clean

    config = ClusterConfig.model_validate(
        {"model": str(model), "block_size": BLOCK, "dtype": "float32", "pools": pools, **extra}
    )
    handle = build_cluster(config, name=f"gpu-{len(pools)}", namespace="tandem-gpu-tests")
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        tokens = [o.outputs[0].token_ids for o in ClusterClient(handle).generate(prompts, params)]
        assert_clean(handle, objects=False)
        return tokens
    finally:
        shutdown_cluster(handle)


def test_disaggregated_equals_colocated_equals_in_process_on_one_gpu(
    model: Path, one_gpu_ray: None
) -> None:
    from cluster.engine.llm import LLM
    from scheduler import SamplingParams

    prompts = [[3 + (i * 13 + j) % 250 for j in range(1 + (i * 37) % 61)] for i in range(12)]
    disaggregated = _generate(
        model,
        [{"name": "p", "role": "prefill", **POOL}, {"name": "d", "role": "decode", **POOL}],
        prompts,
        router={"disaggregation": "always"},
    )
    colocated = _generate(model, [{"name": "c", "role": "both", **POOL}], prompts)
    llm = LLM(str(model), device="cuda", dtype="float32", block_size=BLOCK, progress=False)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    in_process = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert disaggregated == in_process
    assert colocated == in_process
