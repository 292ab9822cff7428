"""Captured decode steps on CUDA: one CUDA graph per (batch bucket, context-width bucket).

A decode step of a small model on a GPU is bound by its launches, not its arithmetic: each
layer dispatches about ten kernels from Python, and the GPU waits for the CPU. A CUDA graph
replays the whole forward with one launch. Graphs need fixed shapes and fixed addresses, so a
step runs in static input buffers padded to a bucket:

- **batch buckets** as vLLM's (1, 2, 4, then every multiple of 8 up to ``max_batch``);
- **width buckets**: the number of blocks in the longest row's table, rounded up to a power
  of two (at least 4) and capped at the model's context. The torch attention backend gathers
  each row's blocks up to that width, so a graph for the full context would gather a long
  context for every short request.

Graphs are captured on first use of a bucket (a capture costs a warm-up forward plus the
capture itself, a few ms for a small model; every graph shares one memory pool). A capture that
fails (e.g. out of memory) leaves that bucket eager. Padding rows write their K/V to a scratch
block that no request owns (the worker allocates one block more than the scheduler knows of),
read only that block, and their outputs are dropped. A graph's attention gathers its rows'
blocks: buckets that would gather more than ``max_gather_bytes`` run eagerly (the graphs' pool
keeps its peak for good; the worker counts it when it sizes the cache).

Only whole-decode steps of a first pipeline stage (token ids in, no hidden states) without
LoRA are captured, with the torch attention backend; every other step runs eagerly, as does
everything with ``enforce_eager`` (vLLM's name for turning graphs off).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from actors.model.attention import AttentionMetadata, TorchAttention
from actors.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

MIN_WIDTH = 4  # blocks: the smallest width bucket
MAX_GATHER_BYTES = 1 << 30  # the K/V a graph's attention may gather per layer


def gather_bytes(
    batch: int, width: int, block_size: int, heads: int, head_dim: int, elem: int
) -> int:
    """What the torch attention path gathers for a decode step of ``batch`` rows of ``width``
    blocks: K and V, counted with every query head (an upper bound: GQA may not expand)."""
    return 2 * batch * width * block_size * heads * head_dim * elem


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: 1, 2, 4, then multiples of 8, up to the first that holds
    ``max_batch`` rows."""
    sizes = [1]
    while sizes[-1] < max_batch:
        sizes.append(sizes[-1] * 2 if sizes[-1] < 8 else sizes[-1] + 8)
    return sizes


def width_bucket(blocks: int, max_width: int) -> int:
    """The width (blocks per row) of the graph serving rows of up to ``blocks`` blocks."""
    width = MIN_WIDTH
    while width < blocks:
        width *= 2
    return min(width, max_width)


class DecodeGraphs:
    """The captured decode steps of one worker's model (see the module's docstring)."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        attn: TorchAttention,
        block_size: int,
        scratch_block: int,
        max_batch: int,
        max_width: int,
        max_gather_bytes: int = MAX_GATHER_BYTES,
        capture: bool = True,
    ) -> None:
        """``capture=False`` runs the same padded steps eagerly, without graphs (any device:
        the CPU tests check the buffers' filling that way)."""
        if not model.is_first:
            raise ValueError("decode graphs take token ids: a first pipeline stage only")
        device = kv_caches[0].device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA cache, not {device}")
        self.capture = capture
        self.model, self.kv_caches, self.attn = model, kv_caches, attn
        self.block_size, self.scratch = block_size, scratch_block
        self.buckets = batch_buckets(max_batch)
        self.max_batch, self.max_width = self.buckets[-1], max(1, max_width)
        self.device = device
        n, w = self.max_batch, self.max_width
        # The static inputs every graph reads (views of their first rows).
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_blocks = torch.full((n,), scratch_block, dtype=torch.long, device=device)
        self.slot_offsets = torch.zeros(n, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.long, device=device)
        # Flat: a graph of width ``w`` reads the first ``b * w`` ids as a [b, w] table, so its
        # table is contiguous whatever the bucket.
        self.tables = torch.full((n * w,), scratch_block, dtype=torch.long, device=device)
        self.key_pos = torch.arange(w * block_size, device=device)
        cache = kv_caches[0]
        self.row_bytes = gather_bytes(
            1, 1, block_size, attn.num_heads, attn.head_dim, cache.element_size()
        )
        self.max_gather_bytes = max_gather_bytes
        # A bucket whose capture failed maps to None (it runs eagerly).
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}
        if capture:
            self.pool = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        self.replays = 0

    def bucket_for(self, num_rows: int, max_blocks: int) -> tuple[int, int] | None:
        """The (batch, width) bucket for a decode step, or None when it does not fit one."""
        if num_rows > self.max_batch or max_blocks > self.max_width:
            return None
        batch = next(b for b in self.buckets if b >= num_rows)
        width = width_bucket(max_blocks, self.max_width)
        if batch * width * self.row_bytes > self.max_gather_bytes:
            return None
        return batch, width

    def run(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
    ) -> torch.Tensor | None:
        """Hidden states ``[len(input_ids), hidden]`` of a step of single-token decodes (one
        row per request: its token, its position and its block table), or None when no bucket
        fits it (the caller runs it eagerly)."""
        n = len(input_ids)
        bs = self.block_size
        needed = [pos // bs + 1 for pos in positions]
        key = self.bucket_for(n, max(needed, default=1))
        if key is None or n == 0:
            return None
        batch, width = key
        if not self.capture:
            self._fill(input_ids, positions, block_tables, needed, batch, width)
            return self._forward(batch, width)[:n]
        if key not in self.graphs:
            self.graphs[key] = self._capture(batch, width)
        graph_out = self.graphs[key]
        if graph_out is None:
            return None  # its capture failed
        graph, out = graph_out
        self._fill(input_ids, positions, block_tables, needed, batch, width)
        graph.replay()
        self.replays += 1
        return out[:n].clone()  # the next replay overwrites ``out``

    def _fill(
        self,
        input_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        needed: list[int],
        batch: int,
        width: int,
    ) -> None:
        """Copy a step's inputs into the static buffers; padding rows point at the scratch
        block (one key, its own)."""
        n, bs, scratch = len(input_ids), self.block_size, self.scratch
        pad = batch - n
        positions = list(positions)
        slots_b = [table[pos // bs] for table, pos in zip(block_tables, positions, strict=True)]
        rows: list[int] = []
        for table, k in zip(block_tables, needed, strict=True):
            rows.extend(table[:k])
            rows.extend([scratch] * (width - k))
        rows.extend([scratch] * (width * pad))
        host = torch.tensor(
            [
                list(input_ids) + [0] * pad,
                positions + [0] * pad,
                slots_b + [scratch] * pad,
                [pos % bs for pos in positions] + [0] * pad,
                [pos + 1 for pos in positions] + [1] * pad,
            ],
            dtype=torch.long,
        )
        staged = host.to(self.device, non_blocking=True)
        self.input_ids[:batch].copy_(staged[0])
        self.positions[:batch].copy_(staged[1])
        self.slot_blocks[:batch].copy_(staged[2])
        self.slot_offsets[:batch].copy_(staged[3])
        self.seq_lens[:batch].copy_(staged[4])
        self.tables[: batch * width].copy_(torch.tensor(rows, dtype=torch.long), non_blocking=True)

    def _forward(self, batch: int, width: int) -> torch.Tensor:
        """The step a graph holds: the attention metadata derived on the GPU from the static
        buffers, then the model."""
        seq_lens = self.seq_lens[:batch]
        keys = width * self.block_size
        mask = (self.key_pos[:keys][None, :] < seq_lens[:, None]).view(batch, 1, 1, keys)
        slots = self.slot_blocks[:batch] * self.block_size + self.slot_offsets[:batch]
        meta = AttentionMetadata(
            slot_mapping=slots,
            slot_blocks=self.slot_blocks[:batch],
            slot_offsets=self.slot_offsets[:batch],
            num_decodes=batch,
            decode_block_table=self.tables[: batch * width].view(batch, width),
            decode_mask=mask,
            decode_seq_lens=seq_lens,
        )
        out: torch.Tensor = self.model(
            self.input_ids[:batch],
            self.positions[:batch],
            self.kv_caches,
            meta,
            self.attn,
        )
        return out

    def _capture(self, batch: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """Capture the (batch, width) step, after a warm-up run on a side stream (lazy
        initialisations, e.g. cuBLAS's workspace, must not happen inside a capture). The
        buffers point at the scratch block meanwhile: the runs write only there. None when the
        capture fails (the bucket then runs eagerly)."""
        with torch.cuda.device(self.device):
            self._reset()
            stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            try:
                with torch.cuda.stream(stream):
                    self._forward(batch, width)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                # thread_local: a KV transport's thread calling CUDA meanwhile (a copy to or
                # from the host) neither breaks the capture nor is captured: the capture
                # stream is its own, and the check covers this thread only.
                with torch.cuda.graph(
                    graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
                ):
                    out = self._forward(batch, width)
            except Exception:
                logger.exception(
                    "capturing the decode step for batch %d, width %d failed; it runs eagerly",
                    batch,
                    width,
                )
                return None
        logger.info("captured the decode step for batch %d, width %d blocks", batch, width)
        return graph, out

    def _reset(self) -> None:
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_blocks.fill_(self.scratch)
        self.slot_offsets.zero_()
        self.seq_lens.fill_(1)
        self.tables.fill_(self.scratch)
