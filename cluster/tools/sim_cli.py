"""``tandem sim run`` and ``tandem sim calibrate``: the simulator (``cluster/sim/``) from the
command line.

    tandem sim calibrate --out cpu.json                  # fit this machine's CPU cost model
    tandem sim run --config cluster.yaml --cost llama-3-8b@h100-sxm \\
        --rate 4 --num-requests 1000 --shape chat --slo-ttft-ms 500 --slo-tpot-ms 50
    tandem sim run --prefill 2 --decode 4 --cost cpu --trace requests.jsonl --json
    tandem plan --cost llama-3-8b@h100-sxm --rate 20 --shape chat \
        --slo-ttft-ms 500 --slo-tpot-ms 40 --batched-tokens 1024,4096
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from cluster.tools.argtypes import COUNT, MILLISECONDS, POSITIVE, RATE, bounded, token_budgets

# A generated workload's defaults (None in the arguments: given or not tells a --trace apart).
DEFAULT_RATE, DEFAULT_NUM_REQUESTS, DEFAULT_SHAPE = 2.0, 200, "chat"


def add_sim_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate a cluster in virtual time (the real scheduler and router, a cost model)",
        description="Run Tandem's control plane on a virtual clock with simulated workers "
        "whose steps take what a cost model says: no Ray, no model.",
    )
    verbs = p.add_subparsers(dest="sim_command", required=True)
    run = verbs.add_parser("run", help="serve a workload in simulation and report latencies")
    add_cluster_arguments(run)
    add_workload_arguments(run)
    run.add_argument("--json", action="store_true", help="print the summary as JSON")
    run.add_argument(
        "--instance-start-s",
        type=bounded(float, 0.0, "0 or more seconds"),
        default=0.0,
        help="how long an instance added by the autoscaler takes to serve (0: at once)",
    )
    cal = verbs.add_parser(
        "calibrate", help="fit this machine's CPU cost model from timed steps of the engine"
    )
    cal.add_argument("--model", default=None, help="the model (default: the built-in SmolLM2)")
    cal.add_argument("--threads", type=POSITIVE, default=1, help="torch threads per instance")
    cal.add_argument("--block-size", type=POSITIVE, default=16)
    cal.add_argument(
        "--quantization",
        choices=["auto", "none", "int8", "int4"],
        default="auto",
        help="the weights' form, as the pools to simulate run them (ClusterConfig "
        "quantization; default auto)",
    )
    cal.add_argument("--repeats", type=POSITIVE, default=2, help="passes over the scenarios")
    overhead = cal.add_mutually_exclusive_group()
    overhead.add_argument(
        "--step-overhead-ms",
        type=bounded(float, 0.0, "0 or more milliseconds"),
        default=0.0,
        help="added to every step (the worker hop)",
    )
    overhead.add_argument(
        "--measure-overhead",
        action="store_true",
        help="measure the worker hop (a Ray actor call's round trip) and add it",
    )
    cal.add_argument("--out", default=None, help="write the fitted model here (JSON)")


def add_plan_arguments(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "plan",
        help="the fewest instances (P, D, token budget) that meet TTFT/TPOT targets, simulated",
        description="Search cluster shapes in the simulator -- colocated, or P prefill + D "
        "decode instances, with each token budget given -- from one instance up, and print "
        "the smallest that meets the SLO for --target of the requests, as a ClusterConfig.",
    )
    p.add_argument("--config", default=None, metavar="FILE", help="a base ClusterConfig YAML")
    p.add_argument("--cost", default="cpu", help="cost model (as tandem sim run --cost)")
    p.add_argument(
        "--model",
        default=None,
        help="the model the printed config serves (a path or HF directory; default: the base "
        "config's). With a GPU cost model its pools also get device cuda and the model's GPUs",
    )
    add_workload_arguments(p)
    p.add_argument(
        "--target",
        type=bounded(float, 1e-9, "a fraction above 0, at most 1", 1.0),
        default=0.9,
        help="SLO attainment to reach (0-1]",
    )
    p.add_argument("--max-instances", type=POSITIVE, default=16)
    p.add_argument(
        "--batched-tokens",
        type=token_budgets,
        default=(2048,),
        metavar="N[,N...]",
        help="max_num_batched_tokens values to try per pool",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--colocated-only", action="store_true")
    which.add_argument("--disaggregated-only", action="store_true")
    p.add_argument("--out", default=None, help="also write the ClusterConfig YAML here")


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="FILE", help="a ClusterConfig YAML file")
    p.add_argument("--prefill", type=COUNT, default=None, help="prefill instances (no --config)")
    p.add_argument("--decode", type=COUNT, default=None, help="decode instances (no --config)")
    p.add_argument("--both", type=COUNT, default=None, help="colocated instances (no --config)")
    p.add_argument(
        "--cost",
        default="cpu",
        help="cost model: cpu (this machine, the built-in model), MODEL@GPU[xTP] "
        "(llama-3-8b|llama-3-70b @ h100-sxm|a100-80gb, e.g. llama-3-70b@h100-sxmx4), or a "
        "fitted model's JSON file",
    )
    p.add_argument("--max-num-batched-tokens", type=POSITIVE, default=None, help="per instance")
    p.add_argument("--max-num-seqs", type=POSITIVE, default=None, help="per instance")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    from cluster.sim.workload import SHAPES  # (light: no torch, no ray)

    p.add_argument("--trace", default=None, help="a JSONL workload (arrival_s, prompt_len, ...)")
    p.add_argument(
        "--rate",
        type=RATE,
        default=None,
        help=f"Poisson arrivals, requests/s (default {DEFAULT_RATE:g}); with --trace, its "
        "arrivals scaled to this mean rate",
    )
    p.add_argument(
        "--num-requests",
        type=POSITIVE,
        default=None,
        help=f"generated requests (default {DEFAULT_NUM_REQUESTS}; not with --trace)",
    )
    p.add_argument(
        "--shape",
        default=None,
        choices=sorted(SHAPES),
        help=f"the generated requests' lengths (default {DEFAULT_SHAPE}; not with --trace)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft-ms", type=MILLISECONDS, default=None, help="TTFT target (goodput)")
    p.add_argument("--slo-tpot-ms", type=MILLISECONDS, default=None, help="TPOT target (goodput)")


def cluster_config(args: argparse.Namespace) -> Any:
    """The ClusterConfig of ``--config``, or of ``--prefill/--decode/--both`` counts."""
    from cluster.config import ClusterConfig

    counts = (args.prefill, args.decode, args.both)
    if args.config is not None:
        if any(c is not None for c in counts):
            raise ValueError("--config and --prefill/--decode/--both: give one or the other")
        config = ClusterConfig.from_yaml(args.config)
    else:
        prefill, decode, both = (c or 0 for c in counts)
        if prefill + decode + both == 0:
            prefill, decode = 1, 1
        pools = [
            {"name": name, "role": name, "replicas": count}
            for name, count in (("prefill", prefill), ("decode", decode), ("both", both))
            if count
        ]
        config = ClusterConfig.model_validate({"pools": pools})
    knobs = {
        k: v
        for k, v in (
            ("max_num_batched_tokens", args.max_num_batched_tokens),
            ("max_num_seqs", args.max_num_seqs),
        )
        if v is not None
    }
    if knobs:
        data = config.model_dump()
        for pool in data["pools"]:
            pool["scheduler"] = {**pool["scheduler"], **knobs}
        config = ClusterConfig.model_validate(data)
    return config


def workload(args: argparse.Namespace, rate: float | None = None) -> Any:
    """The workload of the arguments; at ``rate`` instead of ``--rate`` (a trace's arrivals
    are scaled to that mean rate)."""
    from cluster.sim.workload import WorkItem, poisson, read_trace

    if args.trace is not None:
        if args.num_requests is not None or args.shape is not None:
            raise ValueError(
                "--num-requests and --shape describe a generated workload: a --trace has its "
                "own requests (--rate scales its arrivals)"
            )
        items = read_trace(args.trace)
        if not items:
            raise ValueError(f"{args.trace}: no requests in the trace")
        rate = args.rate if rate is None else rate
        if rate is None or len(items) < 2:
            return items
        span = items[-1].arrival_s - items[0].arrival_s
        scale = (len(items) - 1) / span / rate if span > 0 else 1.0
        return [
            WorkItem(
                i.arrival_s * scale,
                i.prompt_len,
                i.output_len,
                i.prefix_group,
                i.prefix_len,
                i.lora,
            )
            for i in items
        ]
    return poisson(
        rate or args.rate or DEFAULT_RATE,
        args.num_requests or DEFAULT_NUM_REQUESTS,
        args.shape or DEFAULT_SHAPE,
        args.seed,
    )


def slo(args: argparse.Namespace) -> Any:
    from cluster.sim.simulator import SLO

    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        return None
    ttft = math.inf if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000
    tpot = math.inf if args.slo_tpot_ms is None else args.slo_tpot_ms / 1000
    return SLO(ttft, tpot)


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"requests {summary['requests']}: {summary['finished']} finished, "
        f"{summary['errors']} refused or failed",
        f"simulated {summary['duration_s']:.1f} s in {summary['wall_s']:.2f} s "
        f"({summary['speedup']:.0f}x real time)",
        f"throughput {summary['throughput_tokens_s']:.0f} output tokens/s, "
        f"{summary['throughput_requests_s']:.2f} requests/s",
    ]
    for name in ("ttft", "tpot"):
        p50, p90, p99 = (summary[f"{name}_p{q}_s"] * 1000 for q in (50, 90, 99))
        lines.append(f"{name.upper():5} p50 {p50:8.1f} ms   p90 {p90:8.1f} ms   p99 {p99:8.1f} ms")
    if "slo_attainment" in summary:
        lines.append(
            f"SLO attainment {summary['slo_attainment']:.1%}, "
            f"goodput {summary['goodput_requests_s']:.2f} requests/s"
        )
    return "\n".join(lines)


def run_sim(args: argparse.Namespace) -> int:
    if args.sim_command == "calibrate":
        return _calibrate(args)
    from cluster.sim.cost import load_cost_model
    from cluster.sim.simulator import Simulation

    try:
        config = cluster_config(args)
        cost = load_cost_model(args.cost)
        simulation = Simulation(config, cost, args.instance_start_s)
        result = simulation.run(workload(args), slo(args), seed=args.seed)
    except (ValueError, OSError) as exc:
        print(f"tandem sim: {exc}", file=sys.stderr)
        return 2
    summary = result.summary()
    if args.json:
        print(json.dumps({"summary": summary, "instances": result.instances}, indent=2))
    else:
        print(format_summary(summary))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from cluster.sim.calibrate import UnusableModel, calibrate, measure_overhead

    overhead = args.step_overhead_ms / 1000
    if args.measure_overhead:
        overhead = measure_overhead()
        print(f"worker hop: {overhead * 1000:.2f} ms", file=sys.stderr)
    try:
        model = calibrate(
            args.model, args.threads, args.block_size, overhead, args.repeats, args.quantization
        )
    except UnusableModel as exc:  # (any other error of a measurement: a traceback, a bug)
        print(f"tandem sim calibrate: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(model.coefficients, indent=2)
    print(f"fitted {model.name}: {text}")
    print(
        f"step error: median {model.notes['median_relative_error']:.1%}, "
        f"p90 {model.notes['p90_relative_error']:.1%} over {model.notes['samples']} steps"
    )
    if "held_out_median_relative_error" in model.notes:
        print(
            f"step error on a scenario left out of the fit: median "
            f"{model.notes['held_out_median_relative_error']:.1%}, p90 "
            f"{model.notes['held_out_p90_relative_error']:.1%} over {model.notes['groups']} "
            "scenarios (the figures above are the fit's own steps)"
        )
    if args.out:
        model.save(args.out)
        print(f"written to {args.out}")
    return 0


def for_cost_model(base: Any, cost: Any, model: str | None) -> tuple[Any, str | None]:
    """``base`` to run what was planned -- ``model`` if given, and on a GPU each for a GPU
    cost model (``device: cuda``, ``num_gpus: 1`` unless the base asks for GPUs, and a pool
    with no KV size gets the memory the cost model gave it: ``memory_budget_bytes``, the
    GPU's HBM x its ``memory_utilization``, as vLLM's ``gpu_memory_utilization``; a worker
    left unsized takes a 1 GiB cache, some 50x less than a Llama-3-8B plan on an H100
    assumed) -- and a note when the plan assumed what Tandem's workers do not do (tensor
    parallelism)."""
    from cluster.sim.cost import RooflineCostModel

    data = base.model_dump()
    if model is not None:
        data["model"] = model
    note = None
    if isinstance(cost, RooflineCostModel):
        for pool in data["pools"]:
            pool["device"] = "cuda"
            pool["num_gpus"] = pool["num_gpus"] or 1.0
            sizes = ("num_blocks", "kv_cache_memory_bytes", "memory_budget_bytes")
            if all(pool[size] is None for size in sizes):
                pool["memory_budget_bytes"] = int(cost.gpu.hbm_bytes * cost.memory_utilization)
        if cost.tp > 1:
            note = (
                f"the plan assumed {cost.tp}-way tensor parallelism per instance; Tandem's "
                "workers run one GPU each (no tensor parallelism yet), so this config will "
                "not perform as planned"
            )
    return type(base).model_validate(data), note


def run_plan(args: argparse.Namespace) -> int:
    from cluster.config import ClusterConfig, default_cluster_config
    from cluster.sim.cost import load_cost_model
    from cluster.sim.planner import LONGER, Trial, config_yaml, plan

    target_slo = slo(args)
    if target_slo is None:
        print("tandem plan: give --slo-ttft-ms and/or --slo-tpot-ms", file=sys.stderr)
        return 2
    try:
        base = ClusterConfig.from_yaml(args.config) if args.config else default_cluster_config()
        cost = load_cost_model(args.cost)
        tokens = args.batched_tokens
        base, note = for_cost_model(base, cost, args.model)
        rate = args.rate or DEFAULT_RATE
        burst = False  # no span of arrivals: no rate to keep up with, no longer run
        if args.trace is not None:  # (a trace's line that is no work item: a ValueError)
            items = workload(args)  # (at --rate, when given)
            span = items[-1].arrival_s - items[0].arrival_s if len(items) > 1 else 0.0
            rate = (len(items) - 1) / span if span > 0 else 1.0
            burst = span <= 0
    except (ValueError, OSError) as exc:
        print(f"tandem plan: {exc}", file=sys.stderr)
        return 2
    longer = "" if burst else f"; the workload {LONGER} times over"

    def said(trial: Trial) -> None:
        s = trial.summary
        print(
            f"  {trial.candidate.label():55} attainment {s['slo_attainment']:6.1%}  "
            f"TTFT p90 {s['ttft_p90_s'] * 1000:8.1f} ms  TPOT p90 {s['tpot_p90_s'] * 1000:6.1f} ms",
            file=sys.stderr,
        )

    try:
        result = plan(
            base,
            cost,
            lambda r: workload(args, r),
            rate,
            target_slo,
            args.target,
            args.max_instances,
            tokens,
            not args.disaggregated_only,
            not args.colocated_only,
            args.seed,
            said,
        )
    except ValueError as exc:  # e.g. a token budget below a pool's max_num_seqs
        print(f"tandem plan: {exc}", file=sys.stderr)
        return 2
    for trial in result.trials:  # the ones that met the SLO, over the longer run
        if trial.sustained is not None:
            kept = "keeps up" if trial.keeps_up(args.target) else "does not keep up"
            print(
                f"  {trial.candidate.label():55} over {LONGER}x the workload: attainment "
                f"{trial.sustained['slo_attainment']:6.1%} ({kept})",
                file=sys.stderr,
            )
    if result.chosen is None or result.config is None:
        print(
            f"tandem plan: no cluster of up to {args.max_instances} instances meets the SLO "
            f"for {args.target:.0%} of the requests at {rate:g} requests/s"
            + ("" if burst else f" (and keeps up: over the workload served {LONGER} times over)"),
            file=sys.stderr,
        )
        return 1
    print(f"# {result.chosen.candidate.label()}: {cost.name}, {rate:g} requests/s")
    if note is not None:
        print(f"# NOTE: {note}")
        print(f"tandem plan: {note}", file=sys.stderr)
    print(f"# predicted goodput curve (rate req/s: SLO attainment, goodput req/s{longer}):")
    for point in result.curve:
        print(f"#   {point['rate']:8.2f}: {point['attainment']:6.1%}  {point['goodput']:8.2f}")
    text = config_yaml(result.config)
    print(text, end="")
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(text)
    return 0
