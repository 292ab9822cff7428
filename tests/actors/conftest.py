"""Tiny random checkpoints written by the tests themselves (no model download)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

TINY: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)


def make_checkpoint(path: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Save a random float32 Llama / Mistral / Qwen2 ForCausalLM as safetensors in ``path``."""
    torch.manual_seed(seed)
    kwargs = {**TINY, **overrides}
    if arch == "llama":
        kwargs.setdefault("tie_word_embeddings", False)
        config = transformers.LlamaConfig(**kwargs)
        model = transformers.LlamaForCausalLM(config)
    elif arch == "mistral":
        kwargs.setdefault("tie_word_embeddings", False)
        config = transformers.MistralConfig(**kwargs)
        model = transformers.MistralForCausalLM(config)
    elif arch == "qwen2":
        kwargs.setdefault("tie_word_embeddings", True)
        config = transformers.Qwen2Config(**kwargs)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(arch)
    with torch.no_grad():
        # Non-trivial norm weights (HF initialises them to 1, which would hide a missing or
        # misplaced scale) and biases large enough to matter.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path, kwargs["vocab_size"])
    return path


def write_byte_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer with no merges: ids 0..255 are the 256 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    assert len(vocab) == 256 <= vocab_size
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")
