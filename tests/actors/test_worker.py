"""ModelWorker pieces the engine tests do not reach: sharded checkpoints, cache sizing,
and refusing a step it cannot serve."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

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


def test_a_whole_prompt_budget_is_the_models_longest_context(tiny_llama: Path) -> None:
    """No budget given (chunked prefill off, the cluster's max_model_len still unknown): a
    step's activations are sized for a prompt of the model's whole context."""

    def activations(budget: int | None) -> int:
        worker = ModelWorker(
            str(tiny_llama), dtype="float32", max_num_batched_tokens=budget, progress=False
        )
        worker.load_model()
        return worker.activation_bytes()

    config = json.loads((tiny_llama / "config.json").read_text())
    longest = max(config["max_position_embeddings"], 2048)
    assert activations(None) == activations(longest) > activations(longest // 2)


def test_a_step_the_worker_cannot_run_is_refused_naming_why(tiny_llama: Path) -> None:
    worker = ModelWorker(str(tiny_llama), dtype="float32", block_size=4, progress=False)
    worker.load_model()
    worker.init_kv_cache(16)
    sched = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(block_size=4, num_blocks=16))
    sched.add_request(Request("r", [1, 2, 3], SamplingParams(max_tokens=4)))
    out = sched.schedule()
    worker.execute_model(out)
    bad = copy.deepcopy(out)
    bad.num_scheduled_tokens["ghost"] = 1  # a request the worker never saw
    with pytest.raises(RuntimeError, match="never sent to this worker"):
        worker.execute_model(bad)
    bad = copy.deepcopy(out)
    bad.num_scheduled_tokens["r"] = 5  # past the 3 tokens it was sent
    with pytest.raises(RuntimeError, match=r"tokens \[0, 5\) scheduled but only 3 are known"):
        worker.execute_model(bad)
    bad = copy.deepcopy(out)
    bad.scheduled_new_reqs[0].block_ids = []  # no block for its tokens
    with pytest.raises(RuntimeError, match="3 tokens need more than its 0 blocks"):
        worker.execute_model(bad)
    bad = copy.deepcopy(sched.schedule())
    bad.scheduled_cached_reqs.req_ids = ["ghost"]  # a diff for a request it never saw
    with pytest.raises(RuntimeError, match="diff for unknown request 'ghost'"):
        worker.execute_model(bad)
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


def test_padded_decode_steps_equal_the_eager_step(tiny_llama: Path) -> None:
    """``DecodeGraphs``' padded step, run without capture (``capture=False``: the buffers and
    the forward a graph holds, eagerly, on CPU), against the worker's eager step: the same
    hidden states and the same cache writes; the padding row writes only the scratch block.
    Tables longer than a row needs are cut, shorter widths padded with the scratch block."""
    from actors.model.attention import AttentionMetadata
    from actors.model.cuda_graphs import DecodeGraphs

    worker = ModelWorker(str(tiny_llama), dtype="float32", block_size=4, progress=False)
    worker.load_model()
    worker.init_kv_cache(17)
    model, caches, scratch = worker.model, worker.kv_caches, 16  # block 16 plays the scratch
    assert model is not None
    torch.manual_seed(0)
    for cache in caches:
        cache.normal_()
        cache[:, scratch].zero_()
    ids, positions = [5, 17, 9], [5, 17, 2]
    tables = [[3, 7, 11], [1, 2, 9, 4, 12], [8]]  # needs 2, 5 and 1 blocks
    before = [c.clone() for c in caches]
    meta = AttentionMetadata.build([1, 1, 1], [p + 1 for p in positions], tables, 4, worker.device)
    eager = model(torch.tensor(ids), torch.tensor(positions), caches, meta, worker.attn)
    after_eager = [c.clone() for c in caches]
    for cache, old in zip(caches, before, strict=True):
        cache.copy_(old)
    graphs = DecodeGraphs(
        model, caches, worker.attn, 4, scratch, max_batch=8, max_width=8, capture=False
    )
    assert graphs.bucket_for(3, 5) == (4, 8)  # a padding row, widths padded to 8 blocks
    got = graphs.run(ids, positions, tables)
    assert got is not None
    torch.testing.assert_close(got, eager, rtol=0, atol=1e-5)
    for cache, ref, old in zip(caches, after_eager, before, strict=True):
        torch.testing.assert_close(cache[:, :scratch], ref[:, :scratch], rtol=0, atol=1e-5)
        assert not torch.equal(ref[:, :scratch], old[:, :scratch])  # the step wrote K/V
        assert ref[:, scratch].abs().sum() == 0  # eager: nothing in the scratch block
        assert cache[:, scratch].abs().sum() > 0  # padded: the padding row's K/V, there
    # Steps that would gather more than the cap run eagerly (no bucket).
    capped = DecodeGraphs(
        model,
        caches,
        worker.attn,
        4,
        scratch,
        8,
        8,
        max_gather_bytes=16 * graphs.row_bytes,
        capture=False,
    )
    assert capped.bucket_for(3, 4) == (4, 4) and capped.bucket_for(3, 5) is None
    assert capped.run(ids, positions, tables) is None


def test_the_kv_connector_is_used_under_the_step_lock(tiny_llama: Path) -> None:
    """KV probes run on a thread of their own and use the connector under the worker's step
    lock (its agent is not thread-safe): so do a new cache, the worker's peer info and its
    shutdown -- they used it with no lock, beside a probe."""
    worker = ModelWorker(str(tiny_llama), dtype="float32", block_size=4, progress=False)
    worker.load_model()
    worker.init_kv_cache(8)
    locked: list[tuple[str, bool]] = []

    class Connector:
        def __getattr__(self, name: str) -> Any:
            def call(*args: Any) -> None:
                locked.append((name, worker._step_lock.locked()))

            return call

    worker.connector = Connector()  # type: ignore[assignment]
    worker.kv_transfer = "stand-in"
    worker.init_kv_cache(8)
    worker.kv_peer()
    worker.shutdown()
    assert {name for name, _ in locked} >= {
        "release_caches",
        "register_kv_caches",
        "peer_info",
        "close",
    }
    assert all(held for _, held in locked), locked


@pytest.mark.parametrize("transport", ["ray", "grpc", "nixl"])
def test_a_new_kv_cache_is_allocated_after_the_old_one_went(
    tiny_llama: Path, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A survivor's cache made anew (an instance restored): the connector let go of the old
    cache only once the new one was registered, so both were held at once -- on a GPU sized
    for one, the second did not fit."""
    import weakref

    from kv_transfer.registry import available_transports

    if transport not in available_transports():
        pytest.skip(f"the {transport} transport is not installed")
    import kv_transfer.blocks

    bindings: list[weakref.ref[Any]] = []  # nixl: each agent's C++ side, dead once ended
    if transport == "nixl":
        from kv_transfer import nixl_transport

        make_agent = nixl_transport._make_agent

        def recorded(*args: Any) -> Any:
            agent = make_agent(*args)
            bindings.append(weakref.ref(agent.agent))
            return agent

        monkeypatch.setattr(nixl_transport, "_make_agent", recorded)
    options = {"auth_token": "t"} if transport == "grpc" else {}
    worker = ModelWorker(
        str(tiny_llama),
        dtype="float32",
        block_size=4,
        progress=False,
        kv_transfer=transport,
        kv_transfer_options=options,
    )
    worker.load_model()
    worker.init_kv_cache(8)
    old = weakref.ref(worker.kv_caches[0])
    alive_at_allocation: list[bool] = []
    allocate = kv_transfer.blocks.allocate_kv_caches

    def watched(*args: Any, **kwargs: Any) -> Any:
        alive_at_allocation.append(old() is not None)
        return allocate(*args, **kwargs)

    monkeypatch.setattr(kv_transfer.blocks, "allocate_kv_caches", watched)
    try:
        worker.init_kv_cache(8)
        assert alive_at_allocation == [False]
        assert worker.connector is not None and worker.connector.kv_caches == worker.kv_caches
        if transport == "nixl":  # the old cache's agent ended with it; the new one serves
            assert [ref() is None for ref in bindings] == [True, False]
    finally:
        worker.shutdown()
    # The old cache's agent ended with it, the new one at shutdown: neither is left for the
    # garbage collector, which would end it during some later test, under UCX's feet.
    assert len(bindings) == (2 if transport == "nixl" else 0)
    assert not [ref for ref in bindings if ref() is not None]


def test_the_actor_class_forwards_every_public_method_and_imports_no_torch() -> None:
    """``WorkerActor`` (the class Ray loads wherever a worker's handle is unpickled) offers
    every public method of ``ModelWorker``, and importing it loads no torch."""
    import inspect
    import subprocess
    import sys

    from actors.worker_actor import REMOTE_METHODS, WorkerActor

    public = {
        n for n, _ in inspect.getmembers(ModelWorker, inspect.isfunction) if not n.startswith("_")
    }
    assert set(REMOTE_METHODS) == public
    assert all(callable(getattr(WorkerActor, n)) for n in public)
    code = "import sys, actors.worker_actor; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr


def test_the_actor_class_runs_the_worker(tiny_llama: Path) -> None:
    """Its methods are the worker's: built from the same arguments, it loads the model and
    sizes the same cache."""
    from actors.worker_actor import WorkerActor

    actor: Any = WorkerActor(model=str(tiny_llama), block_size=4)
    direct = ModelWorker(model=str(tiny_llama), block_size=4)
    actor.load_model()
    direct.load_model()
    assert actor.bytes_per_block() == direct.bytes_per_block() > 0
    assert actor.info() == direct.info()


def test_the_actor_class_forwards_plain_calls_with_arguments_the_worker_takes() -> None:
    """``WorkerActor``'s forwarders are plain calls taking ``*args, **kwargs``: Ray no longer
    sees ``ModelWorker``'s signatures, so a keyword the worker does not take fails inside the
    worker's process (its constructor: the actor dies, reported at "load the model") instead
    of at ``.remote()``, and a coroutine or generator method would hand Ray a coroutine or a
    generator object to return (Ray runs those only when the actor class's own method is
    one)."""
    import inspect

    from actors.worker_actor import REMOTE_METHODS
    from cluster.config import ClusterConfig
    from cluster.control.placement import worker_kwargs

    for name in REMOTE_METHODS:
        method = getattr(ModelWorker, name)
        assert not inspect.iscoroutinefunction(method), name
        assert not inspect.isgeneratorfunction(method), name
        assert not inspect.isasyncgenfunction(method), name
    taken = set(inspect.signature(ModelWorker.__init__).parameters) - {"self"}
    config = ClusterConfig.from_yaml(
        "pools: [{name: p, role: prefill, pp_size: 2}, {name: d, role: decode}]\n"
        "model: x\nkv_transfer: {transport: auto}"
    )
    for pool in config.pools:
        for rank in range(pool.pp_size):
            assert set(worker_kwargs(config, pool, rank, "ray")) <= taken
