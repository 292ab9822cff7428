"""DistServe's qualitative result, in the simulator with the GPU cost model: with a tight TPOT
target, disaggregated prefill/decode serves more requests within the SLO per GPU than
colocation (a colocated decode step that carries a prefill chunk is slow, and every running
request waits for it); with a loose one, colocation does (both GPUs do all the work, nothing
is handed off).

Two GPUs in each: one prefill + one decode instance, or two colocated instances; Llama-3-8B on
H100 SXM (``llama-3-8b@h100-sxm``); a long-prompt workload (prompts of about 2,000 tokens,
outputs of about 200); a sweep of Poisson rates. For each, SLO attainment and goodput (the
requests within both targets, per second, per GPU) at each rate, and the goodput capacity:
the highest rate with at least 90% attainment, per GPU.

    python -m bench.distserve                  # both SLOs, PNG in docs/images/distserve.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig
from cluster.sim.cost import gpu_model
from cluster.sim.simulator import SLO, Simulation
from cluster.sim.workload import Shape, poisson

SHAPE = Shape("long-chat", 2000, 200, sigma=0.4, prompt_max=6000, output_max=800)
SLOS = {"tight TPOT (15 ms)": SLO(2.0, 0.015), "loose TPOT (100 ms)": SLO(2.0, 0.100)}
CLUSTERS: dict[str, dict[str, Any]] = {
    "disaggregated (1P + 1D)": {
        "pools": [
            {"name": "p", "role": "prefill"},
            {"name": "d", "role": "decode"},
        ],
        "router": {"disaggregation": "always"},
    },
    "colocated (2 instances)": {"pools": [{"name": "c", "role": "both", "replicas": 2}]},
}
GPUS = 2


def sweep(rates: list[float], num_requests: int, seed: int) -> dict[str, Any]:
    cost = gpu_model("llama-3-8b@h100-sxm")
    results: dict[str, Any] = {}
    for slo_name, slo in SLOS.items():
        for cluster_name, data in CLUSTERS.items():
            config = ClusterConfig.model_validate({"block_size": 16, **data})
            points = []
            for rate in rates:
                work = poisson(rate, num_requests, SHAPE, seed)
                s = Simulation(config, cost).run(work, slo).summary(offered_rate=rate)
                points.append(
                    {
                        "rate": rate,
                        "attainment": s["slo_attainment"],
                        "goodput_per_gpu": s["goodput_requests_s"] / GPUS,
                        "ttft_p90_s": s["ttft_p90_s"],
                        "tpot_p90_s": s["tpot_p90_s"],
                    }
                )
                print(
                    f"{slo_name:20} {cluster_name:25} rate {rate:5.1f}: attainment "
                    f"{s['slo_attainment']:6.1%}, TPOT p90 {s['tpot_p90_s'] * 1000:6.1f} ms, "
                    f"TTFT p90 {s['ttft_p90_s'] * 1000:7.1f} ms",
                    flush=True,
                )
            capacity = max((p["rate"] for p in points if p["attainment"] >= 0.9), default=0.0)
            results.setdefault(slo_name, {})[cluster_name] = {
                "points": points,
                "capacity_per_gpu": capacity / GPUS,
            }
    return results


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Goodput per GPU against the offered rate per GPU (top; DistServe's measure), and the
    # SLO attainment behind it (bottom).
    fig, axes = plt.subplots(2, len(results), figsize=(11, 7), sharex=True, sharey="row")
    for col, (slo_name, clusters) in enumerate(results.items()):
        top, bottom = axes[0][col], axes[1][col]
        for cluster_name, result in clusters.items():
            rates = [p["rate"] / GPUS for p in result["points"]]
            goodput = [p["goodput_per_gpu"] for p in result["points"]]
            top.plot(rates, goodput, marker="o", label=cluster_name)
            bottom.plot(rates, [p["attainment"] for p in result["points"]], marker="o")
        top.plot(rates, rates, color="grey", linestyle=":", linewidth=1, label="offered")
        top.set_title(f"Llama-3-8B, 2 x H100, {slo_name}")
        bottom.axhline(0.9, color="grey", linestyle=":", linewidth=1)
        bottom.set_xlabel("request rate per GPU (req/s)")
        top.grid(alpha=0.3)
        bottom.grid(alpha=0.3)
    axes[0][0].set_ylabel("goodput per GPU (req/s within the SLO)")
    axes[1][0].set_ylabel("SLO attainment (TTFT 2 s and TPOT)")
    axes[0][0].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--rates", nargs="+", type=float, default=[2, 4, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32]
    )
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--png", default="docs/images/distserve.png")
    ap.add_argument("--out", default="bench/results/distserve.json")
    args = ap.parse_args()
    results = sweep(args.rates, args.num_requests, args.seed)
    for slo_name, clusters in results.items():
        for cluster_name, result in clusters.items():
            print(f"{slo_name}: {cluster_name}: {result['capacity_per_gpu']:.2f} req/s per GPU")
    plot(results, Path(args.png))
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
