"""Decode throughput: Tandem's engine vs Hugging Face transformers on the same weights.

Same weights (the built-in SmolLM2-135M-Instruct, dequantized once and handed to both), same
machine, one run. For each dtype and batch size: B prompts of 128 tokens, 128 new tokens,
greedy, EOS ignored. Three contenders:

- ``tandem``: ``LLMEngine`` (scheduler + paged KV cache + sampler), all requests added at once,
  weights dense (``quantization="none"``);
- ``tandem-<q>``: the same engine holding its projections quantized (``--quantizations``, e.g.
  ``auto``: the GGUF file's Q4_1 as int4, its Q8_0 head as int8);
- ``tandem-eager`` (CUDA only): the dense engine with ``enforce_eager``, i.e. without its
  captured decode steps (``actors.model.cuda_graphs``);
- ``hf-generate``: ``model.generate(..., do_sample=False)``;
- ``hf-loop``: a hand-written greedy loop over ``model(...)`` with its ``DynamicCache``.

Decode tokens/s = B × (new − 1) / (total − prefill): the prefill (first token) is timed
separately for each contender and left out. Prints a table, writes JSON.

    python -m bench.model_throughput --batches 1 16 64 --dtypes float32 bfloat16

Per projection shape and per operator class, see ``bench/model_kernels.py``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

PROMPT_LEN = 128
BLOCK_SIZE = 16


def hf_model_from(model: Any, dtype: torch.dtype, device: str = "cpu") -> Any:
    """A transformers LlamaForCausalLM holding exactly our model's weights (unfused), made on
    ``device`` in ``dtype`` (a large model's float32 initialisation on the host would take
    minutes)."""
    import transformers

    cfg = model.config
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = transformers.LlamaForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(default)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed_tokens.weight}
    sd["model.norm.weight"] = model.norm.weight
    if model.lm_head is not None:
        sd["lm_head.weight"] = model.lm_head.weight
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        w = layer.qkv_proj.weight
        sd[p + "self_attn.q_proj.weight"] = w[:q]
        sd[p + "self_attn.k_proj.weight"] = w[q : q + kv]
        sd[p + "self_attn.v_proj.weight"] = w[q + kv :]
        sd[p + "self_attn.o_proj.weight"] = layer.o_proj.weight
        gu = layer.gate_up_proj.weight
        sd[p + "mlp.gate_proj.weight"] = gu[:inter]
        sd[p + "mlp.up_proj.weight"] = gu[inter:]
        sd[p + "mlp.down_proj.weight"] = layer.down_proj.weight
        sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    missing, unexpected = hf.load_state_dict(
        {k: v.detach().clone().to(dtype) for k, v in sd.items()}, strict=False
    )
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"weight transfer failed: missing={missing} unexpected={unexpected}")
    hf.eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Avoid special ids at the bottom of the vocabulary.
    return [torch.randint(100, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(batch)]


def run_tandem(engine: Any, batch_prompts: list[list[int]], *, new: int) -> dict[str, float]:
    from scheduler import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    for i, p in enumerate(batch_prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, params)
    start = time.perf_counter()
    first = None
    produced = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        produced += sum(len(o.outputs[0].new_token_ids) for o in outs)
        if first is None and produced >= len(batch_prompts):
            first = time.perf_counter() - start  # every request has its first token
    total = time.perf_counter() - start
    assert produced == len(batch_prompts) * new, produced
    return {"total_s": total, "prefill_s": first or 0.0}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_hf_generate(hf: Any, batch_prompts: list[list[int]], *, new: int) -> dict[str, float]:
    ids = torch.tensor(batch_prompts, device=hf.device)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        _sync(hf.device)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        _sync(hf.device)
        total = time.perf_counter() - start
    assert out.shape[1] == PROMPT_LEN + new
    return {"total_s": total, "prefill_s": prefill}


def run_hf_loop(hf: Any, batch_prompts: list[list[int]], *, new: int) -> dict[str, float]:
    from transformers import DynamicCache

    ids = torch.tensor(batch_prompts, device=hf.device)
    with torch.inference_mode():
        start = time.perf_counter()
        cache = DynamicCache()
        out = hf(input_ids=ids, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(hf.device)
        prefill = time.perf_counter() - start
        for _ in range(new - 1):
            out = hf(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(hf.device)
        total = time.perf_counter() - start
    return {"total_s": total, "prefill_s": prefill}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3, help="runs per cell; the median is kept")
    ap.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    ap.add_argument(
        "--quantizations",
        nargs="*",
        default=["auto"],
        help="quantized tandem rows besides the dense one (auto, int8, int4)",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda (tests/gpu runs it there)")
    ap.add_argument("--out", default="bench/results/model_throughput.json")
    args = ap.parse_args()

    from cluster.engine.llm_engine import LLMEngine

    torch.manual_seed(0)
    results: list[dict[str, Any]] = []
    new = args.new_tokens
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)

        def engine_for(quantization: str, dtype: torch.dtype = dtype, eager: bool = False) -> Any:
            return LLMEngine(
                args.model,
                dtype=dtype,
                quantization=quantization,
                enforce_eager=eager,
                max_num_seqs=max(args.batches),
                max_num_batched_tokens=max(2048, PROMPT_LEN * max(args.batches)),
                # Room for every request's whole context (the default 1 GiB holds only 8k
                # tokens of Llama-3-8B: its large batches were preempted).
                block_size=BLOCK_SIZE,
                num_blocks=max(args.batches) * -(-(PROMPT_LEN + new) // BLOCK_SIZE) + 16,
                enable_prefix_caching=False,  # distinct random prompts anyway; keep it equal
                progress=False,
                device=args.device,
            )

        engine = engine_for("none")
        hf = hf_model_from(engine.worker.model, dtype, args.device)
        vocab = engine.worker.config.vocab_size
        contenders: dict[str, Callable[[list[list[int]]], dict[str, float]]] = {
            "tandem": partial(run_tandem, engine, new=new),
            "hf-generate": partial(run_hf_generate, hf, new=new),
            "hf-loop": partial(run_hf_loop, hf, new=new),
        }
        if args.device.startswith("cuda"):  # the same engine without its CUDA graphs
            contenders["tandem-eager"] = partial(
                run_tandem, engine_for("none", eager=True), new=new
            )
        for q in args.quantizations:
            contenders[f"tandem-{q}"] = partial(run_tandem, engine_for(q), new=new)
        # Warm-up (first-call allocations, kernel selection).
        warm = prompts(2, vocab, 99)
        for fn in contenders.values():
            fn(warm)
        for batch in args.batches:
            row: dict[str, Any] = {"dtype": dtype_name, "batch": batch}
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
            if args.device.startswith("cuda"):
                # This batch size's CUDA graphs are captured on first use: not in a timed run.
                for name, fn in contenders.items():
                    if name.startswith("tandem"):
                        fn(prompts(batch, vocab, 98))
            # Interleaved, rotating the order: a slow phase of the host hits everyone alike.
            names = list(contenders)
            for rep in range(args.repeat):
                batch_prompts = prompts(batch, vocab, rep)
                shift = rep % len(names)
                for name in names[shift:] + names[:shift]:
                    runs[name].append(contenders[name](batch_prompts))
            for name, rs in runs.items():
                decode = [batch * (new - 1) / max(r["total_s"] - r["prefill_s"], 1e-9) for r in rs]
                row[name] = {
                    "decode_tok_s": statistics.median(decode),
                    "decode_tok_s_runs": decode,
                    "e2e_tok_s": statistics.median(batch * new / r["total_s"] for r in rs),
                    "prefill_s": statistics.median(r["prefill_s"] for r in rs),
                }
            best_hf = max(row["hf-generate"]["decode_tok_s"], row["hf-loop"]["decode_tok_s"])
            row["speedup_vs_best_hf"] = row["tandem"]["decode_tok_s"] / best_hf
            results.append(row)
            print(_fmt(row), flush=True)

    print()
    quant_names = [n for n in results[0] if n.startswith("tandem-")] if results else []
    print(
        f"{'dtype':9} {'batch':>5} {'tandem':>9} "
        + "".join(f"{n:>13}" for n in quant_names)
        + f" {'hf-gen':>9} {'hf-loop':>9} {'speedup':>8}"
    )
    for row in results:
        print(
            f"{row['dtype']:9} {row['batch']:>5} {row['tandem']['decode_tok_s']:>9.1f} "
            + "".join(f"{row[n]['decode_tok_s']:>13.1f}" for n in quant_names)
            + f" {row['hf-generate']['decode_tok_s']:>9.1f} {row['hf-loop']['decode_tok_s']:>9.1f}"
            f" {row['speedup_vs_best_hf']:>7.2f}x"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "torch": torch.__version__,
        "prompt_len": PROMPT_LEN,
        "new_tokens": new,
        "repeat": args.repeat,
        "metric": "decode tokens/s = B*(new-1)/(total-prefill), median of runs",
    }
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {out}")


def _fmt(row: dict[str, Any]) -> str:
    parts = [f"{row['dtype']} B={row['batch']}:"]
    for name in [n for n in row if n == "tandem" or n.startswith(("tandem-", "hf-"))]:
        r = row[name]
        parts.append(f"{name} {r['decode_tok_s']:.1f} tok/s (prefill {r['prefill_s']:.2f}s)")
    parts.append(f"speedup {row['speedup_vs_best_hf']:.2f}x")
    return "  ".join(parts)


if __name__ == "__main__":
    main()
