"""``ModelConfig``: how long a context the model is served at -- its positions (stretched by
a linear or yarn rope scaling, as vLLM derives ``max_model_len``), capped by a sliding window
that attention here does not implement -- read from a checkpoint's ``config.json``."""

from __future__ import annotations

from typing import Any

import pytest

from actors.model.config import ModelConfig

BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 32768,
}


def config(model_type: str = "llama", **extra: Any) -> ModelConfig:
    return ModelConfig.from_hf({**BASE, "model_type": model_type, **extra})


@pytest.mark.parametrize(
    ("scaling", "positions"),
    [
        (None, 32768),
        ({"rope_type": "linear", "factor": 2.0}, 65536),
        # Qwen2.5's recommended yarn: x4 over the original 32k.
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
        ({"type": "yarn", "factor": 4.0}, 131072),  # no original: max_position_embeddings
        # llama3 checkpoints give the stretched length already.
        (
            {
                "rope_type": "llama3",
                "factor": 8.0,
                "original_max_position_embeddings": 8192,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
            },
            32768,
        ),
    ],
)
def test_rope_scaling_stretches_the_positions_as_vllm_derives_them(
    scaling: dict[str, Any] | None, positions: int
) -> None:
    cfg = config(rope_scaling=scaling)
    assert cfg.max_positions == positions and cfg.max_context_len == positions


def test_a_sliding_window_caps_the_context_where_the_model_uses_one() -> None:
    assert config("mistral", sliding_window=4096).max_context_len == 4096  # Mistral v0.1
    assert config("mistral", sliding_window=None).max_context_len == 32768  # v0.2 on
    # Qwen2 configs name a window they use only with use_sliding_window (default false).
    assert config("qwen2", sliding_window=4096).max_context_len == 32768
    assert config("qwen2", sliding_window=4096, use_sliding_window=True).max_context_len == 4096
    # A window at least as long as the positions changes nothing.
    assert config("mistral", sliding_window=65536).max_context_len == 32768


def test_yarn_without_an_original_length_rotates_from_the_trained_one() -> None:
    """A config.json's yarn scaling with no ``original_max_position_embeddings``: the rope
    takes ``max_position_embeddings``, as transformers does (it raised a KeyError)."""
    from actors.model.rope import _inv_freq

    cfg = config(rope_scaling={"type": "yarn", "factor": 4.0})
    assert cfg.rope_scaling is not None
    assert cfg.rope_scaling["original_max_position_embeddings"] == 32768
    inv, mscale = _inv_freq(16, 10000.0, cfg.rope_scaling)
    assert inv.shape == (8,) and mscale > 1
