"""A Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) running on a paged KV cache.

Matches Hugging Face's ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` numerically: RMSNorm in
float32, rotate-half rotary embeddings, grouped-query attention, SwiGLU MLP, optional tied
embeddings and q/k/v biases. Two fusions save kernel launches without changing the math:
q/k/v are one ``qkv_proj`` matmul and gate/up one ``gate_up_proj``; the loader packs the
checkpoint's separate matrices into them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from actors.model.attention import AttentionBackend, AttentionMetadata, TorchAttention
from actors.model.config import ModelConfig
from actors.model.cpu_kernels import FusedOps, fused_ops
from actors.model.fused_decode import DecodeLayers
from actors.model.linear import Linear, pack_linear
from actors.model.quant import GroupQuant, Method, QuantizedWeight, dense_crossover
from actors.model.rope import RotaryEmbedding


class LoRAHook(Protocol):
    """Adds per-token adapter deltas into a projection's output (see ``actors.lora``)."""

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None: ...


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, ops: FusedOps | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds ``residual`` into ``x`` (when given), normalises the sum; returns (normed, sum).

        Hugging Face normalises in float32, casts back, then scales by the weight; the fused
        op, or our C kernel (``ops``), gives the same bits (checked against transformers)."""
        weight = self._parameters["weight"]  # (not via nn.Module.__getattr__: a hot path)
        assert weight is not None
        if ops is not None:
            return ops.add_rms_norm(x, residual, weight, self.eps)
        if residual is not None:
            x = x + residual
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.eps), x
        normed = F.rms_norm(x.float(), weight.shape, None, self.eps).to(x.dtype)
        return weight * normed, x


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
        # The submodules' forwards, bound once: the decode step runs about 250 of these
        # calls, and ``nn.Module.__call__`` plus ``__getattr__`` cost more than the fused ops.
        self._calls = (
            self.input_layernorm.forward,
            self.qkv_proj.forward,
            self.o_proj.forward,
            self.post_attention_layernorm.forward,
            self.gate_up_proj.forward,
            self.down_proj.forward,
        )

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope_cache: RopeCache,
        attn: AttentionBackend,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRAHook | None,
        ops: FusedOps | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (the MLP's output, the residual stream before it): the caller, or the next
        layer's input norm, adds the two (one fused kernel with ``ops``)."""
        input_norm, qkv_proj, o_proj, post_norm, gate_up_proj, down_proj = self._calls
        h, residual = input_norm(x, residual, ops)
        qkv = qkv_proj(h)
        if lora is not None:
            lora.apply(self.index, "qkv_proj", h, qkv)
        # q and k are rotated in one pass: they sit side by side in the fused output.
        rotated = self.q_size + self.kv_size
        a = None
        if ops is not None and isinstance(attn, TorchAttention):
            # A step of decodes: rotary, cache write and attention in one C call.
            a = attn.decode_fused(qkv, rope_cache.positions, rope_cache.tables, kv_cache, meta)
        if a is None:
            if ops is not None:
                heads = rotated // rope_cache.dim
                ops.rotary_(qkv, rope_cache.positions, *rope_cache.tables, heads)
                q, k = qkv[:, : self.q_size], qkv[:, self.q_size : rotated]
                v = qkv[:, rotated:]  # the attention reads the cache writes' sources strided
            else:
                qk: torch.Tensor = rope_cache.rotate(qkv[:, :rotated])
                q, k = qk[:, : self.q_size], qk[:, self.q_size :]
                v = qkv[:, rotated:].contiguous()
            a = attn.forward(q, k, v, kv_cache, meta)
        o = o_proj(a)
        if lora is not None:
            lora.apply(self.index, "o_proj", a, o)
        h, residual = post_norm(o, residual, ops)
        gate_up = gate_up_proj(h)
        if lora is not None:
            lora.apply(self.index, "gate_up_proj", h, gate_up)
        if ops is not None:
            m = ops.silu_mul(gate_up)
        else:
            n = self.intermediate_size
            m = F.silu(gate_up[:, :n]) * gate_up[:, n:]
        d = down_proj(m)
        if lora is not None:
            lora.apply(self.index, "down_proj", m, d)
        return d, residual


class RopeCache:
    """A step's rotary state, shared by every layer: the positions and the tables (for the
    fused kernel) or the cos / sign-folded sin rows looked up once (for the torch ops)."""

    def __init__(self, rope: RotaryEmbedding, positions: torch.Tensor, fused: bool) -> None:
        self.rope = rope
        self.dim = rope.head_dim
        self.positions = positions
        self.tables = (rope.cos_table, rope.signed_sin_table)
        self.rows = None if fused else rope.lookup(positions)

    def rotate(self, qk: torch.Tensor) -> torch.Tensor:
        assert self.rows is not None
        return self.rope.rotate(qk, *self.rows)


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """The layers pipeline stage ``pp_rank`` of ``pp_size`` holds: contiguous, as even as
    possible, the earlier stages taking one more when the count does not divide."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank {pp_rank} is not in [0, {pp_size})")
    if pp_size > num_layers:
        raise ValueError(f"pp_size {pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


class LlamaForCausalLM(nn.Module):
    """The decoder, or one pipeline stage of it (``layers``: the model layers it holds).

    ``forward`` returns hidden states for every token of the flattened batch: the first stage
    embeds token ids, later stages continue from the previous stage's hidden states, and only
    the last stage applies the final norm. ``compute_logits`` (last stage) projects the rows
    the caller samples from."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype = torch.float32, layers: range | None = None
    ) -> None:
        super().__init__()
        self.config = cfg
        self.layer_range = range(cfg.num_hidden_layers) if layers is None else layers
        if not (0 <= self.layer_range.start < self.layer_range.stop <= cfg.num_hidden_layers):
            raise ValueError(f"layers {layers} are not within the {cfg.num_hidden_layers} layers")
        self.is_first = self.layer_range.start == 0
        self.is_last = self.layer_range.stop == cfg.num_hidden_layers
        # A tied output head reads the embedding, so the last stage keeps it too.
        needs_embedding = self.is_first or (self.is_last and cfg.tie_word_embeddings)
        # Given its weight, the embedding skips its random init: a ``normal_`` (on the meta
        # device the loader builds on) imports torch._dynamo, 1-1.5 s of every worker's start.
        self.embed_tokens: nn.Embedding | None = (
            nn.Embedding(
                cfg.vocab_size,
                cfg.hidden_size,
                _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype),
            )
            if needs_embedding
            else None
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in self.layer_range)
        self.norm: RMSNorm | None = (
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if self.is_last else None
        )
        self.lm_head: nn.Linear | None = (
            nn.Linear(cfg.hidden_size, cfg.vocab_size, False)
            if self.is_last and not cfg.tie_word_embeddings
            else None
        )
        self._packed_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Called between layers (the worker's core sharing follows other workers' steps).
        self.between_layers: Callable[[], None] | None = None
        self._quant_logits: QuantizedWeight | None = None
        self._dense_head: torch.Tensor | None = None  # a quantized head's dense copy
        self._logits_dense_min_rows = 0
        self.quantization: dict[str, str] = {}  # projection name -> method (for logs, info)
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_positions, cfg.rope_theta, cfg.rope_scaling, dtype
        )
        # Our C kernels for the element-wise steps (CPU float32/bfloat16; None: torch ops).
        self.fused_ops: FusedOps | None = fused_ops()
        # Every layer in one C call for decode steps (``fused_decode``): built on first use,
        # built again when a projection was re-quantized since (``Linear.quantize``; other
        # changes to the layers' weights must set None). False where the layers do not
        # qualify, or set by hand to run layer by layer: not looked at again.
        self.decode_layers: DecodeLayers | Literal[False] | None = None

    @property
    def output_embedding(self) -> torch.Tensor:
        """The output head's weight (the last stage's)."""
        if self.lm_head is not None:
            return self.lm_head.weight
        if self.embed_tokens is None or not self.is_last:
            raise RuntimeError(f"stage {self.layer_range} has no output head")
        return self.embed_tokens.weight

    @property
    def dense_head(self) -> torch.Tensor:
        """The output head's dense weight: the quantized head's own copy, else the head."""
        return self._dense_head if self._dense_head is not None else self.output_embedding

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]; ignored by a stage that is not the first
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],  # per held layer [2, num_blocks, block_size, KV, D]
        meta: AttentionMetadata,
        attn: AttentionBackend,
        lora: LoRAHook | None = None,
        hidden_states: torch.Tensor | None = None,  # [T, hidden]: the previous stage's output
    ) -> torch.Tensor:
        if self.is_first:
            assert self.embed_tokens is not None
            x = self.embed_tokens(input_ids)
        elif hidden_states is None:
            raise ValueError(f"stage {self.layer_range} needs the previous stage's hidden states")
        else:
            x = hidden_states
        ops = self.fused_ops if x.is_cpu and x.dtype in FusedOps.dtypes else None
        if ops is not None and positions.dtype != torch.int64:
            positions = positions.long()
        rope_cache = RopeCache(self.rope, positions, fused=ops is not None)
        hook = self.between_layers
        residual: torch.Tensor | None = None
        done = None
        if ops is not None and lora is None and isinstance(attn, TorchAttention):
            fused = self.decode_layers
            if fused is None or (
                isinstance(fused, DecodeLayers) and fused.generation != Linear.weights_generation
            ):
                fused = self.decode_layers = DecodeLayers.build(self) or False
            if isinstance(fused, DecodeLayers):
                tables = rope_cache.tables
                done = fused.run(x, kv_caches, positions, tables, attn, meta, hook)
        if done is not None:
            x, residual = done
        else:
            for layer, cache in zip(self.layers, kv_caches, strict=True):
                if hook is not None:
                    hook()
                # ``forward`` itself, not ``__call__``: no hooks are used here, and the
                # dispatch costs about 3 us a layer.
                x, residual = layer.forward(x, residual, rope_cache, attn, cache, meta, lora, ops)
        if self.norm is None:
            return x if residual is None else x + residual
        out, _ = self.norm(x, residual, ops)
        return out

    def projections(self) -> Iterator[tuple[str, Linear]]:
        """Every decoder projection with its name (``layers.{i}.qkv_proj`` ...)."""
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                module = getattr(layer, name)
                assert isinstance(module, Linear)
                yield f"layers.{layer.index}.{name}", module

    @torch.no_grad()
    def quantize_output_head(
        self, method: Method, source: GroupQuant | None, dense_min_rows: int | None
    ) -> None:
        """Hold the output head quantized as well (the last stage). A tied head's embedding
        stays dense: the first stage looks rows up in it. ``dense_min_rows`` None: where the
        kernel stops winning (``dense_crossover``)."""
        weight = self.output_embedding
        dtype = weight.dtype
        if source is not None:
            self._quant_logits = QuantizedWeight.from_group_quant(source, method, dtype)
        else:
            self._quant_logits = QuantizedWeight.from_float(weight, method, dtype)
        if dense_min_rows is None:
            dense_min_rows = dense_crossover(self._quant_logits)
        self._logits_dense_min_rows = dense_min_rows
        self.quantization["lm_head"] = method
        self._packed_logits = None
        dense = self._quant_logits.take_dense()
        if dense_min_rows > 0:
            # As for the projections: large batches multiply the quantized head's weights,
            # in place of the file's (a copy of its own when the head is tied: the embedding
            # lookup keeps the file's).
            if self.lm_head is not None:
                self.lm_head.weight = nn.Parameter(dense.to(dtype), requires_grad=False)
            else:
                self._dense_head = dense.to(dtype)
        elif self.lm_head is not None:
            self.lm_head.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)

    def weight_bytes(self) -> int:
        """Bytes of weights held: parameters, the packed copies, the quantized forms."""
        total = 0
        for module in self.modules():
            if isinstance(module, Linear):
                total += module.weight_bytes()
            elif module is not self:
                total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        if self._dense_head is not None:
            total += self._dense_head.numel() * self._dense_head.element_size()
        if self._packed_logits is not None:
            total += self.dense_head.numel() * self.dense_head.element_size()
        if self._quant_logits is not None:
            total += self._quant_logits.nbytes
        return total

    @torch.no_grad()
    def pack_for_cpu(self, batch_hint: int = 64) -> bool:
        """Pre-pack every projection and the output head for the CPU GEMM libraries. Call
        after loading the weights (and again if they change). True when packing applied."""
        ok = True
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            for module in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
                ok = module.pack_for_cpu(batch_hint) and ok
        if not self.is_last:
            return ok
        if self._quant_logits is not None and self._logits_dense_min_rows <= 0:
            return ok  # the head runs quantized at every batch size
        self._packed_logits = pack_linear(self.dense_head, None, batch_hint, min_rows=1)
        return ok and self._packed_logits is not None

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        q = self._quant_logits
        rows = hidden.shape[0]
        if q is not None and (
            self._logits_dense_min_rows <= 0 or rows < self._logits_dense_min_rows
        ):
            return q.matmul(hidden.contiguous())
        if self._packed_logits is not None:
            return self._packed_logits(hidden.contiguous())
        logits: torch.Tensor = F.linear(hidden, self.dense_head)
        return logits
