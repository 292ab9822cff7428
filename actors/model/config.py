"""The model's architecture, read from a Hugging Face ``config.json`` (or the same keys built from
GGUF metadata). One decoder covers Llama, SmolLM2, Mistral and Qwen2; the differences are data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters. ``rope_scaling`` is Hugging Face's dict (or None)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # the checkpoint's dtype, when it says
    sliding_window: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def max_positions(self) -> int:
        """The positions the model is served at: ``max_position_embeddings``, stretched by a
        ``linear`` or ``yarn`` rope scaling's factor (as vLLM derives it: Qwen2.5's yarn x4
        over its original 32k serves 128k). ``llama3`` scaling's checkpoints already give the
        stretched length."""
        scaling = self.rope_scaling or {}
        kind = scaling.get("rope_type", "default")
        factor = float(scaling.get("factor", 1.0))
        if kind == "linear" and factor > 1:
            return int(self.max_position_embeddings * factor)
        if kind == "yarn" and factor > 1:
            original = scaling.get("original_max_position_embeddings")
            return int((original or self.max_position_embeddings) * factor)
        return self.max_position_embeddings

    @property
    def max_context_len(self) -> int:
        """The longest context this model is served at, exactly. Attention here always spans
        the whole context, which is what a sliding window (Mistral v0.1's 4,096 tokens) does
        too while the context fits in it: past it the two differ, so a window smaller than
        ``max_positions`` caps the context (vLLM's ``--disable-sliding-window`` caps
        it so)."""
        if self.sliding_window is not None:
            return min(self.max_positions, self.sliding_window)
        return self.max_positions

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a ``config.json`` dict; unsupported architectures are refused by name."""
        model_type = str(cfg.get("model_type", "")).lower()
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = cfg.get("architectures")
            raise ValueError(
                f"unsupported model_type {model_type!r} (architectures={archs}); "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        # transformers 5 moved rope_theta / rope_scaling into `rope_parameters`.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        scaling = cfg.get("rope_scaling") or None
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default" and "freq_factors" not in scaling:
                scaling = None
            elif scaling["rope_type"] == "yarn" and not scaling.get(
                "original_max_position_embeddings"
            ):
                # transformers' fallback (and llama.cpp's): the trained context length
                original = int(cfg.get("max_position_embeddings", 2048))
                scaling["original_max_position_embeddings"] = original
        eos = cfg.get("eos_token_id")
        eos_ids = (
            tuple(int(e) for e in eos)
            if isinstance(eos, list)
            else ((int(eos),) if eos is not None else ())
        )
        head_dim = cfg.get("head_dim") or hidden // heads
        # Qwen2 configs name a window they do not use unless ``use_sliding_window`` says so
        # (transformers' default there: False); Mistral's is used when set.
        windowed = cfg.get("use_sliding_window", model_type != "qwen2")
        window = cfg.get("sliding_window") if windowed else None
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            sliding_window=int(window) if window else None,
            extra=dict(cfg),
        )
