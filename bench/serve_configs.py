"""``tandem bench`` against ``tandem serve`` in several configurations, interleaved: round after
round, each configuration's server is started, loaded with every workload and stopped in turn
(the order alternates), so a slow phase of the host hits them alike. Reports the median over
rounds of each workload's output tokens/s, TTFT p50 and ITL p50, and the CPU time per output token
of each hop a token crosses (model worker, scheduler actor, Serve ingress and proxy, Ray's
daemons, the load client: ``bench/proc_cpu.py``).

Configurations (``--variants``), each a ``tandem serve`` of the built-in model:

- ``pd``: the default (one prefill and one decode instance sharing the cores, async
  scheduling, quantization auto: the GGUF file's Q4_1/Q8_0 weights run as int4/int8);
- ``pd-threads1``: the same with one fixed thread per worker (the default until issue 19);
- ``pd-dense``: the same with ``--quantization none`` (bf16, dequantized);
- ``coloc``: one colocated instance (``--prefill-instances 0``) sharing the cores;
- ``coloc-threads1``: the same with one fixed thread;
- ``-sync``: without async scheduling (the default before issue 19's second part), ``-engines``:
  with engine actors (``engine_actors: true``), ``-torchq``: the quantized projections on
  torch's weight-only kernels instead of ours (``TANDEM_QUANT_GEMM=0``), ``-switch8``: every
  quantized weight switches to its dense copy at 8 rows (``quantized_dense_min_rows: 8``, the
  default before int4 switched at 16), ``-layerwise``: decode steps layer by layer instead of
  one C call for all layers (``TANDEM_FUSED_DECODE=0``, the default before issue 19's fused
  decode step); modifiers combine (``coloc-sync-dense``);
- ``llama-server``: llama.cpp's server on the same GGUF file (Q4_1), the issue's baseline: the
  binary given by ``--llama-server`` (not shipped: build llama.cpp's ``llama-server`` target),
  2 threads, continuous batching, a slot per concurrent request, each as long as the longest
  workload needs (512 tokens for c1-c32). The same load client and workloads
  (with ``--no-keep-alive``: the server closes kept-alive connections under the client); it
  reads ``ignore_eos`` as vLLM does.

Workloads (``--workloads``): ``cN`` (streaming chat at concurrency N, 128-token prompts, 128
out, as the issue's llama-server comparison), ``prefill-heavy`` (1,024-token prompts, 8 out,
c=4) and ``decode-heavy`` (64-token prompts, 256 out, c=8).

    python -m bench.serve_configs --variants pd coloc pd-dense --workloads c1 c8 c32
    python -m bench.serve_configs --variants pd pd-threads1 --workloads prefill-heavy decode-heavy
    python -m bench.serve_configs --variants pd llama-server --llama-server PATH --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from bench import proc_cpu
from bench.serve_transports import BIN, stop, wait_ready

WARMUP = 2  # uncounted requests before each workload

WORKLOADS: dict[str, dict[str, int]] = {
    "c1": {"concurrency": 1, "input": 128, "output": 128, "prompts": 8},
    "c8": {"concurrency": 8, "input": 128, "output": 128, "prompts": 32},
    "c32": {"concurrency": 32, "input": 128, "output": 128, "prompts": 64},
    "prefill-heavy": {"concurrency": 4, "input": 1024, "output": 8, "prompts": 16},
    "decode-heavy": {"concurrency": 8, "input": 64, "output": 256, "prompts": 16},
}


MODIFIERS = ("threads1", "dense", "sync", "engines", "torchq", "switch8", "layerwise")


def variant_config(name: str) -> dict[str, Any]:
    """``pd`` or ``coloc``, then any of ``MODIFIERS`` joined by dashes (``coloc-sync``)."""
    from cluster.config import default_cluster_config

    base, *modifiers = name.split("-")
    if base not in ("pd", "coloc") or not set(modifiers) <= set(MODIFIERS):
        raise ValueError(f"unknown variant {name!r}: pd|coloc, then any of {MODIFIERS}")
    config = default_cluster_config()
    if base == "coloc":
        decode = config.pools[1].model_copy(update={"name": "colocated", "role": "both"})
        config = config.model_copy(update={"pools": [decode]})
    if "threads1" in modifiers:
        pools = [p.model_copy(update={"num_threads": 1}) for p in config.pools]
        config = config.model_copy(update={"pools": pools})
    if "dense" in modifiers:
        config = config.model_copy(update={"quantization": "none"})
    if "switch8" in modifiers:
        config = config.model_copy(update={"quantized_dense_min_rows": 8})
    if "sync" in modifiers:
        pools = [
            p.model_copy(update={"scheduler": {**p.scheduler, "async_scheduling": False}})
            for p in config.pools
        ]
        config = config.model_copy(update={"pools": pools})
    if "engines" in modifiers:
        config = config.model_copy(update={"engine_actors": True})
    data: dict[str, Any] = config.model_dump(mode="json", exclude_defaults=True)
    return data


def slot_context(workloads: list[str], margin: int = 64) -> int:
    """Tokens a llama-server slot needs for ``workloads``: the longest prompt + output, plus
    ``margin`` for the chat template, in multiples of 256 (at least 512: the c1-c32 runs')."""
    need = max(WORKLOADS[w]["input"] + WORKLOADS[w]["output"] for w in workloads) + margin
    return max(512, -(-need // 256) * 256)


def llama_server_command(args: argparse.Namespace) -> list[str]:
    """llama.cpp's server on the built-in model's GGUF file, as the issue measured it."""
    from actors.model.loader import BUILTIN_MODEL, builtin_model_path

    if not args.llama_server:
        raise SystemExit("the llama-server variant needs --llama-server PATH (llama.cpp's binary)")
    slots = max(WORKLOADS[w]["concurrency"] for w in args.workloads)
    # llama-server splits --ctx-size evenly among its --parallel slots: each slot must hold
    # the longest workload's prompt and output (and the chat template's tokens), or that
    # workload's requests fail ("exceeds the available context size") or are truncated.
    per_slot = slot_context(args.workloads)
    return [
        args.llama_server,
        "--model",
        str(builtin_model_path()),
        "--alias",
        BUILTIN_MODEL,
        "--threads",
        "2",
        "--parallel",
        str(slots),
        "--ctx-size",
        str(per_slot * slots),
        "--cont-batching",
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
    ]


def run_variant(
    args: argparse.Namespace, variant: str, workdir: Path, tag: str
) -> dict[str, dict[str, Any]]:
    """Start ``tandem serve`` in ``variant`` (or llama-server), run every workload once, stop
    it."""
    url = f"http://127.0.0.1:{args.port}"
    log = (workdir / f"serve-{tag}.log").open("wb")
    env = dict(os.environ)
    if variant == "llama-server":
        command = llama_server_command(args)
    else:
        config = workdir / f"{variant}.yaml"
        config.write_text(yaml.safe_dump(variant_config(variant)))
        command = [str(BIN / "tandem"), "serve", "--config", str(config)]
        command += ["--port", str(args.port)]
    if "torchq" in variant.split("-"):
        env["TANDEM_QUANT_GEMM"] = "0"  # the server's Ray workers inherit it
    if "layerwise" in variant.split("-"):
        env["TANDEM_FUSED_DECODE"] = "0"
    serve = subprocess.Popen(
        command,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    results: dict[str, dict[str, Any]] = {}
    try:
        wait_ready(url, serve, args.startup_timeout_s)
        for name in args.workloads:
            w = WORKLOADS[name]
            out = workdir / f"bench-{tag}-{name}.json"
            before, client_before = proc_cpu.snapshot(), proc_cpu.children_cpu_s()
            subprocess.run(
                [
                    str(BIN / "tandem"),
                    "bench",
                    "--base-url",
                    f"{url}/v1",
                    "--endpoint",
                    "chat",
                    "--concurrency",
                    str(w["concurrency"]),
                    "--num-prompts",
                    str(w["prompts"]),
                    "--input-len",
                    str(w["input"]),
                    "--output-len",
                    str(w["output"]),
                    "--warmup",
                    str(WARMUP),
                    # One server runs every workload: prompts of their own each, or a later
                    # workload's first prompts hit the prefix cache an earlier one filled.
                    "--seed",
                    str(1000 * list(WORKLOADS).index(name)),
                    "--no-progress",
                    # (it closes kept-alive connections under the client: a failed request)
                    *(["--no-keep-alive"] if variant == "llama-server" else []),
                    "--out",
                    str(out),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            spent = proc_cpu.per_hop(before, proc_cpu.snapshot())
            # (It has exited; its interpreter's start-up, about 0.26 s of CPU here, is in.)
            spent["load client"] = proc_cpu.children_cpu_s() - client_before
            summary = json.loads(out.read_text())["runs"][0]["summary"]
            tokens = window_tokens(summary)
            summary["cpu_ms_per_token"] = {
                hop: seconds * 1e3 / max(tokens, 1) for hop, seconds in spent.items()
            }
            results[name] = summary
    finally:
        stop(serve)
        log.close()
    return results


def window_tokens(summary: dict[str, Any], warmup: int = WARMUP) -> float:
    """Output tokens streamed in a workload's CPU window: its successful requests' (a failed
    one streamed none, or not all) and the ``warmup`` requests', each taken as a successful
    request's mean (they have the workload's shape). Scaling the total by (prompts + warm-up)
    / prompts instead counted every failed request as a successful one's tokens it never
    streamed: fewer tokens than that per CPU second, so more CPU per token."""
    completed, tokens = summary["completed"], summary["total_output_tokens"]
    return float(tokens + warmup * tokens / completed) if completed else 0.0


def hop_medians(summaries: list[dict[str, Any]]) -> dict[str, float]:
    """Each hop's median CPU ms per token over the rounds."""
    hops = {hop for s in summaries for hop in s["cpu_ms_per_token"]}
    return {
        hop: statistics.median(s["cpu_ms_per_token"].get(hop, 0.0) for s in summaries)
        for hop in sorted(hops)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["pd", "coloc", "pd-dense"])
    ap.add_argument("--workloads", nargs="+", default=["c1", "c8", "c32"], choices=WORKLOADS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=8014)
    ap.add_argument("--startup-timeout-s", type=float, default=240.0)
    ap.add_argument("--out", default="bench/results/serve_configs.json")
    ap.add_argument("--llama-server", help="llama.cpp's llama-server binary (variant llama-server)")
    args = ap.parse_args()

    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        v: {w: [] for w in args.workloads} for v in args.variants
    }
    with tempfile.TemporaryDirectory(prefix="tandem-serve-configs-") as tmp:
        for r in range(args.rounds):
            order = args.variants if r % 2 == 0 else args.variants[::-1]
            for variant in order:
                results = run_variant(args, variant, Path(tmp), f"{variant}-{r}")
                for name, summary in results.items():
                    runs[variant][name].append(summary)
                    print(
                        f"round {r} {variant:14s} {name:13s}: "
                        f"{summary['output_token_throughput']:7.1f} tok/s, "
                        f"TTFT p50 {summary['ttft']['p50_ms']:7.1f} ms, "
                        f"ITL p50 {summary['itl']['p50_ms']:6.1f} ms, "
                        f"{summary['failed']} failed",
                        flush=True,
                    )
    rows = []
    for variant, by_workload in runs.items():
        for name, summaries in by_workload.items():

            def median(metric: str, q: str, group: list[dict[str, Any]] = summaries) -> float:
                return float(statistics.median(s[metric][q] for s in group))

            rows.append(
                {
                    "variant": variant,
                    "workload": name,
                    **WORKLOADS[name],
                    "runs": len(summaries),
                    "output_tok_s": statistics.median(
                        s["output_token_throughput"] for s in summaries
                    ),
                    "ttft_p50_ms": median("ttft", "p50_ms"),
                    "itl_p50_ms": median("itl", "p50_ms"),
                    "tpot_p50_ms": median("tpot", "p50_ms"),
                    "failed": sum(s["failed"] for s in summaries),
                    "cpu_ms_per_token": hop_medians(summaries),
                }
            )
    print(f"\n{'variant':14s} {'workload':13s} {'tok/s':>7s} {'TTFT p50':>9s} {'ITL p50':>8s}")
    for row in rows:
        print(
            f"{row['variant']:14s} {row['workload']:13s} {row['output_tok_s']:7.1f} "
            f"{row['ttft_p50_ms']:9.1f} {row['itl_p50_ms']:8.1f}"
        )
    print("\nCPU ms per output token, by hop (all processes of each, /proc):")
    for row in rows:
        hops = sorted(row["cpu_ms_per_token"].items(), key=lambda kv: -kv[1])
        total = sum(v for _, v in hops)
        print(
            f"{row['variant']:14s} {row['workload']:13s} total {total:6.2f}: "
            + ", ".join(f"{hop} {v:.2f}" for hop, v in hops if v >= 0.01)
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.platform(), "cpu_count": os.cpu_count(), "args": vars(args)}
    out.write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
