"""The P/D-on-one-GPU scenario of ``test_pd``, in a process of its own (its own Ray: a test
session may hold another one, e.g. ``tests/cluster``'s). Writes the three runs' tokens as JSON.

    python -m tests.gpu.pd_run MODEL_DIR OUT_JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

BLOCK = 16
POOL = {"num_gpus": 0.5, "device": "cuda", "num_blocks": 128}
PROMPTS = [[3 + (i * 13 + j) % 250 for j in range(1 + (i * 37) % 61)] for i in range(12)]


def generate(model: str, pools: list[dict[str, Any]], **extra: Any) -> list[list[int]]:
    from cluster.config import ClusterConfig
    from cluster.control.client import ClusterClient
    from cluster.control.launch import build_cluster, shutdown_cluster
    from scheduler import SamplingParams
    from tests.cluster.conftest import assert_clean

    config = ClusterConfig.model_validate(
        {"model": model, "block_size": BLOCK, "dtype": "float32", "pools": pools, **extra}
    )
    handle = build_cluster(config, name=f"gpu-{len(pools)}", namespace="tandem-gpu-tests")
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        outputs = ClusterClient(handle).generate(PROMPTS, params)
        assert_clean(handle, objects=False)
        return [o.outputs[0].token_ids for o in outputs]
    finally:
        shutdown_cluster(handle)


def main() -> None:
    import ray

    from cluster.engine.llm import LLM
    from scheduler import SamplingParams

    model, out = sys.argv[1], Path(sys.argv[2])
    ray.init(
        num_cpus=4,
        num_gpus=1,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        namespace="tandem-gpu-tests",
        log_to_driver=False,
    )
    try:
        pd_pools = [
            {"name": "p", "role": "prefill", **POOL},
            {"name": "d", "role": "decode", **POOL},
        ]
        runs = {
            "disaggregated": generate(model, pd_pools, router={"disaggregation": "always"}),
            "colocated": generate(model, [{"name": "c", "role": "both", **POOL}]),
        }
    finally:
        ray.shutdown()
    llm = LLM(model, device="cuda", dtype="float32", block_size=BLOCK, progress=False)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    runs["in_process"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    out.write_text(json.dumps(runs))


if __name__ == "__main__":
    main()
