"""Load GGUF checkpoints: metadata as an HF-style config and dequantized tensors (the tokenizer
is rebuilt from the metadata in ``gguf_tokenizer``).

The container is read by our own parser (``gguf_file``); tensors are dequantized with
vectorized numpy kernels, bit-exact against ``gguf.quants`` (~0.4-1 s for the whole file
instead of ~3.3 s).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from gguf import GGMLQuantizationType

from actors.model.gguf_dequant import dequantize, group_quant
from actors.model.gguf_file import GGUFFile, Source, TensorInfo, _as_file, open_gguf
from actors.model.quant import GroupQuant

__all__ = [
    "GGUFFile",
    "TensorInfo",
    "count_gguf_tensors",
    "dequantize",
    "iter_gguf_group_quants",
    "iter_gguf_tensors",
    "open_gguf",
    "read_gguf_config",
]

logger = logging.getLogger(__name__)

QT = GGMLQuantizationType


# ---------------------------------------------------------------------------------------------
# Config and tensor names
# ---------------------------------------------------------------------------------------------

# GGUF architecture -> (HF model_type, HF class, Q/K rows permuted by llama.cpp's converter).
_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "mistral": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors with no HF counterpart: rope_freqs.weight is read into the config (freq_factors).
_SKIPPED = {"rope_freqs.weight"}


def _arch_info(f: GGUFFile) -> tuple[str, str, bool]:
    if f.arch not in _ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {f.arch!r} (supported: {', '.join(sorted(_ARCHS))})"
        )
    return _ARCHS[f.arch]


def _hf_name(gguf_name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None when it has no counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _meta(f: GGUFFile, key: str, default: Any = None, *, required: bool = False) -> Any:
    full = f"{f.arch}.{key}"
    if full not in f.metadata:
        if required:
            raise ValueError(f"{f.path}: GGUF metadata key {full!r} is missing")
        return default
    value = f.metadata[full]
    return value[0] if isinstance(value, list) else value  # per-layer arrays: take layer 0


def _weight_dtype(f: GGUFFile) -> str:
    types = {t.ggml_type for t in f.tensors.values() if len(t.shape) == 2}
    if types <= {QT.F32}:
        return "float32"
    for ggml_type, name in ((QT.F16, "float16"), (QT.BF16, "bfloat16")):
        if types <= {ggml_type, QT.F32}:
            return name
    return "quantized"


def _rope_scaling_with_freqs(f: GGUFFile) -> dict[str, Any] | None:
    """The file's rope scaling, and its per-frequency divisors (``rope_freqs.weight``: how
    llama.cpp's converter stores Llama 3.1+'s llama3-style scaling) as ``freq_factors``."""
    scaling = _rope_scaling(f)
    info = f.tensors.get("rope_freqs.weight")
    if info is None:
        return scaling
    factors = dequantize(f.raw("rope_freqs.weight"), info.ggml_type, info.shape).flatten()
    return {**(scaling or {"rope_type": "default"}), "freq_factors": factors.tolist()}


def _rope_scaling(f: GGUFFile) -> dict[str, Any] | None:
    """The file's rope scaling, read as llama.cpp reads it: a factor without
    ``rope.scaling.type`` is linear, and files converted before the ``rope.scaling.*`` keys
    hold a linear factor as ``rope.scale_linear``; a factor of 0 means none."""
    kind = _meta(f, "rope.scaling.type", "linear")
    factor = _meta(f, "rope.scaling.factor")
    if factor is None:
        factor = _meta(f, "rope.scale_linear")
    if kind == "none" or not factor:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = _meta(f, "rope.scaling.original_context_length")
    if original is None and kind == "yarn":  # (llama.cpp's fallback, and transformers')
        original = _meta(f, "context_length", 2048)
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _eos_ids(f: GGUFFile) -> int | list[int] | None:
    """``tokenizer.ggml.eos_token_id``, and with it the end-of-turn and end-of-message ids
    llama.cpp also ends generation at (``eot_token_id`` / ``eom_token_id``: gguf-py's
    converter moves the chat's end token there when tokenizer.json appends another EOS)."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = f.metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    if len(ids) > 1:
        return ids
    return ids[0] if ids else None


def read_gguf_config(src: Source) -> dict[str, Any]:
    """An HF ``config.json``-style dict for the model in ``src``.

    Raises ValueError for an unsupported architecture or a missing required metadata key.
    ``torch_dtype`` is "float32"/"float16"/"bfloat16" when every 2-D weight has that type
    (F32 allowed alongside), else "quantized".
    """
    f = _as_file(src)
    model_type, hf_class, _ = _arch_info(f)
    hidden = int(_meta(f, "embedding_length", required=True))
    heads = int(_meta(f, "attention.head_count", required=True))
    embd = f.tensors.get("token_embd.weight")
    vocab = embd.shape[0] if embd else _meta(f, "vocab_size")
    if vocab is None:
        vocab = len(f.metadata.get("tokenizer.ggml.tokens", []))
    return {
        "model_type": model_type,
        "architectures": [hf_class],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_meta(f, "feed_forward_length", required=True)),
        "num_hidden_layers": int(_meta(f, "block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(f, "attention.head_count_kv", heads)),
        "head_dim": int(_meta(f, "attention.key_length", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": float(_meta(f, "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_meta(f, "rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling_with_freqs(f),
        "max_position_embeddings": int(_meta(f, "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": model_type == "qwen2" or "blk.0.attn_q.bias" in f.tensors,
        "bos_token_id": f.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(f),
        "torch_dtype": _weight_dtype(f),
    }


def _unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary -> HF rotate-half).

    Per head, HF rows are [x_0 .. x_{h/2-1} | y_0 .. y_{h/2-1}] (the two rotary halves); the
    converter stores them interleaved [x_0, y_0, x_1, y_1, ...]. Viewing each head's rows as
    (h/2, 2) and transposing to (2, h/2) restores the halves. Works for weights and biases.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def count_gguf_tensors(src: Source) -> int:
    """How many tensors :func:`iter_gguf_tensors` will yield (for a progress bar)."""
    f = _as_file(src)
    return sum(1 for name in f.tensors if _hf_name(name) is not None)


def iter_gguf_tensors(src: Source) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` pairs in file order, dequantized one at a time.

    Names follow HF Llama/Qwen2 (``model.layers.{i}.self_attn.q_proj.weight`` ...). For
    llama-arch files the Q/K projections are un-permuted back to HF's rotate-half layout.
    ``rope_freqs.weight`` is skipped (the config has it); any other unknown tensor raises
    ValueError.
    """
    f = _as_file(src)
    permuted_heads = _permuted_heads(f)
    for gguf_name, info in f.tensors.items():
        hf_name = _hf_name(gguf_name)
        if hf_name is None:
            if gguf_name in _SKIPPED:
                continue
            raise ValueError(f"{f.path}: unexpected tensor {gguf_name!r} for arch {f.arch!r}")
        tensor = dequantize(f.raw(gguf_name), info.ggml_type, info.shape)
        heads = permuted_heads(hf_name)
        if heads:
            tensor = _unpermute_rows(tensor, heads)
        yield hf_name, tensor


def _permuted_heads(f: GGUFFile) -> Callable[[str], int]:
    """For a tensor's HF name: the head count its rows are permuted by (llama-arch Q and K
    projections), else 0."""
    _, _, permuted = _arch_info(f)
    heads = int(_meta(f, "attention.head_count", required=True))
    kv_heads = int(_meta(f, "attention.head_count_kv", heads))

    def of(hf_name: str) -> int:
        if permuted and ".self_attn.q_proj." in hf_name:
            return heads
        if permuted and ".self_attn.k_proj." in hf_name:
            return kv_heads
        return 0

    return of


def iter_gguf_group_quants(src: Source) -> Iterator[tuple[str, GroupQuant]]:
    """Yield ``(hf_name, GroupQuant)`` for each 2-D weight stored as Q4_0, Q4_1 or Q8_0: its
    codes and block scales as the file holds them, Q/K rows un-permuted as in
    :func:`iter_gguf_tensors` (rows move with their scales)."""
    f = _as_file(src)
    permuted_heads = _permuted_heads(f)
    for gguf_name, info in f.tensors.items():
        hf_name = _hf_name(gguf_name)
        if hf_name is None:
            continue
        gq = group_quant(f.raw(gguf_name), info.ggml_type, info.shape)
        if gq is None:
            continue
        n = permuted_heads(hf_name)
        if n:
            gq = GroupQuant(
                _unpermute_rows(gq.codes, n),
                _unpermute_rows(gq.scale, n),
                None if gq.offset is None else _unpermute_rows(gq.offset, n),
                gq.group_size,
                gq.bits,
            )
        yield hf_name, gq
