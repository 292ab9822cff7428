"""The model's own speed on the two KV cache layouts: block first (one buffer, a block of every
layer contiguous: what the ``nixl`` transport reads with one descriptor per run of blocks) vs
layer first (a separate contiguous tensor per layer, the layout before it).

One ``LLMEngine`` on the built-in SmolLM2; between runs the worker's cache is swapped for one of
the other layout with the same number of blocks (no request is live then, prefix caching is
off). For each batch size: B prompts of 128 tokens, 128 new tokens, greedy; the layouts are
interleaved, rotating which goes first; decode tokens/s is the median of ``--repeat`` runs.
Both layouts run the same code: weights in ``--dtype`` (``quantization: none``) and decode
steps layer by layer (``TANDEM_FUSED_DECODE=0``: the one-call decode step reads the block-first
layout only, which would compare two code paths instead of two layouts).

    python -m bench.kv_layout                      # bfloat16, batches 1 16 64
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

from bench.model_throughput import PROMPT_LEN, prompts, run_tandem
from kv_transfer.blocks import allocate_kv_caches


def layer_first(worker: Any) -> list[torch.Tensor]:
    shape = (2, worker.num_blocks, *worker.kv_caches[0].shape[2:])
    return [torch.zeros(shape, dtype=worker.dtype) for _ in worker.layers]


def block_first(worker: Any) -> list[torch.Tensor]:
    _, num_blocks, block_size, kv_heads, head_dim = worker.kv_caches[0].shape
    return allocate_kv_caches(
        len(worker.layers), num_blocks, block_size, kv_heads, head_dim, worker.dtype
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="bench/results/kv_layout.json")
    args = ap.parse_args()

    from cluster.engine.llm_engine import LLMEngine

    os.environ["TANDEM_FUSED_DECODE"] = "0"  # (read when the model is built)
    engine = LLMEngine(
        None,
        dtype=getattr(torch, args.dtype),
        quantization="none",
        max_num_seqs=max(args.batches),
        max_num_batched_tokens=max(2048, PROMPT_LEN * max(args.batches)),
        enable_prefix_caching=False,
        progress=False,
    )
    worker = engine.worker
    vocab = worker.config.vocab_size
    layouts = {"block-first": block_first, "layer-first": layer_first}
    caches = {name: make(worker) for name, make in layouts.items()}
    new = args.new_tokens
    run_tandem(engine, prompts(2, vocab, 99), new=8)  # warm-up
    rows = []
    for batch in args.batches:
        runs: dict[str, list[float]] = {name: [] for name in layouts}
        for rep in range(args.repeat):
            batch_prompts = prompts(batch, vocab, rep)
            order = list(layouts) if rep % 2 == 0 else list(layouts)[::-1]
            for name in order:
                worker.kv_caches = caches[name]
                r = run_tandem(engine, batch_prompts, new=new)
                runs[name].append(batch * (new - 1) / max(r["total_s"] - r["prefill_s"], 1e-9))
        row: dict[str, Any] = {"batch": batch}
        for name, rs in runs.items():
            row[name] = {"decode_tok_s": statistics.median(rs), "runs": rs}
        row["ratio"] = row["block-first"]["decode_tok_s"] / row["layer-first"]["decode_tok_s"]
        rows.append(row)
        print(
            f"batch {batch:3}: block-first {row['block-first']['decode_tok_s']:8.1f} tok/s, "
            f"layer-first {row['layer-first']['decode_tok_s']:8.1f} tok/s, "
            f"ratio {row['ratio']:.3f}",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"dtype": args.dtype, "new_tokens": new, "prompt_len": PROMPT_LEN}
    meta["machine"] = platform.platform()
    meta["threads"] = torch.get_num_threads()
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
