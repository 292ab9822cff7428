"""``WorkerMemory``: how much a ``ModelWorker`` needs besides its KV cache, and so how many KV
blocks fit (a mixin of ``actors.worker.ModelWorker``)."""

from __future__ import annotations

import torch

from actors.model.llama import LlamaForCausalLM

DEFAULT_KV_CACHE_BYTES = 1 << 30  # CPU default (vLLM's CPU backend uses a fixed space too)


class WorkerMemory:
    """The KV cache's sizing, from the model's shapes (a mixin of ``ModelWorker``)."""

    # What of the worker this uses (annotations only).
    dtype: torch.dtype
    device: torch.device
    layers: range
    block_size: int
    max_num_batched_tokens: int | None
    max_num_seqs: int
    enforce_eager: bool

    @property
    def _model(self) -> LlamaForCausalLM:
        raise NotImplementedError

    def bytes_per_block(self) -> int:
        cfg = self._model.config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.layers) * self.block_size * cfg.kv_size * elem

    def weight_bytes(self) -> int:
        """Weights held: parameters, the CPU GEMMs' pre-packed copies, quantized forms."""
        return self._model.weight_bytes()

    def activation_bytes(self) -> int:
        """Peak working memory of one step at ``max_num_batched_tokens`` (an estimate from the
        shapes: hidden states, the fused projections' outputs, the logits and the sampler).
        None: a whole prompt of the model's longest context (chunked prefill off, the
        cluster's max_model_len still unknown: it is at most that)."""
        cfg = self._model.config
        elem = torch.empty((), dtype=self.dtype).element_size()
        tokens = self.max_num_batched_tokens or max(cfg.max_context_len, 2048)
        per_token = (
            4 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size + 3 * cfg.intermediate_size
        ) * elem
        logits = min(self.max_num_seqs, tokens) * cfg.vocab_size * 4 * 4  # fp32, ~4 copies
        return tokens * per_token + logits + self._graph_bytes()

    def _graph_bytes(self) -> int:
        """What the CUDA graphs' memory pool may keep: the largest decode step's K/V gather
        (``actors.model.cuda_graphs``), at most ``MAX_GATHER_BYTES``."""
        if self.device.type != "cuda" or self.enforce_eager:
            return 0
        from actors.model.cuda_graphs import MAX_GATHER_BYTES, batch_buckets, gather_bytes

        cfg = self._model.config
        elem = torch.empty((), dtype=self.dtype).element_size()
        width = -(-cfg.max_context_len // self.block_size)
        batch = batch_buckets(min(self.max_num_seqs, 512))[-1]
        full = gather_bytes(
            batch, width, self.block_size, cfg.num_attention_heads, cfg.head_dim, elem
        )
        return min(full, MAX_GATHER_BYTES)

    def profile_num_blocks(self, memory_budget_bytes: int) -> int:
        """How many KV blocks fit once weights and the peak activations are paid for. On CUDA
        the peak is measured; elsewhere it is estimated from the shapes."""
        overhead = self.weight_bytes() + self.activation_bytes()
        if self.device.type == "cuda":
            overhead = torch.cuda.memory_allocated(self.device) + self.activation_bytes()
        free = memory_budget_bytes - overhead
        num_blocks = free // self.bytes_per_block()
        if num_blocks < 1:
            raise ValueError(
                f"memory budget {memory_budget_bytes / 2**20:.0f} MiB leaves no room for the KV "
                f"cache: weights + activations need {overhead / 2**20:.0f} MiB"
            )
        return int(num_blocks)

    def size_kv_cache(
        self,
        num_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        memory_budget_bytes: int | None = None,
    ) -> int:
        """How many KV blocks to allocate: ``num_blocks`` as given; else what fits in
        ``memory_budget_bytes`` after weights and activations (profiled); else
        ``kv_cache_memory_bytes`` of cache (``DEFAULT_KV_CACHE_BYTES`` by default)."""
        if num_blocks is not None:
            return num_blocks
        if memory_budget_bytes is not None:
            return self.profile_num_blocks(memory_budget_bytes)
        kv_bytes = kv_cache_memory_bytes or DEFAULT_KV_CACHE_BYTES
        return max(1, kv_bytes // self.bytes_per_block())
