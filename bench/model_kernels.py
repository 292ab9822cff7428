"""Where a decode step's time goes, and the quantized projections against the dense ones.

Three measurements on the built-in model (or ``--model``), each on its own:

- ``shapes``: every projection shape of the model, for batch rows 1..64, timed with oneDNN's
  packed bf16 GEMM (today's dense path), torch's int8 and int4 weight-only kernels. Each
  kind's weights cycle through as many copies as the model has layers, and at least 64 MiB
  of them (``STREAMED_BYTES``: int4's quarter of the bytes would fit in the cache), so they
  come from memory as in a real step; the ``dense_min_rows`` crossover is read off this table;
- ``breakdown``: one batch-1 decode forward (the engine's own model and attention backend),
  profiled per operator class (projections, attention, norms, rotary, other) and per layer,
  with and without quantization, layer by layer (the one-call decode step of
  ``actors.model.fused_decode`` is one ctypes call to the profiler: its wall time is printed
  beside);
- ``bandwidth``: weight bytes a batch-1 decode step reads per second, against the memory read
  bandwidth measured in the same run (a torch sum over a 1 GiB tensor with the same threads):
  the issue's 40% target (``auto-layerwise``: the quantized model without the one-call step).

    python -m bench.model_kernels shapes breakdown bandwidth
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROWS = (1, 2, 4, 8, 16, 32, 64)


def _time(fn: Callable[[], Any], min_time_s: float = 0.3, repeat: int = 5) -> float:
    """Median seconds per call over ``repeat`` batches of calls lasting ``min_time_s``."""
    fn()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < min_time_s / repeat:
        fn()
        calls += 1
    per_batch = max(calls, 1)
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(per_batch):
            fn()
        samples.append((time.perf_counter() - start) / per_batch)
    return statistics.median(samples)


def _load(model: str | None, quantization: str, dense_min_rows: int = 8) -> Any:
    from actors.worker import ModelWorker

    worker = ModelWorker(
        model,
        progress=False,
        num_threads=torch.get_num_threads(),
        quantization=quantization,
        quant_dense_min_rows=dense_min_rows,
    )
    worker.load_model()
    worker.init_kv_cache(64)
    return worker


STREAMED_BYTES = 64 * 2**20  # each kind's copies together: twice a 32 MiB L3


def _copies(at_least: int, one_bytes: int) -> int:
    return max(at_least, -(-STREAMED_BYTES // max(one_bytes, 1)))


def shapes(model: str | None) -> list[dict[str, Any]]:
    from actors.model.linear import pack_linear
    from actors.model.quant import QuantizedWeight

    worker = _load(model, "none")
    m = worker.model
    layers = len(m.layers)
    named: dict[str, torch.Tensor] = {}
    for name, linear in m.projections():
        named.setdefault(name.split(".", 2)[2], linear.weight)
    named["lm_head"] = m.output_embedding
    rows_out = []
    for name, weight in named.items():
        # Copies enough that each kind's whole set is twice a large L3 (all of them streamed
        # from memory, as in a real step): the model's layer count was enough for the dense
        # weights, not for int4's quarter of the bytes, which then ran from the cache.
        n = weight.numel()
        dense_n = _copies(1 if name == "lm_head" else layers, n * weight.element_size())
        int8_n, int4_n = _copies(dense_n, n), _copies(dense_n, n // 2)
        dense = [pack_linear(weight.clone(), None, 64, min_rows=1) for _ in range(dense_n)]
        int8 = [QuantizedWeight.from_float(weight, "int8", weight.dtype) for _ in range(int8_n)]
        int4 = [QuantizedWeight.from_float(weight, "int4", weight.dtype) for _ in range(int4_n)]
        for rows in ROWS:
            x = torch.randn(rows, weight.shape[1]).to(weight.dtype)

            def run(kernels: list[Any], mm: bool, x: torch.Tensor = x) -> None:
                for k in kernels:
                    k.matmul(x) if mm else k(x)

            t_dense = _time(lambda d=dense: run(d, False)) / dense_n
            t_int8 = _time(lambda q=int8: run(q, True)) / int8_n
            t_int4 = _time(lambda q=int4: run(q, True)) / int4_n
            row = {
                "shape": name,
                "n_k": list(weight.shape),
                "rows": rows,
                "bf16_us": t_dense * 1e6,
                "int8_us": t_int8 * 1e6,
                "int4_us": t_int4 * 1e6,
            }
            rows_out.append(row)
            print(
                f"{name:13s} {tuple(weight.shape)!s:14s} rows {rows:3d}: bf16 {row['bf16_us']:8.1f}"
                f" us  int8 {row['int8_us']:8.1f} us ({t_dense / t_int8:4.2f}x)  int4 "
                f"{row['int4_us']:8.1f} us ({t_dense / t_int4:4.2f}x)",
                flush=True,
            )
    return rows_out


def _decode_step(worker: Any, batch: int = 1, ctx: int = 130) -> Callable[[], Any]:
    from actors.model.attention import AttentionMetadata

    m = worker.model
    table = list(range(1, -(-ctx // worker.block_size) + 1))
    meta = AttentionMetadata.build(
        [1] * batch, [ctx] * batch, [table] * batch, worker.block_size, torch.device("cpu")
    )
    ids = torch.full((batch,), 5)
    pos = torch.full((batch,), ctx - 1)

    def step() -> Any:
        return m.compute_logits(m(ids, pos, worker.kv_caches, meta, worker.attn))

    return step


_CLASSES = {
    "projections": ("linear", "int4pack", "int8pack", "mm", "quant_gemm"),
    "attention": ("index_put", "paged", "scaled_dot", "kv_write", "decode_attention"),
    "norms": ("rms_norm", "pow", "mean", "rsqrt"),
    "rotary": ("rotary", "roll"),
    "silu-mul": ("silu",),
}


@contextmanager
def _profiled_kernels() -> Iterator[None]:
    """Our C kernels (ctypes calls, invisible to torch's profiler) recorded as functions named
    after them while profiling: ``add_rms_norm``, ``rotary_``, ``silu_mul``, ``kv_write``,
    ``paged_decode``, ``quant_gemm`` (a quantized projection, ours or torch's)."""
    from torch.profiler import record_function

    from actors.model.cpu_kernels import FusedOps, PagedDecodeKernel
    from actors.model.quant import QuantizedWeight

    names = ("add_rms_norm", "rotary_", "silu_mul", "kv_write", "decode_attention")
    targets: list[tuple[type, str]] = [(FusedOps, n) for n in names]
    targets += [(PagedDecodeKernel, "__call__"), (QuantizedWeight, "matmul")]
    saved = [(cls, name, getattr(cls, name)) for cls, name in targets]
    labels = {
        (PagedDecodeKernel, "__call__"): "paged_decode",
        (QuantizedWeight, "matmul"): "quant_gemm",
    }

    def wrap(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            with record_function(label):
                return fn(*args, **kwargs)

        return recorded

    try:
        for cls, name, fn in saved:
            setattr(cls, name, wrap(fn, labels.get((cls, name), name)))
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


def breakdown(model: str | None) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for quantization in ("none", "auto"):
        worker = _load(model, quantization)
        step = _decode_step(worker)
        one_call = _time(step, min_time_s=1.0)  # every layer in one C call, where it applies
        # The classes need the layer-by-layer path: the one call is one ctypes call.
        worker.model.decode_layers = False
        wall = _time(step, min_time_s=1.0)
        for _ in range(5):
            step()
        with _profiled_kernels(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                step()
        by_class: dict[str, float] = {}
        total = 0.0
        for event in prof.key_averages():
            self_us = event.self_cpu_time_total / 20
            total += self_us
            key = next(
                (c for c, words in _CLASSES.items() if any(w in event.key for w in words)),
                "other ops",
            )
            by_class[key] = by_class.get(key, 0.0) + self_us
        calls = sum(e.count for e in prof.key_averages()) / 20
        layers = len(worker.model.layers)
        row = {
            "quantization": quantization,
            "step_ms": wall * 1e3,
            "one_call_step_ms": one_call * 1e3,
            "per_layer_us": wall * 1e6 / layers,
            "ops_per_step": calls,
            "self_cpu_us": by_class,
            "python_and_dispatch_us": max(wall * 1e6 - total, 0.0),
        }
        rows.append(row)
        print(
            f"{quantization:5s}: step {row['step_ms']:.2f} ms ({row['per_layer_us']:.0f} us per "
            f"layer, {calls:.0f} torch ops)  "
            + "  ".join(f"{k} {v / 1e3:.2f} ms" for k, v in sorted(by_class.items()))
            + f"  outside ops {row['python_and_dispatch_us'] / 1e3:.2f} ms;"
            f" as one call: step {one_call * 1e3:.2f} ms",
            flush=True,
        )
    return rows


def bandwidth(model: str | None) -> list[dict[str, Any]]:
    big = torch.ones(2**30 // 4, dtype=torch.float32)
    read_s = _time(big.sum, min_time_s=2.0)
    mem_gbs = big.numel() * 4 / read_s / 1e9
    big = torch.empty(0)  # free the GiB before loading models
    rows = []
    for quantization in ("none", "auto", "auto-layerwise"):
        worker = _load(model, quantization.removesuffix("-layerwise"))
        m = worker.model
        if quantization.endswith("-layerwise"):  # without the one-call decode step
            m.decode_layers = False
        step_s = _time(_decode_step(worker), min_time_s=2.0)
        # What a batch-1 step reads: the quantized bytes where a projection runs quantized,
        # else the dense weight, plus the output head and the norms (the embedding row and
        # the KV cache are small at this context).
        read = 0
        for _, linear in m.projections():
            if linear.quant is not None:
                read += linear.quant.nbytes
            else:
                read += linear.weight.numel() * linear.weight.element_size()
        head = m._quant_logits
        emb = m.output_embedding
        read += head.nbytes if head is not None else emb.numel() * emb.element_size()
        weights_gbs = read / step_s / 1e9
        row = {
            "quantization": quantization,
            "step_ms": step_s * 1e3,
            "weight_mb_per_step": read / 1e6,
            "weight_gb_s": weights_gbs,
            "memory_read_gb_s": mem_gbs,
            "ratio": weights_gbs / mem_gbs,
        }
        rows.append(row)
        print(
            f"{quantization:14s}: {1 / step_s:6.1f} steps/s x {read / 1e6:6.1f} MB = "
            f"{weights_gbs:5.1f} GB/s of {mem_gbs:5.1f} GB/s memory read ({row['ratio']:.0%})",
            flush=True,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", nargs="+", choices=["shapes", "breakdown", "bandwidth"])
    ap.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--out", default="bench/results/model_kernels.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    for what in args.what:
        results[what] = {"shapes": shapes, "breakdown": breakdown, "bandwidth": bandwidth}[what](
            args.model
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.platform(), "threads": torch.get_num_threads()}
    out.write_text(json.dumps({"meta": meta, **results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
