"""A Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) running on a paged KV cache.

Matches Hugging Face's ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` numerically: RMSNorm in
float32, rotate-half rotary embeddings, grouped-query attention, SwiGLU MLP, optional tied
embeddings and q/k/v biases. Two fusions save kernel launches without changing the math:
q/k/v are one ``qkv_proj`` matmul and gate/up one ``gate_up_proj``; the loader packs the
checkpoint's separate matrices into them.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from actors.model.attention import AttentionBackend, AttentionMetadata
from actors.model.config import ModelConfig
from actors.model.rope import RotaryEmbedding


class LoRAHook(Protocol):
    """Adds per-token adapter deltas into a projection's output (see ``actors.lora``)."""

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None: ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.intermediate_size = cfg.intermediate_size

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        attn: AttentionBackend,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRAHook | None,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        qkv = self.qkv_proj(h)
        if lora is not None:
            lora.apply(self.index, "qkv_proj", h, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = rope(positions, q, k)
        a = attn.forward(q, k, v.contiguous(), kv_cache, meta)
        o = self.o_proj(a)
        if lora is not None:
            lora.apply(self.index, "o_proj", a, o)
        x = x + o
        h = self.post_attention_layernorm(x)
        gate_up = self.gate_up_proj(h)
        if lora is not None:
            lora.apply(self.index, "gate_up_proj", h, gate_up)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        m = F.silu(gate) * up
        d = self.down_proj(m)
        if lora is not None:
            lora.apply(self.index, "down_proj", m, d)
        return x + d


class LlamaForCausalLM(nn.Module):
    """The decoder. ``forward`` returns hidden states for every token of the flattened batch;
    ``compute_logits`` projects the rows the caller samples from."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head: nn.Linear | None = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, False)
        )
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, dtype
        )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, KV, D]
        meta: AttentionMetadata,
        attn: AttentionBackend,
        lora: LoRAHook | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, self.rope, attn, cache, meta, lora)
        out: torch.Tensor = self.norm(x)
        return out

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits: torch.Tensor = F.linear(hidden, weight)
        return logits
