"""A Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) running on a paged KV cache.

Matches Hugging Face's ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` numerically: RMSNorm in
float32, rotate-half rotary embeddings, grouped-query attention, SwiGLU MLP, optional tied
embeddings and q/k/v biases. Two fusions save kernel launches without changing the math:
q/k/v are one ``qkv_proj`` matmul and gate/up one ``gate_up_proj``; the loader packs the
checkpoint's separate matrices into them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from actors.model.attention import AttentionBackend, AttentionMetadata
from actors.model.config import ModelConfig
from actors.model.rope import RotaryEmbedding


class Linear(nn.Linear):
    """``nn.Linear`` that can switch to a pre-packed CPU GEMM (see ``pack_for_cpu``).

    oneDNN re-lays the weight once into its blocked format, which makes the small-M products
    of decoding about 1.2-2x faster than ``F.linear``. The packed copy sits next to the
    original weight, which stays the source of truth (loading, LoRA, the tests' references)."""

    _packed: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return self._packed(x)
        return F.linear(x, self.weight, self.bias)

    def pack_for_cpu(self, batch_hint: int = 64) -> bool:
        """Pack the weight for this CPU's GEMM library; False when not applicable."""
        packed = pack_linear(self.weight, self.bias, batch_hint)
        self._packed = packed
        return packed is not None


def pack_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    batch_hint: int = 64,
    min_rows: int | None = None,
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """A ``x @ weight.T + bias`` on a oneDNN-packed weight (CPU float32 / bfloat16), or None.

    The batch size is only a hint: any number of rows works. A single float32 row goes to
    ``F.linear`` instead, which is faster there (a GEMV), unless ``min_rows`` says otherwise
    (the wide output head is faster packed even for one row); bfloat16 is faster packed at
    every size. MKL's own packed GEMM (``torch.ops.mkl``) is not used: it silently falls back to
    ``mm`` unless the row count equals the hint."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return None
    w = weight.detach()
    b = None if bias is None else bias.detach()
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
    except (RuntimeError, AttributeError):  # an op missing from this torch build
        return None
    if min_rows is None:
        min_rows = 2 if w.dtype == torch.float32 else 1

    def onednn(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < min_rows:
            return F.linear(x, w, b)
        return torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")

    return onednn


class LoRAHook(Protocol):
    """Adds per-token adapter deltas into a projection's output (see ``actors.lora``)."""

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None: ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Hugging Face normalises in float32, casts back, then scales by the weight; the fused
        # op gives the same bits (checked against transformers in the tests).
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = Linear(
            cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.intermediate_size = cfg.intermediate_size

    def forward(
        self,
        x: torch.Tensor,
        rope_cache: tuple[torch.Tensor, torch.Tensor],
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
        # q and k are rotated in one pass: they sit side by side in the fused output.
        qk: torch.Tensor = rope.rotate(qkv[:, : self.q_size + self.kv_size], *rope_cache)
        q, k = qk[:, : self.q_size], qk[:, self.q_size :]
        v = qkv[:, self.q_size + self.kv_size :]
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
        self._packed_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
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
        rope_cache = self.rope.lookup(positions)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope_cache, self.rope, attn, cache, meta, lora)
        out: torch.Tensor = self.norm(x)
        return out

    @torch.no_grad()
    def pack_for_cpu(self, batch_hint: int = 64) -> bool:
        """Pre-pack every projection and the output head for the CPU GEMM libraries. Call
        after loading the weights (and again if they change). True when packing applied."""
        ok = True
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            for module in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                ok = module.pack_for_cpu(batch_hint) and ok
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self._packed_logits = pack_linear(weight, None, batch_hint, min_rows=1)
        return ok and self._packed_logits is not None

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._packed_logits is not None:
            return self._packed_logits(hidden.contiguous())
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits: torch.Tensor = F.linear(hidden, weight)
        return logits
