"""The autoscaler through a load step, in the simulator: Llama-3-8B on H100s
(``llama-3-8b@h100-sxm``), one prefill and an autoscaled decode pool (1-6 instances), chat
traffic at a base rate, then three times that, then the base rate again. Reported: the
timeline of the offered rate, the SLO attainment of the requests arriving in each 5-second
window, and the decode pool's size; and how long after the step the attainment came back
within 20% of its value before the step.

    python -m bench.autoscaling        # PNG in docs/images/autoscaling.png
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig
from cluster.sim.cost import gpu_model
from cluster.sim.simulator import SLO, SimResult, Simulation
from cluster.sim.workload import WorkItem, poisson

SLO_TARGET = SLO(ttft_s=1.0, tpot_s=0.030)
WINDOW_S = 5.0


def step_load(base: float, factor: float, spans: tuple[float, float, float]) -> list[WorkItem]:
    items: list[WorkItem] = []
    start = 0.0
    for i, (rate, span) in enumerate(zip((base, base * factor, base), spans, strict=True)):
        phase = poisson(rate, int(rate * span), "chat", seed=100 + i)
        items += [dataclasses.replace(w, arrival_s=start + w.arrival_s) for w in phase]
        start += span
    return items


def timeline(result: SimResult, spans: tuple[float, float, float]) -> list[dict[str, Any]]:
    end = sum(spans)
    rows = []
    size = 1  # as decided (a new instance serves once started; a removed one drains first)
    decisions = sorted(result.decisions, key=lambda d: d["time"])
    t = 0.0
    while t < end:
        window = [r for r in result.records if t <= r.arrival_s < t + WINDOW_S]
        met = sum(r.meets(SLO_TARGET) for r in window)
        for d in decisions:
            if d["time"] <= t + WINDOW_S and d["pool"] == "d":
                size = d["desired"]
        rows.append(
            {
                "t": t,
                "rate": len(window) / WINDOW_S,
                "attainment": met / len(window) if window else float("nan"),
                "decode_instances": size,
            }
        )
        t += WINDOW_S
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base-rate", type=float, default=8.0)
    ap.add_argument("--factor", type=float, default=3.0)
    ap.add_argument("--spans", nargs=3, type=float, default=[60.0, 120.0, 180.0])
    ap.add_argument(
        "--instance-start-s",
        type=float,
        default=30.0,
        help="how long a new decode instance takes to serve (workers placed, model loaded)",
    )
    ap.add_argument("--png", default="docs/images/autoscaling.png")
    ap.add_argument("--out", default="bench/results/autoscaling.json")
    args = ap.parse_args()
    spans = tuple(args.spans)
    config = ClusterConfig.model_validate(
        {
            "block_size": 16,
            "router": {"disaggregation": "always"},
            "drain_timeout_s": 60.0,
            "pools": [
                {"name": "p", "role": "prefill"},
                {
                    "name": "d",
                    "role": "decode",
                    "scheduler": {"max_num_seqs": 32},
                    "autoscaling": {
                        "min_replicas": 1,
                        "max_replicas": 6,
                        "target_ongoing_requests": 24,
                        "slo_tpot_ms": SLO_TARGET.tpot_s * 1000,
                        "upscale_delay_s": 5.0,
                        "downscale_delay_s": 30.0,
                    },
                },
            ],
        }
    )
    work = step_load(args.base_rate, args.factor, spans)  # type: ignore[arg-type]
    cost = gpu_model("llama-3-8b@h100-sxm")
    result = Simulation(config, cost, args.instance_start_s).run(work, SLO_TARGET)
    rows = timeline(result, spans)  # type: ignore[arg-type]
    before = [r["attainment"] for r in rows if r["t"] + WINDOW_S <= spans[0]]
    baseline = sum(before) / len(before)
    step_at = spans[0]
    # The end of the first window of the step from which every window of the step is
    # within 20% of the baseline (None: the step ends before that).
    during = [r for r in rows if step_at <= r["t"] and r["t"] + WINDOW_S <= step_at + spans[1]]
    recovered = next(
        (
            r["t"] + WINDOW_S - step_at
            for i, r in enumerate(during)
            if all(q["attainment"] >= 0.8 * baseline for q in during[i:])
        ),
        None,
    )
    for r in rows:
        print(
            f"t {r['t']:6.0f} s: {r['rate']:5.1f} req/s, attainment {r['attainment']:6.1%}, "
            f"{r['decode_instances']} decode instances"
        )
    for d in result.decisions:
        change = f"{d['pool']} {d['replicas']} -> {d['desired']}"
        print(f"decision at {d['time']:.1f} s: {change} ({d['reason']})")
    print(
        f"attainment before the step {baseline:.1%}; back within 20% of it "
        f"{'never' if recovered is None else f'{recovered:.0f} s'} after the step; "
        f"{result.summary()['wall_s']:.1f} s of wall time"
    )
    Path(args.out).write_text(
        json.dumps(
            {
                "baseline_attainment": baseline,
                "recovered_after_s": recovered,
                "timeline": rows,
                "decisions": result.decisions,
            },
            indent=1,
        )
        + "\n"
    )
    plot(rows, result.decisions, Path(args.png), step_at, spans)


def plot(
    rows: list[dict[str, Any]],
    decisions: list[dict[str, Any]],
    path: Path,
    step_at: float,
    spans: tuple[float, ...],
    title: str = "Autoscaling through a x3 load step (simulated, Llama-3-8B on H100)",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    t = [r["t"] + WINDOW_S / 2 for r in rows]
    top.plot(t, [r["attainment"] for r in rows], marker="o", label="SLO attainment")
    top.set_ylabel("attainment (5 s windows)")
    top.set_ylim(0, 1.05)
    twin = top.twinx()
    twin.plot(t, [r["rate"] for r in rows], color="grey", linestyle="--", label="offered rate")
    twin.set_ylabel("requests / s")
    bottom.step(t, [r["decode_instances"] for r in rows], where="mid", color="tab:green")
    bottom.set_ylabel("decode instances")
    bottom.set_xlabel("time (s)")
    for ax in (top, bottom):
        ax.axvspan(step_at, step_at + spans[1], color="orange", alpha=0.1)
        ax.grid(alpha=0.3)
    top.set_title(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
