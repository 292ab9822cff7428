"""Pipeline-parallel instances and async scheduling.

PP=2 and PP=3 give the tokens PP=1 gives; the stages of one instance run on different nodes of
the session's ``ray.cluster_utils.Cluster``; P/D hands KV over between instances split
differently (P pp=2 -> D pp=1, P pp=1 -> D pp=2, P pp=2 -> D pp=3: stage boundaries that do not
line up), each decode stage taking only its own layers; several steps are really in flight.
The model has 5 layers so the splits are uneven (3+2, 2+2+1).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import RayCluster, assert_clean

ray = pytest.importorskip("ray")

from actors.model.llama import pp_layer_range  # noqa: E402
from actors.worker import ModelWorker  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402
from cluster.control.client import ClusterClient  # noqa: E402
from cluster.control.executors import LocalExecutor, LocalPipelineExecutor  # noqa: E402
from cluster.control.launch import build_cluster, shutdown_cluster  # noqa: E402
from cluster.control.placement import InstanceSpec  # noqa: E402
from cluster.control.scheduler_actor import SchedulerActor  # noqa: E402
from scheduler import Request, SamplingParams  # noqa: E402

BLOCK_SIZE = 4
NUM_BLOCKS = 128
NUM_LAYERS = 5
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.actors.conftest import make_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama-5-layers")
    return make_checkpoint(path, "llama", seed=3, num_hidden_layers=NUM_LAYERS)


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(1 + (i * 13) % 29)] for i in range(count)]


@pytest.fixture(scope="module")
def reference(deep_model: Path) -> list[list[int]]:
    """Greedy tokens of the in-process engine (one worker, all layers)."""
    from cluster.engine.llm import LLM

    llm = LLM(str(deep_model), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, progress=False)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(12), GREEDY)]


def test_layers_split_contiguously_earlier_stages_take_the_remainder() -> None:
    assert [pp_layer_range(5, r, 2) for r in range(2)] == [range(0, 3), range(3, 5)]
    assert [pp_layer_range(5, r, 3) for r in range(3)] == [range(0, 2), range(2, 4), range(4, 5)]
    assert [pp_layer_range(4, r, 4) for r in range(4)] == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="exceeds"):
        pp_layer_range(2, 0, 3)
    with pytest.raises(ValueError, match="pp_rank"):
        pp_layer_range(4, 2, 2)


# -- in process: the stages' hand-over, without Ray ----------------------------------------------
def _in_process_actor(model: Path, pp_size: int, **scheduler: Any) -> SchedulerActor:
    config = ClusterConfig.model_validate(
        {
            "model": str(model),
            "block_size": BLOCK_SIZE,
            "pools": [
                {"name": "c", "num_blocks": NUM_BLOCKS, "pp_size": pp_size, "scheduler": scheduler}
            ],
        }
    )
    stages = []
    for rank in range(pp_size):
        worker = ModelWorker(
            str(model), block_size=BLOCK_SIZE, progress=False, pp_rank=rank, pp_size=pp_size
        )
        worker.load_model()
        worker.init_kv_cache(NUM_BLOCKS)
        stages.append(worker)
    assert [w.layers for w in stages] == [
        pp_layer_range(NUM_LAYERS, r, pp_size) for r in range(pp_size)
    ]
    executor = LocalExecutor(stages[0]) if pp_size == 1 else LocalPipelineExecutor(stages)
    spec = InstanceSpec("c-0", config.pools[0], executor, None, stages[-1].info())
    return SchedulerActor(config, [spec])


def _run_in_process(actor: SchedulerActor, prompts: list[list[int]], params: SamplingParams) -> Any:
    async def one(i: int, prompt: list[int]) -> list[int]:
        request = Request(f"r{i}", prompt, params, eos_token_id=2)
        return [t async for o in actor.generate(request) for t in o.new_token_ids]

    async def run() -> tuple[list[list[int]], dict[str, Any]]:
        await actor.start()
        tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        stats = (await actor.stats())["instances"]["c-0"]
        await actor.check_integrity()
        await actor.shutdown()
        return list(tokens), stats

    return asyncio.run(asyncio.wait_for(run(), 120))


@pytest.mark.parametrize("pp_size", [2, 3])
def test_pipeline_stages_in_process_equal_one_worker(
    deep_model: Path, reference: list[list[int]], pp_size: int
) -> None:
    tokens, stats = _run_in_process(_in_process_actor(deep_model, pp_size), _prompts(12), GREEDY)
    assert tokens == reference
    assert stats["num_free_blocks"] == NUM_BLOCKS and stats["num_requests"] == 0
    # Seeded sampling: only the last stage samples, with the request's own generator.
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=11)
    one, _ = _run_in_process(_in_process_actor(deep_model, 1), _prompts(4, 5), seeded)
    split, _ = _run_in_process(_in_process_actor(deep_model, pp_size), _prompts(4, 5), seeded)
    assert split == one


def test_async_scheduling_overlaps_two_steps_and_changes_no_token(
    deep_model: Path, reference: list[list[int]]
) -> None:
    actor = _in_process_actor(deep_model, 1, async_scheduling=True)
    tokens, stats = _run_in_process(actor, _prompts(12), GREEDY)
    assert tokens == reference
    assert stats["max_in_flight"] == 2
    assert stats["num_free_blocks"] == NUM_BLOCKS


def test_control_calls_reach_every_in_process_stage(deep_model: Path) -> None:
    """Health, history and fault injection go to each stage of an in-process pipeline (its
    executor has no single worker)."""
    actor = _in_process_actor(deep_model, 2)

    async def run() -> dict[str, Any]:
        await actor.start()
        await actor.set_fault_injection("c-0", step_delay_s=0.01)
        history = await actor.transfer_history()
        health = await actor.worker_health()
        await actor.shutdown()
        return {"history": history["c-0"], "health": health["c-0"]}

    result = asyncio.run(asyncio.wait_for(run(), 60))
    assert result["history"] == []  # no connector: nothing moved
    stages = result["health"]["stages"]
    assert len(stages) == 2 and all(s["ok"] and s["num_blocks"] == NUM_BLOCKS for s in stages)
    stage_workers = actor.specs["c-0"].executor.workers
    assert [w.step_delay_s for w in stage_workers] == [0.01, 0.01]


# -- on the Ray cluster: stages on different nodes ------------------------------------------------
def _config(model: Path, pools: list[dict[str, Any]], **extra: Any) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {"model": str(model), "block_size": BLOCK_SIZE, "pools": pools, **extra}
    )


def _ids(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def split_across_nodes(ray_cluster: RayCluster, deep_model: Path) -> Iterator[Any]:
    """One colocated instance, pp=2, stage 0 on the prefill node and stage 1 on the decode
    node."""
    pool = {
        "name": "c",
        "num_blocks": NUM_BLOCKS,
        "pp_size": 2,
        "stage_resources": [{"prefill": 0.01}, {"decode": 0.01}],
    }
    handle = build_cluster(_config(deep_model, [pool]), name="pp2", namespace="tandem-tests")
    yield handle
    shutdown_cluster(handle)


def test_stages_on_different_nodes_equal_one_worker(
    split_across_nodes: Any, ray_cluster: RayCluster, reference: list[list[int]]
) -> None:
    health = ray.get(split_across_nodes.worker_health.remote())["c-0"]
    nodes = [stage["node_id"] for stage in health["stages"]]
    assert nodes == [ray_cluster.prefill_node_id, ray_cluster.decode_node_id]
    client = ClusterClient(split_across_nodes)
    assert _ids(client.generate(_prompts(12), GREEDY)) == reference
    stats = client.stats()["instances"]["c-0"]
    # 12 requests split in two micro-batches: both stages had a step.
    assert stats["max_in_flight"] == 2
    assert_clean(split_across_nodes)


@pytest.mark.parametrize(("prefill_pp", "decode_pp"), [(2, 1), (1, 2), (2, 3)])
def test_disaggregation_between_different_pipeline_splits(
    ray_cluster: RayCluster,
    deep_model: Path,
    reference: list[list[int]],
    prefill_pp: int,
    decode_pp: int,
) -> None:
    pools = [
        {
            "name": "p",
            "role": "prefill",
            "resources": {"prefill": 0.01},
            "num_blocks": NUM_BLOCKS,
            "pp_size": prefill_pp,
        },
        {
            "name": "d",
            "role": "decode",
            "resources": {"decode": 0.01},
            "num_blocks": NUM_BLOCKS,
            "pp_size": decode_pp,
        },
    ]
    config = _config(deep_model, pools, router={"disaggregation": "always"})
    handle = build_cluster(config, name=f"pd-{prefill_pp}-{decode_pp}", namespace="tandem-tests")
    try:
        client = ClusterClient(handle)
        prompts = _prompts(12)
        assert _ids(client.generate(prompts, GREEDY)) == reference
        stats = client.stats()["instances"]
        handed_off = [t for t in reference if len(t) > 1]
        # The KV crossed: the decode instance computed no prompt token.
        assert stats["d-0"]["num_prompt_tokens_computed"] == 0
        assert stats["d-0"]["num_kv_loads_started"] == len(handed_off)
        assert stats["p-0"]["num_kv_saves_started"] == len(prompts)
        # Every decode stage loaded its own layers of every handed-off request, nothing more.
        history = ray.get(handle.transfer_history.remote())["d-0"]
        loads = [r for r in history if r.kind == "load"]
        assert len(loads) == decode_pp * len(handed_off) and all(r.ok for r in loads)
        assert_clean(handle)
    finally:
        shutdown_cluster(handle)
