"""The simulator against the real thing: ``tandem bench`` (Poisson arrivals, fixed lengths)
against ``tandem serve`` on this machine, colocated and disaggregated, at three request rates
each; then the simulator (``cluster/sim/``, the calibrated CPU cost model) serves the very same
requests -- each one's send time and lengths, taken from the bench's records -- with the same
ClusterConfig. The report: TTFT and TPOT p50/p90 and output throughput, real vs simulated, and
the relative error of each (the issue's bar: 15% on TTFT/TPOT p50 and throughput).

    python -m bench.simulator_validation                       # both modes, 3 rates each
    python -m bench.simulator_validation --modes colocated --rates 1 2
    python -m bench.simulator_validation --simulate-only       # re-simulate the saved runs

Results: bench/results/simulator_validation.json (with every real run's records, so the
simulated side can be rerun without the servers: --simulate-only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.serve_transports import stop, wait_ready

BIN = Path(sys.executable).parent
OUT = Path("bench/results/simulator_validation.json")
SERVED_MODEL = Path("cluster/sim/models/cpu-smollm2.json")
# The served steps' cost is fitted on runs at these rates (--fit-serving), not validated on.
FIT_RATES = {"colocated": [0.3, 2.2], "disaggregated": [1.0]}
# The bar: |simulated - real| / real within this, on these metrics, in every run.
BAR = 0.15
BAR_METRICS = ("ttft_p50_ms", "tpot_p50_ms", "throughput_tok_s")

# mode -> (the cluster's YAML, or None for tandem serve's default; prompt tokens; output
# tokens; request rates). The default config hands off prompts over 256 uncached tokens.
MODES: dict[str, dict[str, Any]] = {
    "colocated": {
        "config": {"pools": [{"name": "both", "role": "both", "num_threads": 1}]},
        "input_len": 128,
        "output_len": 64,
        "rates": [0.5, 1.5, 3.0],
    },
    "disaggregated": {
        "config": None,  # tandem serve's default: one prefill and one decode instance
        "input_len": 384,
        "output_len": 64,
        "rates": [0.5, 1.5, 2.5],
    },
}


def real_runs(
    args: argparse.Namespace, mode: str, workdir: Path, rates: list[float], seed: int
) -> list[dict[str, Any]]:
    """Start ``tandem serve`` for ``mode``, run ``tandem bench`` at each rate, stop it. Each
    run has prompts of its own (seeds ``seed``, ``seed + 1``, ...): a prompt the server saw
    in an earlier run would hit its prefix cache."""
    spec = MODES[mode]
    command = [str(BIN / "tandem"), "serve", "--port", str(args.port), "--no-grpc"]
    if spec["config"] is not None:
        import yaml

        path = workdir / f"{mode}.yaml"
        path.write_text(yaml.safe_dump(spec["config"]))
        command += ["--config", str(path)]
    url = f"http://127.0.0.1:{args.port}"
    log = (workdir / f"serve-{mode}.log").open("wb")
    serve = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    runs = []
    try:
        wait_ready(url, serve, args.startup_timeout_s)
        for i, rate in enumerate(rates):
            out = workdir / f"bench-{mode}-{rate}.json"
            subprocess.run(
                [
                    str(BIN / "tandem"),
                    "bench",
                    "--base-url",
                    f"{url}/v1",
                    "--request-rate",
                    str(rate),
                    "--num-prompts",
                    str(args.num_prompts),
                    "--input-len",
                    str(spec["input_len"]),
                    "--output-len",
                    str(spec["output_len"]),
                    "--len-dist",
                    "fixed",
                    "--warmup",
                    "2",
                    "--seed",
                    str(seed + i),
                    "--no-progress",
                    "--out",
                    str(out),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            run = json.loads(out.read_text())["runs"][0]
            runs.append({"mode": mode, "rate": rate, **run})
            s = run["summary"]
            print(
                f"{mode} rate {rate}: real TTFT p50 {s['ttft']['p50_ms']:.0f} ms, "
                f"TPOT p50 {s['tpot']['p50_ms']:.1f} ms, "
                f"{s['output_token_throughput']:.1f} tok/s",
                flush=True,
            )
    finally:
        stop(serve)
        log.close()
    return runs


def simulate(run: dict[str, Any], cost: Any) -> dict[str, Any]:
    """The simulator's answer for one real run: the same requests at the same times."""
    from cluster.config import ClusterConfig, default_cluster_config
    from cluster.sim.simulator import Simulation
    from cluster.sim.workload import WorkItem

    spec = MODES[run["mode"]]
    config = (
        default_cluster_config()
        if spec["config"] is None
        else ClusterConfig.model_validate(spec["config"])
    )
    records = [r for r in run["requests"] if r["ok"]]
    work = [WorkItem(r["start_s"], r["prompt_tokens"], r["output_tokens"]) for r in records]
    result = Simulation(config, cost).run(work)
    return result.summary()


def _log_error(run: dict[str, Any], model: Any) -> float:
    """How far the simulation of ``run`` is from it: |log ratio| of TTFT and TPOT p50."""
    sim, real = simulate(run, model), run["summary"]
    error = abs(math.log(sim["ttft_p50_s"] * 1000 / real["ttft"]["p50_ms"]))
    return error + abs(math.log(sim["tpot_p50_s"] * 1000 / real["tpot"]["p50_ms"]))


def fit_serving(runs: list[dict[str, Any]], engine: Any) -> Any:
    """The served steps' cost: the engine's decode terms x ``factor``, its prefill terms x
    ``prefill_factor``, + ``overhead`` per step -- the values whose simulations match
    ``runs`` (colocated runs at a low and a high rate, so that a lone decode, a batch and a
    prefill all weigh in) best, by coordinate descent with halving steps."""

    def error(point: tuple[float, float, float]) -> float:
        model = engine.serving(point[0], point[2], prefill_factor=point[1])
        return sum(_log_error(run, model) for run in runs)

    point, steps = [1.2, 1.2, 0.001], [0.16, 0.16, 0.002]
    best = error((point[0], point[1], point[2]))
    for _ in range(6):
        for i in range(3):
            for sign in (1, -1):
                while True:
                    trial = list(point)
                    trial[i] = max(trial[i] + sign * steps[i], 0.0 if i == 2 else 0.5)
                    value = error((trial[0], trial[1], trial[2]))
                    if value >= best:
                        break
                    point, best = trial, value
        steps = [s / 2 for s in steps]
    fits = [{"mode": r["mode"], "rate": r["rate"], "requests": len(r["requests"])} for r in runs]
    served = engine.serving(point[0], point[2], prefill_factor=point[1], serving_fit=fits)
    # As measured: tandem serve's default (the disaggregated runs) puts its two instances on
    # this one machine; a plan for more instances gets more such machines.
    return dataclasses.replace(
        served, machine_cores=float(os.cpu_count() or 1), instances_per_machine=2
    )


def fit_background(run: dict[str, Any], served: Any) -> Any:
    """From one disaggregated run (``tandem serve``'s default: two workers of ``num_threads:
    auto`` sharing the machine): the cores the serving processes keep busy (steps of 0.05
    core) and how much faster a worker steps with a second core to itself (steps of 0.05) --
    the pair whose simulation matches the run's TTFT and TPOT p50 best (in log ratio)."""
    best = None
    for step in range(0, 41):
        background = step * 0.05
        for tenth in range(0, 21):
            speedup = 1.0 + tenth * 0.05
            model = dataclasses.replace(
                served, background_cores=background, spare_core_speedup=speedup
            )
            error = _log_error(run, model)
            if best is None or error < best[0]:
                best = (error, background, speedup)
    assert best is not None
    notes = {
        **served.notes,
        "background_fit": {
            "mode": run["mode"],
            "rate": run["rate"],
            "cores": best[1],
            "spare_core_speedup": best[2],
        },
    }
    return dataclasses.replace(
        served, background_cores=best[1], spare_core_speedup=best[2], notes=notes
    )


def compare(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    rows = {
        "ttft_p50_ms": (real["ttft"]["p50_ms"], sim["ttft_p50_s"] * 1000),
        "ttft_p90_ms": (real["ttft"]["p90_ms"], sim["ttft_p90_s"] * 1000),
        "tpot_p50_ms": (real["tpot"]["p50_ms"], sim["tpot_p50_s"] * 1000),
        "tpot_p90_ms": (real["tpot"]["p90_ms"], sim["tpot_p90_s"] * 1000),
        "throughput_tok_s": (real["output_token_throughput"], sim["throughput_tokens_s"]),
    }
    return {
        name: {"real": r, "sim": s, "error": (s - r) / r if r else float("nan")}
        for name, (r, s) in rows.items()
    }


def bar_verdict(results: list[dict[str, Any]], bar: float = BAR) -> dict[str, dict[str, Any]]:
    """Per mode: whether every run's |error| on ``BAR_METRICS`` is within ``bar``, and the
    (rate, metric, error) of each miss. An error of either sign counts by its size; a NaN one
    (a real value of 0) misses."""
    verdict: dict[str, dict[str, Any]] = {}
    for result in results:
        mode = verdict.setdefault(result["mode"], {"met": True, "misses": []})
        for metric in BAR_METRICS:
            error = result["comparison"][metric]["error"]
            if not abs(error) <= bar:  # (NaN: not met)
                mode["met"] = False
                mode["misses"].append({"rate": result["rate"], "metric": metric, "error": error})
    return verdict


def table(results: list[dict[str, Any]]) -> str:
    head = "| mode | rate | metric | real | simulated | error |\n|---|---|---|---|---|---|"
    lines = [head]
    for result in results:
        for metric, row in result["comparison"].items():
            lines.append(
                f"| {result['mode']} | {result['rate']:g} | {metric} | {row['real']:.1f} | "
                f"{row['sim']:.1f} | {row['error']:+.1%} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--rates", nargs="+", type=float, default=None, help="instead of the modes'")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8017)
    ap.add_argument("--startup-timeout-s", type=float, default=240.0)
    ap.add_argument("--cost", default=None, help="a fitted cost model (default: the shipped)")
    ap.add_argument("--simulate-only", action="store_true", help="reuse the saved real runs")
    ap.add_argument(
        "--fit-serving",
        action="store_true",
        help="first fit the served steps' cost (a colocated and a disaggregated run at rates "
        "of their own, FIT_RATES, not among the validation runs) and write it as the "
        "shipped cpu model",
    )

    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()

    from cluster.sim.cost import LinearCostModel, load_cost_model

    fit_runs: dict[str, Any] = {}
    if args.simulate_only:
        saved = json.loads(Path(args.out).read_text())
        runs, fit_runs = saved["runs"], saved.get("fit_runs") or {}
    else:
        runs = []
        with tempfile.TemporaryDirectory(prefix="tandem-sim-validation-") as tmp:
            for mode in args.modes:
                rates = args.rates or MODES[mode]["rates"]
                fitting = FIT_RATES[mode] if args.fit_serving else []
                found = real_runs(args, mode, Path(tmp), [*fitting, *rates], args.seed)
                fit_runs[mode], found = found[: len(fitting)], found[len(fitting) :]
                runs += found
    if args.fit_serving and all(fit_runs.get(mode) for mode in MODES):
        engine = load_cost_model("cpu-engine")
        assert isinstance(engine, LinearCostModel)
        served = fit_serving(fit_runs["colocated"], engine)
        cost = fit_background(fit_runs["disaggregated"][0], served)
        cost.save(SERVED_MODEL)
        print(
            f"served steps: decode x {cost.notes['serving_factor']:.3f}, prefill x "
            f"{cost.notes['serving_prefill_factor']:.3f} the engine's, + "
            f"{cost.notes['serving_overhead_s'] * 1000:.2f} ms; serving processes "
            f"{cost.background_cores:.2f} cores; a worker with a spare core x "
            f"{cost.spare_core_speedup:.2f} (written to {SERVED_MODEL})"
        )
    else:
        cost = load_cost_model(args.cost or "cpu")
    results = []
    for run in runs:
        sim = simulate(run, cost)
        results.append(
            {
                "mode": run["mode"],
                "rate": run["rate"],
                "comparison": compare(run["summary"], sim),
                "sim_speedup": sim["speedup"],
            }
        )
    print(table(results))
    verdict = bar_verdict(results)
    for mode, v in verdict.items():
        misses = ", ".join(
            f"{m['metric']} {m['error']:+.1%} at {m['rate']:g}/s" for m in v["misses"]
        )
        state = "met" if v["met"] else f"not met ({misses})"
        print(f"{mode}: the {BAR:.0%} bar on {', '.join(BAR_METRICS)}: {state}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "num_prompts": args.num_prompts,
                "cost_model": cost.name,
                "results": results,
                "bar": {"tolerance": BAR, "metrics": list(BAR_METRICS), "verdict": verdict},
                "fit_runs": fit_runs,
                "runs": runs,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
