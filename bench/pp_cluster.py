"""Pipeline parallelism and async scheduling on one node: PP=1 vs PP=2 throughput with several
requests in flight, async scheduling on vs off, and the in-flight depth each reached.

SmolLM2 (built-in) on a one-node Ray cluster on 127.0.0.1 (``ray.cluster_utils.Cluster``).
One colocated instance (role ``both``) per configuration, every configuration given the same
torch threads in all:

- ``a``: PP=1, one worker with 2 threads, sync scheduling (the reference of the ratios);
- ``b``: PP=1, one worker with 2 threads, ``async_scheduling`` (2 steps in flight);
- ``c``: PP=2, two stage workers with 1 thread each, both on the node (2 micro-batches);
- ``d``: PP=1, one worker with 1 thread (information: what one core does alone).

Each configuration is a fresh cluster (fresh counters); all are up side by side and the levels
interleave them (rotating order per level), so that a slow phase of the host hits them alike.
Each (configuration, concurrency c) runs a closed loop: N requests, c in flight at once, each a
distinct prompt of 64-128 tokens (seeded, the same for every configuration), greedy,
``max_tokens`` new tokens with EOS ignored; one short warm-up request first. tok/s = output
tokens / wall time; TTFT = submit -> first token; TPOT = (finish - first token) / (n - 1).

From the instance's counters (``ClusterClient.stats()``), taken around each measured run:

- mean in flight: steps in flight right after each step started, averaged over the run's steps;
- max in flight: the most steps in flight at once since the cluster started (levels run in
  increasing concurrency, so this is the depth reached up to that level);
- tok/step: tokens computed (prompt + decode inputs) per step;
- stage busy: each worker's time inside ``execute_model`` / wall time (1.0 = never idle);
- CPU s/s: CPU seconds per wall second of the workers, the SchedulerActor and this driver
  (from ``/proc``; the host has few cores, so they compete with each other and with the model).

    python -m bench.pp_cluster              # c = 1 8 32; configurations a b c d
    python -m bench.pp_cluster --quick      # smoke test: c = 1 8, few requests
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from bench.pd_cluster import make_prompts
from bench.pd_common import (
    BLOCK_SIZE,
    cluster_runner,
    latency_stats,
    median_or_none,
    tandem_cluster,
)

INSTANCE = "pp-0"  # the one instance of every configuration (pool "pp")
# name -> (label, pp_size, torch threads per worker, async scheduling)
CONFIGS: dict[str, tuple[str, int, int, bool]] = {
    "a": ("PP=1 2thr sync", 1, 2, False),
    "b": ("PP=1 2thr async", 1, 2, True),
    "c": ("PP=2 1thr/stage", 2, 1, False),
    "d": ("PP=1 1thr sync", 1, 1, False),
}
SUMMARY_KEYS = (
    "tok_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "mean_in_flight",
    "max_in_flight",
    "tokens_per_step",
)


# -- the Ray node and the clusters ---------------------------------------------------------------
@contextmanager
def ray_node(num_cpus: int, object_store_bytes: int) -> Iterator[None]:
    """One Ray node on loopback, connected; shut down on the way out, whatever happened."""
    import ray
    from ray.cluster_utils import Cluster

    from cluster.control.launch import DEFAULT_NAMESPACE

    cluster: Any = Cluster(
        initialize_head=True,
        head_node_args={
            "node_ip_address": "127.0.0.1",
            "num_cpus": num_cpus,
            "object_store_memory": object_store_bytes,
            "include_dashboard": False,
        },
    )
    try:
        ray.init(
            address=cluster.address,
            _node_ip_address="127.0.0.1",
            namespace=DEFAULT_NAMESPACE,
            log_to_driver=False,
        )
        yield
    finally:
        ray.shutdown()
        cluster.shutdown()


def cluster_config(args: argparse.Namespace, name: str, num_blocks: int) -> Any:
    from cluster.config import ClusterConfig, InstancePool

    _, pp_size, threads, async_scheduling = CONFIGS[name]
    pool = InstancePool(
        name="pp",
        role="both",
        pp_size=pp_size,
        num_threads=threads,
        num_blocks=num_blocks,
        scheduler={"async_scheduling": async_scheduling},
    )
    return ClusterConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=BLOCK_SIZE,
        max_model_len=args.max_prompt_tokens + args.max_tokens + BLOCK_SIZE,
        pools=[pool],
        router={"disaggregation": "never"},
    )


# -- counters around a run -----------------------------------------------------------------------
def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a process of this host (Linux ``/proc``), else None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def actor_pid(handle: Any) -> int | None:
    import ray

    try:
        return int(ray.get(handle.__ray_call__.remote(lambda _self: os.getpid()), timeout=30))
    except Exception:  # an older Ray without __ray_call__: no CPU figure for the actor
        return None


def snapshot(client: Any, handle: Any, pids: dict[str, int | None]) -> dict[str, Any]:
    import ray

    health = ray.get(handle.worker_health.remote())[INSTANCE]["stages"]
    return {
        "t": time.perf_counter(),
        "loop": client.stats()["instances"][INSTANCE],
        "stages": [(s["num_steps"], s["step_seconds"]) for s in health],
        "cpu": {role: cpu_seconds(pid) for role, pid in pids.items()},
        "driver_cpu": time.process_time(),
    }


def counter_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the instance did between two snapshots."""
    b, a = before["loop"], after["loop"]
    steps = a["num_steps"] - b["num_steps"]
    in_flight = a["mean_in_flight"] * a["num_steps"] - b["mean_in_flight"] * b["num_steps"]
    computed = (
        a["num_prompt_tokens_computed"]
        + a["num_output_tokens_computed"]
        - b["num_prompt_tokens_computed"]
        - b["num_output_tokens_computed"]
    )
    wall = after["t"] - before["t"]
    stage_busy, stage_step_ms = [], []
    for (n0, s0), (n1, s1) in zip(before["stages"], after["stages"], strict=True):
        stage_busy.append((s1 - s0) / wall)
        stage_step_ms.append((s1 - s0) / (n1 - n0) * 1e3 if n1 > n0 else None)
    cpu: dict[str, float | None] = {}
    for role, c1 in after["cpu"].items():
        c0 = before["cpu"][role]
        cpu[role] = None if c0 is None or c1 is None else (c1 - c0) / wall
    cpu["driver"] = (after["driver_cpu"] - before["driver_cpu"]) / wall
    return {
        "steps": steps,
        "mean_in_flight": in_flight / steps if steps else None,
        "max_in_flight": a["max_in_flight"],
        "tokens_per_step": computed / steps if steps else None,
        "stage_busy": stage_busy,
        "stage_step_ms": stage_step_ms,
        "cpu_per_s": cpu,
    }


# -- the runs ------------------------------------------------------------------------------------
def prompt_lengths(args: argparse.Namespace, c: int, n: int) -> list[int]:
    rng = random.Random(1000 * c + n)
    return [rng.randint(args.min_prompt_tokens, args.max_prompt_tokens) for _ in range(n)]


def run_levels(args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    """Build every configuration's cluster, run every (concurrency, repeat) cell with the
    configurations in rotating order, shut the clusters down."""
    import ray

    from cluster.control.client import ClusterClient
    from scheduler import SamplingParams

    per_request = -(-(args.max_prompt_tokens + args.max_tokens) // BLOCK_SIZE)
    num_blocks = max(args.concurrency) * per_request * 5 // 4 + 16
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    warm_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    with ExitStack() as stack:
        handles, clients, pids, placement = {}, {}, {}, {}
        for name in args.configs:
            config = cluster_config(args, name, num_blocks)
            handles[name] = stack.enter_context(tandem_cluster(config, f"bench-pp-{name}"))
            clients[name] = ClusterClient(handles[name], tokenizer)
            stages = ray.get(handles[name].worker_health.remote())[INSTANCE]["stages"]
            placement[name] = [{"node_id": s["node_id"], "pid": s["pid"]} for s in stages]
            pids[name] = {f"stage{i}": s["pid"] for i, s in enumerate(stages)}
            pids[name]["scheduler"] = actor_pid(handles[name])
        info = clients[args.configs[0]].info
        print(setup_line(args, info, num_blocks, placement), flush=True)
        for li, c in enumerate(args.concurrency):
            n = requests_at(args, c)
            lengths = prompt_lengths(args, c, n)
            for rep in range(args.repeat):
                k = (li + rep) % len(args.configs)
                for name in args.configs[k:] + args.configs[:k]:
                    tag = f"{name}-c{c}-r{rep}"
                    ids = [f"{tag}-{i}" for i in range(n)]
                    # The prompt text is the same for every configuration (only the id differs).
                    prompts = [
                        make_prompts(tokenizer, [f"c{c}-r{rep}-{i}"], length)[0]
                        for i, length in enumerate(lengths)
                    ]
                    warm = make_prompts(tokenizer, [f"{tag}-w"], args.min_prompt_tokens)
                    cluster_runner(clients[name], warm_params)(warm, [f"{tag}-w"], 1)
                    before = snapshot(clients[name], handles[name], pids[name])
                    wall, samples = cluster_runner(clients[name], params)(prompts, ids, c)
                    after = snapshot(clients[name], handles[name], pids[name])
                    row = {
                        "config": name,
                        "label": CONFIGS[name][0],
                        "concurrency": c,
                        "rep": rep,
                        **latency_stats(wall, samples),
                        **counter_deltas(before, after),
                    }
                    rows.append(row)
                    print(progress_line(row), flush=True)
    return {"info": info, "num_blocks": num_blocks, "placement": placement, "rows": rows}


def requests_at(args: argparse.Namespace, c: int) -> int:
    if args.requests_per_level:
        return args.requests_per_level
    return max(2 * c, 4) if not args.quick else max(c, 2)


# -- summary and report --------------------------------------------------------------------------
def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (configuration, concurrency): medians over repeats, and ratios against
    configuration ``a`` at the same concurrency."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault((row["config"], row["concurrency"]), []).append(row)
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for (name, c), runs in cells.items():
        cell: dict[str, Any] = {
            "config": name,
            "label": CONFIGS[name][0],
            "concurrency": c,
            "runs": len(runs),
            "requests": runs[0]["requests"],
        }
        for key in SUMMARY_KEYS:
            cell[key] = median_or_none([r[key] for r in runs if r[key] is not None])
        for key in ("stage_busy", "stage_step_ms"):
            per_stage = zip(*(r[key] for r in runs), strict=True)
            cell[key] = [median_or_none([v for v in vs if v is not None]) for vs in per_stage]
        cell["cpu_per_s"] = {
            role: median_or_none([v for r in runs if (v := r["cpu_per_s"][role]) is not None])
            for role in runs[0]["cpu_per_s"]
        }
        out[(name, c)] = cell
    for (_, c), cell in out.items():
        ref = out.get(("a", c))
        cell["vs_a"] = None if ref is None else _ratios(cell, ref)
    return sorted(out.values(), key=lambda r: (r["concurrency"], r["config"]))


def _ratios(cell: dict[str, Any], ref: dict[str, Any]) -> dict[str, float | None]:
    def ratio(key: str) -> float | None:
        return cell[key] / ref[key] if cell[key] and ref[key] else None

    return {
        "tok_s": ratio("tok_s"),
        "ttft_p50": ratio("ttft_p50_s"),
        "tpot_p50": ratio("tpot_p50_s"),
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _num(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def print_table(summary: list[dict[str, Any]]) -> None:
    print(
        "\n| config | conc | reqs | tok/s | tok/s vs a | TTFT p50 ms | TTFT p99 ms "
        "| TPOT p50 ms | TPOT p99 ms | TPOT vs a | in flight mean | max | tok/step "
        "| stage busy | CPU s/s (stages, sched, driver) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in summary:
        vs = r["vs_a"] or {}
        cpu = r["cpu_per_s"]
        stages = "+".join(_num(v) for k, v in cpu.items() if k.startswith("stage"))
        print(
            f"| {r['config']}: {r['label']} | {r['concurrency']} | {r['requests']} "
            f"| {r['tok_s']:.1f} | {_num(vs.get('tok_s'))}x "
            f"| {_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p99_s'])} "
            f"| {_ms(r['tpot_p50_s'])} | {_ms(r['tpot_p99_s'])} | {_num(vs.get('tpot_p50'))}x "
            f"| {_num(r['mean_in_flight'])} | {_num(r['max_in_flight'], '.0f')} "
            f"| {_num(r['tokens_per_step'], '.1f')} "
            f"| {' / '.join(_num(b) for b in r['stage_busy'])} "
            f"| {stages}, {_num(cpu.get('scheduler'))}, {_num(cpu.get('driver'))} |"
        )


def setup_line(
    args: argparse.Namespace, info: dict[str, Any], num_blocks: int, placement: dict[str, Any]
) -> str:
    nodes = {s["node_id"] for stages in placement.values() for s in stages}
    configs = "; ".join(f"{n}: {CONFIGS[n][0]}" for n in args.configs)
    return (
        f"model dtype {info['dtype']} (--dtype {args.dtype}); prompts "
        f"{args.min_prompt_tokens}-{args.max_prompt_tokens} tokens, {args.max_tokens} new "
        f"(greedy, EOS ignored); {num_blocks} KV blocks per worker; {os.cpu_count()} cores; "
        f"{len(nodes)} Ray node(s)\n{configs}"
    )


def progress_line(row: dict[str, Any]) -> str:
    busy = "/".join(_num(b) for b in row["stage_busy"])
    return (
        f"{row['config']} {row['label']:16} c={row['concurrency']:<3} rep={row['rep']} "
        f"{row['requests']} reqs {row['tok_s']:.1f} tok/s  TTFT p50 {_ms(row['ttft_p50_s'])} ms  "
        f"TPOT p50 {_ms(row['tpot_p50_s'])} ms  in flight {_num(row['mean_in_flight'])} "
        f"(max {row['max_in_flight']})  busy {busy}"
    )


# -- main ----------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=None)
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="default: 1 8 32")
    ap.add_argument(
        "--requests-per-level", type=int, default=None, help="default: max(2c, 4) per level"
    )
    ap.add_argument("--min-prompt-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", help="auto, float32, bfloat16")
    ap.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    ap.add_argument("--repeat", type=int, default=1, help="runs per cell; medians are kept")
    ap.add_argument("--quick", action="store_true", help="smoke test: c = 1 8, max(c, 2) requests")
    ap.add_argument("--out", default=None, help="default: bench/results/pp_cluster[_quick].json")
    args = ap.parse_args()
    if args.quick:
        args.concurrency = args.concurrency or [1, 8]
    args.concurrency = sorted(set(args.concurrency or [1, 8, 32]))
    args.configs = list(dict.fromkeys(args.configs or sorted(CONFIGS)))
    args.out = args.out or f"bench/results/pp_cluster{'_quick' if args.quick else ''}.json"
    if min(args.concurrency) < 1 or args.max_tokens < 2 or args.repeat < 1:
        ap.error("concurrency and --repeat must be >= 1, --max-tokens >= 2")
    if not 1 <= args.min_prompt_tokens <= args.max_prompt_tokens:
        ap.error("need 1 <= --min-prompt-tokens <= --max-prompt-tokens")
    return args


def main() -> None:
    args = parse_args()
    from cluster.control.launch import ray_env_defaults

    ray_env_defaults()
    os.environ.setdefault("RAY_TMPDIR", str(Path(tempfile.gettempdir()) / "tandem-pp-bench"))

    import ray
    import torch

    from actors.model.loader import resolve_model_path
    from actors.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(resolve_model_path(args.model))
    started = time.perf_counter()
    with ray_node(num_cpus=os.cpu_count() or 1, object_store_bytes=128 * 2**20):
        levels = run_levels(args, tokenizer)
    summary = summarize(levels["rows"])
    print_table(summary)
    info = levels["info"]
    meta = {
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "dtype": info["dtype"],
        "args": vars(args),
        "configs": {
            n: dict(zip(("label", "pp_size", "threads", "async"), CONFIGS[n], strict=True))
            for n in args.configs
        },
        "num_blocks_per_worker": levels["num_blocks"],
        "placement": levels["placement"],
        "seconds": time.perf_counter() - started,
        "metrics": {
            "tok_s": "output tokens / wall time of the run",
            "mean_in_flight": "steps in flight right after each step started, mean over the run",
            "max_in_flight": "most steps in flight at once since the cluster started",
            "tokens_per_step": "tokens computed (prompt + decode inputs) / steps",
            "stage_busy": "per worker: time in execute_model / wall time",
            "cpu_per_s": "CPU seconds per wall second: workers, SchedulerActor, this driver",
            "vs_a": "ratio to configuration a at the same concurrency, same run",
        },
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "runs": levels["rows"], "summary": summary}, indent=2))
    print(f"\nwrote {out} ({meta['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
