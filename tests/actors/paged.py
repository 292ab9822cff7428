"""Drive our model directly on a paged cache (no scheduler), for logits-level tests."""

from __future__ import annotations

from pathlib import Path

import torch

from actors.model.attention import AttentionMetadata, TorchAttention
from actors.model.llama import LlamaForCausalLM, LoRAHook
from actors.model.loader import load_model
from kv_transfer.blocks import allocate_kv_caches


class PagedRunner:
    """Keeps a block table per sequence; ``step`` runs one flattened mixed batch."""

    def __init__(
        self,
        model: Path | LlamaForCausalLM,
        block_size: int = 4,
        num_blocks: int = 256,
        dtype: torch.dtype = torch.float32,
        cpu_kernels: bool = True,
    ) -> None:
        """``model``: a checkpoint directory, or an already loaded model (``dtype`` unused).
        ``cpu_kernels=False`` runs the torch ops only (the path CUDA and kernel-less hosts take)."""
        if isinstance(model, LlamaForCausalLM):
            self.model, dtype = model, model.embed_tokens.weight.dtype
        else:
            self.model = load_model(model, dtype, progress=False)
        self.model.pack_for_cpu()  # the worker's CPU path
        cfg = self.model.config
        self.block_size = block_size
        self.attn = TorchAttention(
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, block_size, cpu_kernels
        )
        if not cpu_kernels:
            self.model.fused_ops = None
        self.kv = allocate_kv_caches(
            cfg.num_hidden_layers,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype,
        )
        # Hand out blocks in a scrambled order so tables are not contiguous.
        gen = torch.Generator().manual_seed(0)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[str, list[int]] = {}

    def share_prefix(self, src: str, dst: str, num_tokens: int) -> None:
        """``dst`` reuses ``src``'s first ``num_tokens`` (whole blocks), like a prefix hit."""
        assert num_tokens % self.block_size == 0
        self.tables[dst] = list(self.tables[src][: num_tokens // self.block_size])

    def step(
        self, batch: list[tuple[str, list[int], int]], lora: LoRAHook | None = None
    ) -> list[torch.Tensor]:
        """``batch``: (seq id, token ids, start position). Returns each entry's logits for all
        its tokens. Entries with one token must come first (decodes)."""
        ids: list[int] = []
        pos: list[int] = []
        for seq, tokens, start in batch:
            table = self.tables.setdefault(seq, [])
            end = start + len(tokens)
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            ids.extend(tokens)
            pos.extend(range(start, end))
        meta = AttentionMetadata.build(
            [len(t) for _, t, _ in batch],
            [s + len(t) for _, t, s in batch],
            [self.tables[seq] for seq, _, _ in batch],
            self.block_size,
            torch.device("cpu"),
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(pos), self.kv, meta, self.attn, lora)
        logits = self.model.compute_logits(hidden).float()
        return list(logits.split([len(t) for _, t, _ in batch]))
