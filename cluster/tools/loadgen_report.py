"""Statistics and reporting for ``tandem bench`` (cluster/tools/loadgen.py).

Pure functions over per-request records: percentiles, goodput, one run's summary, the table
printed to stdout, the JSON file and the PNG plots. Nothing here does I/O on the network, so all
of it is testable on hand-built records.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestRecord:
    """One request's outcome. Times are seconds; ``None`` means "not measured" (e.g. no TTFT for
    a failed request, no TPOT for a one-token output)."""

    index: int  # position in the run's request list
    ok: bool
    prompt_tokens: int  # usage.prompt_tokens when the server sent it, else the tokens we sent
    output_tokens: int  # usage.completion_tokens when sent, else the number of content chunks
    start_s: float = 0.0  # send time, relative to the run's start
    ttft_s: float | None = None  # time to the first non-empty content chunk
    e2e_s: float | None = None  # send to data: [DONE]
    tpot_s: float | None = None  # (e2e - ttft) / (output_tokens - 1)
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    status: int | None = None  # HTTP status, when a response arrived
    error: str | None = None  # why ok is False


@dataclass
class RunResult:
    """One load level: its label (``concurrency=4`` / ``rate=2.0``), the x value for plots, the
    records and the wall time from the first send to the last completion."""

    label: str
    mode: str  # "concurrency" or "rate"
    level: float  # the concurrency or the request rate
    records: list[RequestRecord]
    duration_s: float


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default); ``None`` for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def meets_slo(r: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether one request meets every given SLO. A failed request never does; a one-token output
    has no TPOT and so cannot miss a TPOT SLO."""
    if not r.ok or r.ttft_s is None:
        return False
    if slo_ttft_ms is not None and r.ttft_s * 1000 > slo_ttft_ms:
        return False
    return slo_tpot_ms is None or r.tpot_s is None or r.tpot_s * 1000 <= slo_tpot_ms


def goodput(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None,
) -> dict[str, float | int] | None:
    """Requests meeting all given SLOs: their count, their share of all requests (failed ones
    included) and their rate in requests/s. ``None`` when no SLO is given."""
    if slo_ttft_ms is None and slo_tpot_ms is None:
        return None
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in records)
    return {
        "good_requests": good,
        "share": good / len(records) if records else 0.0,
        "req_per_s": good / duration_s if duration_s > 0 else 0.0,
    }


def latency_stats(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean and percentiles of latencies given in seconds, reported in milliseconds."""
    ms = [v * 1000 for v in values_s]
    out: dict[str, float | None] = {"mean_ms": sum(ms) / len(ms) if ms else None}
    for q in PERCENTILES:
        out[f"p{q}_ms"] = percentile(ms, q)
    return out


def metric_values(records: Sequence[RequestRecord], metric: str) -> list[float]:
    """One latency metric (seconds) over the successful requests; ITL pools every gap."""
    ok = [r for r in records if r.ok]
    if metric == "itl":
        return [gap for r in ok for gap in r.itl_s]
    vals = [getattr(r, f"{metric}_s") for r in ok]
    return [v for v in vals if v is not None]


def summarize(
    run: RunResult, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None
) -> dict[str, Any]:
    """One run's summary: counts, throughputs (successful requests only), latency statistics in
    ms and goodput."""
    ok = [r for r in run.records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    dur = run.duration_s

    def rate(x: float) -> float:
        return x / dur if dur > 0 else 0.0

    summary: dict[str, Any] = {
        "label": run.label,
        "mode": run.mode,
        "level": run.level,
        "completed": len(ok),
        "failed": len(run.records) - len(ok),
        "duration_s": dur,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": rate(len(ok)),
        "output_token_throughput": rate(out_tokens),
        "total_token_throughput": rate(in_tokens + out_tokens),
    }
    for m in LATENCY_METRICS:
        summary[m] = latency_stats(metric_values(run.records, m))
    summary["goodput"] = goodput(run.records, dur, slo_ttft_ms, slo_tpot_ms)
    return summary


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.2f}"
    return str(v)


def format_table(summaries: Sequence[dict[str, Any]]) -> str:
    """A metrics x runs table (one column per run) for stdout."""
    rows: list[tuple[str, list[Any]]] = [
        ("completed", [s["completed"] for s in summaries]),
        ("failed", [s["failed"] for s in summaries]),
        ("duration (s)", [s["duration_s"] for s in summaries]),
        ("requests/s", [s["request_throughput"] for s in summaries]),
        ("output tok/s", [s["output_token_throughput"] for s in summaries]),
        ("total tok/s", [s["total_token_throughput"] for s in summaries]),
    ]
    for m in LATENCY_METRICS:
        for stat in ("mean_ms", *(f"p{q}_ms" for q in PERCENTILES)):
            rows.append((f"{m.upper()} {stat[:-3]} (ms)", [s[m][stat] for s in summaries]))
    if any(s["goodput"] is not None for s in summaries):
        gp = [s["goodput"] or {} for s in summaries]
        rows.append(("SLO met (%)", [100 * g["share"] if g else None for g in gp]))
        rows.append(("goodput (req/s)", [g.get("req_per_s") for g in gp]))
    header = ["metric", *(s["label"] for s in summaries)]
    cells = [[name, *(_fmt(v) for v in vals)] for name, vals in rows]
    widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *cells]
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def write_json(
    path: str | Path,
    config: dict[str, Any],
    runs: Sequence[RunResult],
    summaries: Sequence[dict[str, Any]],
) -> None:
    """``{"config", "runs": [{"summary", "requests"}]}``; creates the parent directory."""
    doc = {
        "config": config,
        "runs": [
            {"summary": s, "requests": [asdict(r) for r in run.records]}
            for run, s in zip(runs, summaries, strict=True)
        ],
    }
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=2) + "\n")


def write_plots(
    plot_dir: str | Path, runs: Sequence[RunResult], summaries: Sequence[dict[str, Any]]
) -> list[Path]:
    """``latency_cdf.png`` (TTFT, TPOT, E2E; one line per run) and ``throughput.png`` (output
    tok/s and goodput req/s against the load level). Returns the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # no display; must precede pyplot's import
    import matplotlib.pyplot as plt

    out = Path(plot_dir)
    out.mkdir(parents=True, exist_ok=True)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, metric in zip(axes, ("ttft", "tpot", "e2e"), strict=True):
        for run in runs:
            xs = sorted(v * 1000 for v in metric_values(run.records, metric))
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=run.label)
        ax.set_title(f"{metric.upper()} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    cdf_path = out / "latency_cdf.png"
    fig.savefig(cdf_path, dpi=100)
    plt.close(fig)

    mode = summaries[0]["mode"] if summaries else "concurrency"
    xlabel = "concurrency" if mode == "concurrency" else "request rate (req/s)"
    levels = [s["level"] for s in summaries]
    has_slo = any(s["goodput"] is not None for s in summaries)
    # Without an SLO every successful request counts, so goodput is the request throughput.
    good = [
        (s["goodput"] or {}).get("req_per_s", 0.0) if has_slo else s["request_throughput"]
        for s in summaries
    ]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    ax1.plot(levels, [s["output_token_throughput"] for s in summaries], marker="o")
    ax1.set_title("output throughput")
    ax1.set_ylabel("output tokens/s")
    ax2.plot(levels, good, marker="o", color="tab:green")
    ax2.set_title("goodput" if has_slo else "request throughput (no SLO given)")
    ax2.set_ylabel("requests/s")
    for ax in (ax1, ax2):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if mode == "concurrency" and len(levels) > 1:
            ax.set_xscale("log", base=2)  # 1, 4, 16 ... spaced evenly
        ax.set_xticks(levels, [f"{x:g}" for x in levels])
        ax.minorticks_off()
    fig.tight_layout()
    tp_path = out / "throughput.png"
    fig.savefig(tp_path, dpi=100)
    plt.close(fig)
    return [cdf_path, tp_path]
