"""Multi-LoRA: our fused-projection deltas equal PEFT's merged model (float32), several adapters
and base-model requests in one flattened batch; LRU caches; clear errors for bad adapters."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from actors.lora import LoRAManager
from actors.model.llama import LlamaForCausalLM
from actors.model.loader import load_model
from scheduler.config import LoRAConfig
from scheduler.request import LoRARequest
from tests.actors.conftest import transformers
from tests.actors.paged import PagedRunner

peft = pytest.importorskip("peft")

TOL = 1e-4
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, LoraConfig kwargs)
ADAPTERS: dict[str, tuple[int, dict[str, Any]]] = {
    "a": (1, dict(r=8, lora_alpha=16, target_modules=ALL)),
    "b": (2, dict(r=16, lora_alpha=8, target_modules=ALL)),
    "rs64": (3, dict(r=64, lora_alpha=32, use_rslora=True, target_modules=ALL)),
    # Partial fused groups (q+v, no k; down only), layer 1 only, per-module rank and alpha.
    "part": (
        4,
        dict(
            r=8,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "down_proj"],
            layers_to_transform=[1],
            rank_pattern={"v_proj": 4},
            alpha_pattern={"down_proj": 3},
        ),
    ),
    "regex": (5, dict(r=8, lora_alpha=24, target_modules=r".*\.(k_proj|up_proj|o_proj)")),
}


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Random PEFT adapters (``init_lora_weights=False``: lora_B is not zero)."""
    root = tmp_path_factory.mktemp("loras")
    out = {}
    for name, (seed, kwargs) in ADAPTERS.items():
        base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        torch.manual_seed(seed)
        config = peft.LoraConfig(init_lora_weights=False, **kwargs)
        peft.get_peft_model(base, config).save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def reference(tiny_llama: Path, adapters: dict[str, Path]) -> Any:
    """``reference(name or None, tokens)`` -> PEFT merged (or plain HF) logits [L, vocab]."""
    models: dict[str | None, Any] = {}

    def logits(name: str | None, tokens: list[int]) -> torch.Tensor:
        if name not in models:
            base = transformers.AutoModelForCausalLM.from_pretrained(
                tiny_llama, dtype=torch.float32
            )
            if name is not None:
                base = peft.PeftModel.from_pretrained(base, adapters[name]).merge_and_unload()
            models[name] = base.eval()
        with torch.no_grad():
            out: torch.Tensor = models[name](torch.tensor([tokens])).logits[0].float()
        return out

    return logits


@pytest.fixture(scope="module")
def model(tiny_llama: Path) -> LlamaForCausalLM:
    return load_model(tiny_llama, dtype=torch.float32, progress=False)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def lora(adapters: dict[str, Path], name: str) -> LoRARequest:
    return LoRARequest(
        lora_name=name, lora_int_id=list(ADAPTERS).index(name) + 1, lora_path=str(adapters[name])
    )


def manager(model: LlamaForCausalLM, **kwargs: Any) -> LoRAManager:
    return LoRAManager(model.config, LoRAConfig(**kwargs), torch.device("cpu"), torch.float32)


def run_prefill(
    model: LlamaForCausalLM,
    mgr: LoRAManager,
    adapters: dict[str, Path],
    reqs: list[tuple[str | None, list[int]]],
    reference: Any,
) -> None:
    """One flattened prefill step of ``reqs`` (adapter name or None, prompt); each request's
    logits must match its own reference model."""
    loras = [None if name is None else lora(adapters, name) for name, _ in reqs]
    hook = mgr.prepare([(lr, len(t)) for lr, (_, t) in zip(loras, reqs, strict=True)])
    assert (hook is None) == all(lr is None for lr in loras)
    order = sorted(range(len(reqs)), key=lambda i: len(reqs[i][1]) != 1)
    assert order == list(range(len(reqs))), "single-token prompts must come first"
    out = PagedRunner(model).step([(f"s{i}", t, 0) for i, (_, t) in enumerate(reqs)], hook)
    for i, ((name, tokens), got) in enumerate(zip(reqs, out, strict=True)):
        diff = (got - reference(name, tokens)).abs().max().item()
        assert diff <= TOL, f"request {i} ({name}): max |diff| {diff}"


def test_adapters_change_the_output(reference: Any) -> None:
    tokens = prompt(7, 0)
    base = reference(None, tokens)
    for name in ADAPTERS:
        assert (reference(name, tokens) - base).abs().max().item() > 1e-2, name


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_single_adapter_matches_peft(
    model: LlamaForCausalLM, adapters: dict[str, Path], reference: Any, name: str
) -> None:
    mgr = manager(model, max_lora_rank=64)
    run_prefill(model, mgr, adapters, [(name, prompt(13, 1))], reference)


def test_mixed_batch_two_adapters_and_base(
    model: LlamaForCausalLM, adapters: dict[str, Path], reference: Any
) -> None:
    mgr = manager(model, max_loras=2)
    reqs = [("a", prompt(11, 2)), ("b", prompt(5, 3)), (None, prompt(17, 4))]
    run_prefill(model, mgr, adapters, reqs, reference)
    assert mgr.active_loras() == {1, 2}


def test_adapter_on_non_adjacent_requests(
    model: LlamaForCausalLM, adapters: dict[str, Path], reference: Any
) -> None:
    """Adapter ``a`` owns two separate runs of tokens: the gather/index_add path."""
    mgr = manager(model, max_loras=3, max_lora_rank=64)
    reqs = [
        ("a", prompt(1, 5)),
        (None, prompt(1, 6)),
        ("rs64", prompt(6, 7)),
        ("a", prompt(9, 8)),
        ("part", prompt(4, 9)),
        (None, prompt(3, 10)),
    ]
    run_prefill(model, mgr, adapters, reqs, reference)


def test_prefill_then_mixed_decodes(
    model: LlamaForCausalLM, adapters: dict[str, Path], reference: Any
) -> None:
    """Prefill, then decode steps with three sequences (adapter a, base, adapter b) batched."""
    mgr = manager(model, max_loras=2)
    names: list[str | None] = ["a", None, "b"]
    seqs = [prompt(n, 20 + n) for n in (6, 9, 3)]
    loras = [None if n is None else lora(adapters, n) for n in names]
    runner = PagedRunner(model)
    hook = mgr.prepare([(lr, len(s)) for lr, s in zip(loras, seqs, strict=True)])
    runner.step([(f"s{i}", s, 0) for i, s in enumerate(seqs)], hook)
    for step in range(4):
        new = [prompt(1, 100 * step + i)[0] for i in range(3)]
        batch = [(f"s{i}", [tok], len(seqs[i])) for i, tok in enumerate(new)]
        hook = mgr.prepare([(lr, 1) for lr in loras])
        out = runner.step(batch, hook)
        for i, tok in enumerate(new):
            seqs[i].append(tok)
            ref = reference(names[i], seqs[i])[-1]
            assert (out[i][0] - ref).abs().max().item() <= TOL, f"step {step}, seq {i}"


def test_base_only_batch_returns_none(model: LlamaForCausalLM, adapters: dict[str, Path]) -> None:
    mgr = manager(model)
    assert mgr.prepare([(None, 5), (None, 1)]) is None
    assert mgr.prepare([(lora(adapters, "a"), 0), (None, 3)]) is None
    assert mgr.list_loras() == set()


def test_lru_eviction_keeps_results_right(
    model: LlamaForCausalLM, adapters: dict[str, Path], reference: Any
) -> None:
    mgr = manager(model, max_loras=1, max_cpu_loras=2, max_lora_rank=64)
    tokens = prompt(8, 30)
    for name, cached in [
        ("a", {1}),
        ("b", {1, 2}),
        ("rs64", {2, 3}),  # a evicted
        ("a", {3, 1}),  # b evicted, a reloaded
        ("rs64", {3, 1}),  # hit
    ]:
        run_prefill(model, mgr, adapters, [(None, prompt(1, 31)), (name, tokens)], reference)
        assert mgr.list_loras() == cached, name
        assert mgr.active_loras() == {lora(adapters, name).lora_int_id}


def test_eviction_spares_the_current_batch(
    model: LlamaForCausalLM, adapters: dict[str, Path]
) -> None:
    mgr = manager(model, max_loras=2, max_cpu_loras=2, max_lora_rank=64)
    a, b, c = (lora(adapters, n) for n in ("a", "b", "rs64"))
    assert mgr.prepare([(a, 2), (b, 3)]) is not None
    # b is the most recently used, but c and a are in this batch: b goes, a stays.
    assert mgr.prepare([(c, 2), (a, 3)]) is not None
    assert mgr.list_loras() == {1, 3} and mgr.active_loras() == {1, 3}


def test_too_many_adapters_in_one_batch(model: LlamaForCausalLM, adapters: dict[str, Path]) -> None:
    mgr = manager(model, max_loras=1)
    with pytest.raises(RuntimeError, match=r"2 distinct LoRA adapters.*max_loras=1"):
        mgr.prepare([(lora(adapters, "a"), 2), (None, 1), (lora(adapters, "b"), 3)])


def test_add_remove_list(model: LlamaForCausalLM, adapters: dict[str, Path]) -> None:
    mgr = manager(model, max_cpu_loras=2)
    a, b = lora(adapters, "a"), lora(adapters, "b")
    assert mgr.add_lora(a) and mgr.add_lora(b)
    assert not mgr.add_lora(a)
    assert mgr.list_loras() == {1, 2}
    assert mgr.remove_lora(1) and not mgr.remove_lora(1)
    assert mgr.list_loras() == {2}


def test_a_pipeline_stage_keeps_its_own_layers_of_an_adapter(
    model: LlamaForCausalLM, adapters: dict[str, Path]
) -> None:
    """A stage applies only its layers' deltas: it keeps only those (every stage held the
    whole adapter, pp_size times the memory)."""
    whole = manager(model)
    stage = LoRAManager(
        model.config, LoRAConfig(), torch.device("cpu"), torch.float32, layers=range(1, 2)
    )
    a = lora(adapters, "a")
    whole.add_lora(a)
    stage.add_lora(a)
    everything = whole._cpu[a.lora_int_id]
    assert {layer for layer, _ in everything} == {0, 1}  # (the adapter spans both layers)
    kept = stage._cpu[a.lora_int_id]
    assert set(kept) == {k for k in everything if k[0] == 1}
    assert all(torch.equal(kept[k].a, everything[k].a) for k in kept)


def _broken_copy(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_dora": True}, r"DoRA \(use_dora\) is not supported"),
        ({"bias": "all"}, r"bias='all' is not supported"),
        ({"modules_to_save": ["lm_head"]}, r"modules_to_save\) is not supported"),
        ({"r": 4}, r"tensor .*layers\.0\..*lora_A.weight has shape \(8, 64\), expected \(4, 64\)"),
        ({"r": 32}, r"adapter rank 32 exceeds max_lora_rank=16"),
    ],
)
def test_bad_adapter_configs(
    model: LlamaForCausalLM,
    adapters: dict[str, Path],
    tmp_path: Path,
    changes: dict[str, Any],
    message: str,
) -> None:
    mgr = manager(model, max_lora_rank=16)
    bad = _broken_copy(adapters["a"], tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=message):
        mgr.add_lora(LoRARequest(lora_name="bad", lora_int_id=9, lora_path=str(bad)))
    assert mgr.list_loras() == set()  # a failed load leaves the cache as it was


def test_rank_above_max_is_refused(model: LlamaForCausalLM, adapters: dict[str, Path]) -> None:
    mgr = manager(model, max_lora_rank=32)
    with pytest.raises(ValueError, match=r"adapter rank 64 exceeds max_lora_rank=32"):
        mgr.add_lora(lora(adapters, "rs64"))


def test_missing_adapter_dir(model: LlamaForCausalLM, tmp_path: Path) -> None:
    mgr = manager(model)
    req = LoRARequest(lora_name="x", lora_int_id=1, lora_path=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"no adapter_config\.json"):
        mgr.prepare([(req, 3)])


def test_unsupported_tensor_is_named(
    model: LlamaForCausalLM, adapters: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file, save_file

    bad = _broken_copy(adapters["a"], tmp_path / "bad")
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    req = LoRARequest(lora_name="bad", lora_int_id=9, lora_path=str(bad))
    with pytest.raises(ValueError, match=r"tensor base_model\.model\.lm_head\.lora_A\.weight"):
        manager(model).add_lora(req)


def test_a_damaged_weights_file_is_a_value_error_naming_the_adapter(
    model: LlamaForCausalLM, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """A truncated adapter_model.safetensors raises safetensors' own error, which is no
    ValueError: the control plane made it a 500 (not the 400 naming the adapter)."""
    bad = _broken_copy(adapters["a"], tmp_path / "bad")
    weights = bad / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # (the header alone is longer)
    req = LoRARequest(lora_name="bad", lora_int_id=9, lora_path=str(bad))
    mgr = manager(model)
    with pytest.raises(ValueError, match=r"LoRA adapter .*bad: its weights could not be read"):
        mgr.add_lora(req)
    assert mgr.list_loras() == set()


def test_bfloat16_adapter_close_to_reference(
    tiny_llama: Path, adapters: dict[str, Path], reference: Any
) -> None:
    """Weights stored and applied in the model dtype; bf16 rounding only."""
    bf16 = load_model(tiny_llama, dtype=torch.bfloat16, progress=False)
    mgr = LoRAManager(bf16.config, LoRAConfig(), torch.device("cpu"), torch.bfloat16)
    tokens = prompt(10, 40)
    hook = mgr.prepare([(lora(adapters, "a"), len(tokens))])
    got = PagedRunner(bf16).step([("s", tokens, 0)], hook)[0].float()
    ref = reference("a", tokens)
    base = reference(None, tokens)
    err = (got - ref).abs().max().item()
    assert err < 0.2 * (ref - base).abs().max().item(), err


def test_engine_greedy_with_adapters_matches_peft_generate(
    tiny_llama: Path, adapters: dict[str, Path], reference: Any
) -> None:
    """End to end through the scheduler and ``ModelWorker``: requests on adapters a, b and the
    base model in one engine; each greedy continuation equals its reference model's."""
    from cluster import LLM, SamplingParams

    llm = LLM(
        str(tiny_llama),
        dtype="float32",
        progress=False,
        block_size=4,
        num_blocks=128,
        enable_lora=True,
        max_loras=2,
    )
    names: list[str | None] = ["a", None, "b", "a"]
    prompts = [prompt(n, 50 + n) for n in (7, 12, 4, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(
        prompts, params, lora_request=[None if n is None else lora(adapters, n) for n in names]
    )
    for name, tokens, out in zip(names, prompts, outs, strict=True):
        seq = list(tokens)
        for _ in range(12):  # greedy with the reference's logits, one token at a time
            seq.append(int(reference(name, seq)[-1].argmax()))
        assert out.outputs[0].token_ids == seq[len(tokens) :], name
    assert llm.engine.worker.list_loras() == {1, 2}


def test_an_adapter_gone_from_disk_fails_only_its_requests(
    tiny_llama: Path, adapters: dict[str, Path], reference: Any, tmp_path: Path
) -> None:
    """An adapter evicted from the worker's cache is read again from its path when its
    requests next run. Its files were removed meanwhile: its request ends with an error that
    names it, and the engine goes on -- requests on another adapter and on the base model
    give their reference tokens. (The step raised, which stopped the engine, and in a
    cluster the instance with every request on it.)"""
    from cluster import LLM, SamplingParams
    from scheduler.outputs import ADAPTER_UNREADABLE

    llm = LLM(
        str(tiny_llama),
        dtype="float32",
        progress=False,
        block_size=4,
        num_blocks=128,
        enable_lora=True,
        max_loras=1,  # max_cpu_loras = 1: loading b evicts the first adapter
    )
    engine = llm.engine
    gone_dir = tmp_path / "gone"
    shutil.copytree(adapters["a"], gone_dir)
    gone = LoRARequest(lora_name="gone", lora_int_id=9, lora_path=str(gone_dir))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    names: list[str | None] = ["gone", "b", None]
    prompts = [prompt(n, 60 + n) for n in (7, 5, 6)]
    for i, (name, tokens) in enumerate(zip(names, prompts, strict=True)):
        lr = gone if name == "gone" else None if name is None else lora(adapters, name)
        engine.add_request(str(i), tokens, params, lora_request=lr)
    assert engine.worker.list_loras() == {2}  # "gone" was evicted by b's load
    shutil.rmtree(gone_dir)
    final = {}
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    failed = final["0"].outputs[0]
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert failed.error is not None and "`gone`" in failed.error
    assert failed.error.startswith(ADAPTER_UNREADABLE)  # (the control plane reads it)
    assert str(gone_dir) not in failed.error  # (clients see the name, never the path)
    for rid, name, tokens in (("1", "b", prompts[1]), ("2", None, prompts[2])):
        seq = list(tokens)
        for _ in range(4):
            seq.append(int(reference(name, seq)[-1].argmax()))
        assert final[rid].outputs[0].token_ids == seq[len(tokens) :], name
    engine.scheduler.check_integrity()
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
