"""ModelWorker pieces the engine tests do not reach: sharded checkpoints, cache sizing,
and refusing a step it cannot serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from actors.model.loader import load_model
from actors.worker import ModelWorker
from scheduler import CacheConfig, Request, SamplingParams, Scheduler, SchedulerConfig
from tests.actors.conftest import make_checkpoint, transformers


def test_sharded_safetensors_load_like_single(tiny_llama: Path, tmp_path: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2  # really sharded
    single = load_model(tiny_llama, torch.float32, progress=False)
    sharded = load_model(tmp_path, torch.float32, progress=False)
    for (name, a), (_, b) in zip(
        single.state_dict().items(), sharded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    make_checkpoint(tmp_path, "llama", seed=5)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers\.1\.gate_up_proj"):
        load_model(tmp_path, torch.float32, progress=False)


def test_profile_num_blocks(tiny_llama: Path) -> None:
    worker = ModelWorker(str(tiny_llama), dtype="float32", block_size=4, progress=False)
    worker.load_model()
    per_block = worker.bytes_per_block()
    assert per_block == 2 * 2 * 4 * 2 * 16 * 4  # K+V, layers, block, kv heads, head dim, fp32
    overhead = worker.weight_bytes() + worker.activation_bytes()
    assert worker.profile_num_blocks(overhead + 10 * per_block + 1) == 10
    with pytest.raises(ValueError, match="no room for the KV cache"):
        worker.profile_num_blocks(overhead // 2)


def test_step_beyond_known_tokens_is_refused(tiny_llama: Path) -> None:
    worker = ModelWorker(str(tiny_llama), dtype="float32", block_size=4, progress=False)
    worker.load_model()
    worker.init_kv_cache(16)
    sched = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4, num_blocks=16))
    sched.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=4)))
    out = sched.schedule()
    worker.execute_model(out)
    out.num_scheduled_tokens["ghost"] = 1  # a request the worker never saw
    with pytest.raises(RuntimeError, match="never sent to this worker"):
        worker.execute_model(out)
    assert worker.health()["ok"]


def test_decode_graph_buckets() -> None:
    """The CUDA graphs' buckets (``actors.model.cuda_graphs``; the graphs themselves run in
    tests/gpu): vLLM's batch sizes, widths in powers of two capped at the context."""
    from actors.model.cuda_graphs import batch_buckets, width_bucket

    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 4]  # the last holds max_batch (padded)
    assert batch_buckets(4) == [1, 2, 4]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 24]
    assert batch_buckets(256)[-3:] == [240, 248, 256]
    assert [width_bucket(b, 32) for b in (1, 4, 5, 9, 17, 33)] == [4, 4, 8, 16, 32, 32]
    assert width_bucket(6, 6) == 6  # the cap need not be a power of two


def test_no_graphs_or_scratch_block_off_cuda(tiny_llama: Path) -> None:
    worker = ModelWorker(str(tiny_llama), dtype="float32", block_size=4, progress=False)
    worker.load_model()
    worker.init_kv_cache(16)
    assert worker.decode_graphs is None
    assert worker.kv_caches[0].shape[1] == 16
