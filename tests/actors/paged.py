"""Drive our model directly on a paged cache (no scheduler), for logits-level tests."""

from __future__ import annotations

from pathlib import Path

import torch

from actors.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttention,
    select_backend,
)
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
        device: str = "cpu",
    ) -> None:
        """``model``: a checkpoint directory, or an already loaded model (``dtype`` unused).
        ``cpu_kernels=False`` runs the torch ops only (the element-wise and attention path CUDA
        takes; a host without the kernels, ``TANDEM_CPU_KERNELS=0``, also skips the oneDNN
        packing, which this keeps).
        ``device="cuda"``: the model and cache on the GPU, with the worker's attention backend
        choice there (vllm-flash-attn for fp16/bf16 when installed, else torch)."""
        if isinstance(model, LlamaForCausalLM):
            self.model, dtype = model, model.embed_tokens.weight.dtype
        else:
            self.model = load_model(model, dtype, progress=False)
        self.device = torch.device(device)
        cfg = self.model.config
        self.block_size = block_size
        self.attn: AttentionBackend
        if self.device.type == "cpu":
            self.model.pack_for_cpu()  # the worker's CPU path
            self.attn = TorchAttention(
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                block_size,
                cpu_kernels,
            )
            if not cpu_kernels:
                self.model.fused_ops = None
        else:
            self.model.to(self.device)
            self.attn = select_backend(
                self.device,
                dtype,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                block_size,
            )
        self.kv = allocate_kv_caches(
            cfg.num_hidden_layers,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype,
            self.device,
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
            self.device,
            with_flash=self.attn.needs_flash_metadata,
        )
        dev = self.device
        ids_t, pos_t = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
        hidden = self.model(ids_t, pos_t, self.kv, meta, self.attn, lora)
        logits = self.model.compute_logits(hidden).float().cpu()
        return list(logits.split([len(t) for _, t, _ in batch]))
