"""A random Llama checkpoint of a known shape, written straight from a device: weights for
speed measurements, where the values do not matter (greedy decoding with EOS ignored runs the
same steps on any weights). Far faster than a transformers initialisation on the host for a
large model (Llama-3-8B: 16 GB of bfloat16 written in seconds from a GPU).

    python -m bench.random_checkpoint llama-3-8b /tmp/llama-3-8b --device cuda

Safetensors shards (four layers each) with their index, a ``config.json`` of the shape, and a
byte-level tokenizer (ids 0-255 are the bytes; the engines load one).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    # From the models' published configs.
    "llama-3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    },
    "smollm2-135m": {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
}


def write(
    shape: str, out: Path, device: str = "cpu", dtype: str = "bfloat16", seed: int = 0
) -> Path:
    """Write the checkpoint to ``out`` (a folder); returns it."""
    from safetensors.torch import save_file

    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "torch_dtype": dtype,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **SHAPES[shape],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = torch.Generator(device=device).manual_seed(seed)
    kind = getattr(torch, dtype)

    def rand(*size: int, scale: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        t = torch.randn(*size, generator=gen, device=device, dtype=torch.float32) * scale + mean
        return t.to(kind).cpu()

    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    layers = cfg["num_hidden_layers"]
    num_shards = 1 + -(-layers // 4)
    index: dict[str, str] = {}

    def save(n: int, tensors: dict[str, torch.Tensor]) -> None:
        """Shard ``n`` (from 0), written as soon as it is complete: one in host memory."""
        name = f"model-{n + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file(tensors, out / name, metadata={"format": "pt"})
        index.update(dict.fromkeys(tensors, name))

    first = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h)}
    first["model.norm.weight"] = rand(h, scale=0.1, mean=1.0)
    if not cfg["tie_word_embeddings"]:
        first["lm_head.weight"] = rand(cfg["vocab_size"], h)
    save(0, first)
    shard: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        layer = {
            "self_attn.q_proj.weight": rand(h, h),
            "self_attn.k_proj.weight": rand(kv, h),
            "self_attn.v_proj.weight": rand(kv, h),
            "self_attn.o_proj.weight": rand(h, h),
            "mlp.gate_proj.weight": rand(inter, h),
            "mlp.up_proj.weight": rand(inter, h),
            "mlp.down_proj.weight": rand(h, inter),
            "input_layernorm.weight": rand(h, scale=0.1, mean=1.0),
            "post_attention_layernorm.weight": rand(h, scale=0.1, mean=1.0),
        }
        shard.update({p + k: v for k, v in layer.items()})
        if i % 4 == 3 or i == layers - 1:
            save(1 + i // 4, shard)
            shard = {}
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}, indent=2)
    )
    _byte_tokenizer(out)
    return out


def _byte_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cpu", help="where the random numbers are drawn")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = write(args.shape, args.out, args.device, args.dtype, args.seed)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
