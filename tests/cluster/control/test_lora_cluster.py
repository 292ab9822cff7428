"""LoRA adapters through the disaggregated cluster: the adapter is loaded on both the prefill and
the decode instance, and base and adapter requests in one batch give the in-process tokens."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import RayCluster, assert_clean

ray = pytest.importorskip("ray")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from cluster.config import ClusterConfig  # noqa: E402
from cluster.control.client import ClusterClient  # noqa: E402
from cluster.control.launch import build_cluster, shutdown_cluster  # noqa: E402
from scheduler import LoRARequest, SamplingParams  # noqa: E402

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[(11 * i + 5 * j) % 250 + 3 for j in range(9 + 7 * i)] for i in range(4)]


@pytest.fixture(scope="module")
def adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> LoRARequest:
    import torch

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    torch.manual_seed(3)
    config = peft.LoraConfig(
        r=8, lora_alpha=16, init_lora_weights=False, target_modules=["q_proj", "v_proj", "up_proj"]
    )
    path = tmp_path_factory.mktemp("lora-cluster") / "a"
    peft.get_peft_model(base, config).save_pretrained(path)
    return LoRARequest(lora_name="a", lora_int_id=1, lora_path=str(path))


@pytest.fixture(scope="module")
def lora_cluster(ray_cluster: RayCluster, tiny_model: Path) -> Iterator[Any]:
    config = ClusterConfig.model_validate(
        {
            "model": str(tiny_model),
            "block_size": 4,
            "pools": [
                {"name": "p", "role": "prefill", "resources": {"prefill": 0.01}, "num_blocks": 96},
                {"name": "d", "role": "decode", "resources": {"decode": 0.01}, "num_blocks": 96},
            ],
            "router": {"disaggregation": "always"},
            "lora": {"max_loras": 2, "max_lora_rank": 16},
        }
    )
    handle = build_cluster(config, name="lora", namespace="tandem-tests")
    yield handle
    shutdown_cluster(handle)


def test_adapter_requests_match_in_process(
    lora_cluster: Any, tiny_model: Path, adapter: LoRARequest
) -> None:
    from cluster.engine.llm import LLM

    client = ClusterClient(lora_cluster)

    def run(lora: LoRARequest | None) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in client.generate(PROMPTS, PARAMS, lora_request=lora)]

    with_adapter, base = run(adapter), run(None)
    llm = LLM(str(tiny_model), block_size=4, num_blocks=96, enable_lora=True, progress=False)
    expected_adapter = [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, lora_request=adapter)
    ]
    expected_base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert with_adapter == expected_adapter
    assert base == expected_base
    assert with_adapter != base  # the adapter changes the output
    stats = client.stats()["instances"]
    assert stats["d-0"]["num_prompt_tokens_computed"] == 0  # KV crossed for adapter requests too
    assert_clean(lora_cluster)
