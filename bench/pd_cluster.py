"""Colocated vs disaggregated serving on a 3-node Ray cluster on this machine, and a KV transfer
sweep, in one run.

SmolLM2 (built-in) on ``ray.cluster_utils.Cluster``: a head, a node offering ``{"prefill": 1}``
and one offering ``{"decode": 1}``, all on 127.0.0.1.

**Levels.** Three contenders, alive side by side and interleaved (rotating order per level) so
that a slow phase of the host hits them alike:

- ``llm``: the in-process ``LLM`` engine (baseline, at the highest concurrency only);
- ``colocated``: a cluster with one ``both`` instance (on the decode node, 2 torch threads);
- ``disaggregated``: one ``prefill`` + one ``decode`` instance on different nodes
  (``router.disaggregation: always``, 1 torch thread each: two workers on two cores).

Each (mode, concurrency c) runs a closed loop: N requests, c in flight at once, each a distinct
prompt of a fixed token count (a fixed text behind a per-request tag, so no prefix is shared),
greedy, ``max_tokens`` with EOS ignored. One warm-up request first. tok/s = output tokens / wall
time; TTFT = submit -> first token; TPOT = (finish - first token) / (n - 1).

**Transfer sweep.** One prefill + one decode instance, first on the same Ray node (the target:
transfer >= 25% of memcpy bandwidth on one node), then on different nodes (information). After a
warm-up that pushes at least the object store's size of KV through (the store's pages are slow
on first touch), requests of each ``--sweep-prompt-tokens`` length go one at a time
(``max_tokens=2``, EOS ignored), lengths interleaved.

KV transfer, from the workers' ``TransferRecord``s joined by request id:

- transfer time = save + load, as the workers' ``TransferRecord``s time them, and so per
  transport (``--kv-transport``; the default ``auto`` is ``nixl`` where it imports, else
  ``ray``; the run records which): ``ray`` -- save copy (gather the blocks + ``ray.put``) + load
  copy (``ray.get`` + write into the blocks), two copies, so a memcpy-bound path peaks near
  0.5x memcpy; ``nixl`` -- a lease + the load end to end (READ posted, or the same-node copy,
  to the blocks usable, as the decode worker polls: once per step under load), one copy;
- load e2e = the decode worker's fetch start -> data in its blocks (includes waiting for the
  step in progress);
- per request: bytes / transfer time; aggregate: total bytes / the union of the saves' and
  loads' [start, start + copy seconds] intervals, and total bytes / wall time of the run;
- memcpy: ``np.copyto`` of the same byte count into a preallocated, pre-touched array in this
  process (best and median), plus a fresh allocation + copy and a copy into fresh pages.

    python -m bench.pd_cluster                  # levels c=1 8 32 + sweep 128 512 2048 tokens
    python -m bench.pd_cluster --only sweep     # the transfer sweep alone
    python -m bench.pd_cluster --quick          # smoke test: c=1 2, 4 requests; sweep 256 x 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.pd_common import (
    BLOCK_SIZE,
    RunFn,
    cluster_configs,
    cluster_runner,
    latency_stats,
    llm_runner,
    median_or_none,
    pair_transfers,
    pd_pools,
    ray_cluster,
    tandem_cluster,
    transfer_stats,
)
from bench.pd_report import (
    levels_report,
    mib,
    pd_distinct,
    progress_line,
    setup_line,
    sweep_report,
    where_line,
)

BASE_TEXT = (
    "The history of computing is a story of layers. Each generation of engineers builds on "
    "the abstractions of the last: transistors become gates, gates become processors, and "
    "processors run operating systems that host languages, libraries and services. "
)
# Sweep placements -> the resource the prefill pool asks for (decode always asks for "decode").
PLACEMENTS = {"same-node": "decode", "cross-node": "prefill"}


def make_prompts(tokenizer: Any, tags: list[str], length: int) -> list[list[int]]:
    """One prompt of exactly ``length`` tokens per tag; the tag leads, so no two share a block."""
    prompts = []
    for tag in tags:
        repeats = 1
        while len(ids := tokenizer.encode(f"Request {tag}. " + BASE_TEXT * repeats)) < length:
            repeats *= 2
        prompts.append(ids[:length])
    return prompts


# -- levels: colocated vs disaggregated ----------------------------------------------------------
def run_levels_phase(args: argparse.Namespace, tokenizer: Any, labels: dict[str, str]) -> Any:
    """Build the colocated and disaggregated clusters and the in-process LLM, run every level,
    shut the clusters down. Returns what the report needs."""
    import ray
    import torch

    from cluster.control.client import ClusterClient
    from cluster.engine.llm import LLM
    from scheduler import SamplingParams

    per_request = -(-(args.prompt_tokens + args.max_tokens) // BLOCK_SIZE)
    num_blocks = args.num_blocks or max(args.concurrency) * per_request * 5 // 4 + 16
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    with ExitStack() as stack:
        handles = {
            mode: stack.enter_context(tandem_cluster(config, f"bench-pd-{mode}"))
            for mode, config in cluster_configs(args, num_blocks).items()
        }
        described = {m: ray.get(h.describe.remote()) for m, h in handles.items()}
        info = ClusterClient(handles["colocated"], tokenizer).info
        runners: dict[str, RunFn] = {
            m: cluster_runner(ClusterClient(h, tokenizer), params) for m, h in handles.items()
        }
        torch.set_num_threads(args.colocated_threads)  # the baseline gets the colocated budget
        llm = LLM(
            args.model,
            dtype=args.dtype,
            block_size=BLOCK_SIZE,
            num_blocks=num_blocks,
            progress=False,
        )
        runners["llm"] = llm_runner(llm, params)
        print(setup_line(args, info, num_blocks, described, labels), flush=True)
        rows, pairs = run_levels(args, runners, handles, tokenizer)
    return {
        "info": info,
        "num_blocks": num_blocks,
        "described": described,
        "rows": rows,
        "pairs": pairs,
    }


def run_levels(
    args: argparse.Namespace, runners: dict[str, RunFn], handles: dict[str, Any], tokenizer: Any
) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """Every (concurrency, repeat) cell, the modes in rotating order; one warm-up request each.
    Returns the runs' rows and the disaggregated runs' transfers by "c{c}-r{rep}"."""
    import ray

    top = max(args.concurrency)
    rows: list[dict[str, Any]] = []
    pairs: dict[str, list[dict[str, Any]]] = {}
    for li, c in enumerate(args.concurrency):
        n = args.requests_per_level or max(2 * c, 8)
        modes = ["colocated", "disaggregated"] + (["llm"] if c == top else [])
        for rep in range(args.repeat):
            k = (li + rep) % len(modes)
            for mode in modes[k:] + modes[:k]:
                tag = f"{mode[:3]}-c{c}-r{rep}"
                ids = [f"{tag}-{i}" for i in range(n)]
                prompts = make_prompts(tokenizer, [f"{tag}-w", *ids], args.prompt_tokens)
                runners[mode](prompts[:1], [f"{tag}-w"], 1)  # warm-up
                wall, samples = runners[mode](prompts[1:], ids, c)
                row = {"mode": mode, "concurrency": c, "rep": rep, **latency_stats(wall, samples)}
                if mode == "disaggregated":
                    history = ray.get(handles[mode].transfer_history.remote())
                    mine = pair_transfers(history, set(ids))
                    pairs[f"c{c}-r{rep}"] = mine
                    row["transfer"] = transfer_stats(mine, wall)
                rows.append(row)
                print(progress_line(row), flush=True)
    return rows, pairs


# -- the transfer sweep ----------------------------------------------------------------------
def run_sweep_phase(
    args: argparse.Namespace, tokenizer: Any, labels: dict[str, str], placement: str
) -> dict[str, Any]:
    """One prefill + one decode instance placed per ``placement``: warm-up, then
    ``--sweep-requests`` rounds of one request per length, one at a time."""
    import ray

    from cluster.config import ClusterConfig
    from cluster.control.client import ClusterClient
    from scheduler import SamplingParams

    lengths = args.sweep_prompt_tokens
    num_blocks = 2 * -(-(max(lengths) + 2) // BLOCK_SIZE) + 16  # two of the longest + slack
    config = ClusterConfig(
        model=args.model,
        dtype=args.dtype,
        block_size=BLOCK_SIZE,
        pools=pd_pools(num_blocks, args.sweep_threads, PLACEMENTS[placement]),
        router={"disaggregation": "always"},
        kv_transfer={"transport": args.kv_transport},
    )
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    ids: dict[int, list[str]] = {length: [] for length in lengths}
    with tandem_cluster(config, f"bench-pd-sweep-{placement}") as handle:
        described = ray.get(handle.describe.remote())
        client = ClusterClient(handle, tokenizer)
        run = cluster_runner(client, params)
        where = where_line(described, labels)
        print(f"\nsweep {placement}: {where}; {num_blocks} KV blocks per worker", flush=True)
        # Warm-up: at least the object store's size of KV through the real put/get path, so
        # that both workers have touched the store's pages (first touch is ~2x slower).
        per_request = -(-max(lengths) // BLOCK_SIZE) * int(client.info["bytes_per_block"])
        warm_ids = [
            f"sw-{placement}-warm-{i}"
            for i in range(-(-args.object_store_mb * 2**20 // per_request))
        ]
        warm_s, _ = run(make_prompts(tokenizer, warm_ids, max(lengths)), warm_ids, 1)
        for i in range(args.sweep_requests):
            for length in lengths:  # interleaved: a slow phase of the host hits every length
                rid = f"sw-{placement}-{length}-{i}"
                run(make_prompts(tokenizer, [rid], length), [rid], 1)
                ids[length].append(rid)
        history = ray.get(handle.transfer_history.remote())
    warm = pair_transfers(history, set(warm_ids))
    warm_bw = [p["bytes"] / p["transfer_s"] for p in warm if p["ok"]]
    result = {
        "placement": placement,
        "where": where,
        "pd_same_node": not pd_distinct(described),
        "kv_transport": described.get("kv_transport"),  # (auto resolved)
        "num_blocks_per_worker": num_blocks,
        "info": client.info,
        "warmup": {
            "prompt_tokens": max(lengths),
            "requests": len(warm_ids),
            "bytes": sum(p["bytes"] for p in warm if p["ok"]),
            "seconds": warm_s,
            # per-request bandwidth, median of the first and of the second half
            "bw_first_half": median_or_none(warm_bw[: len(warm_bw) // 2]),
            "bw_second_half": median_or_none(warm_bw[len(warm_bw) // 2 :]),
            "pairs": warm,
        },
        "pairs": {length: pair_transfers(history, set(rids)) for length, rids in ids.items()},
    }
    w = result["warmup"]
    print(
        f"warm-up: {w['requests']} x {w['prompt_tokens']} tokens, {mib(w['bytes'])} MiB in "
        f"{w['seconds']:.1f} s; per request p50 {mib(w['bw_first_half'])} MiB/s in the first "
        f"half, {mib(w['bw_second_half'])} MiB/s in the second",
        flush=True,
    )
    return result


# -- main ----------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", choices=["levels", "sweep"], default=None, help="default: both")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="default: 1 8 32")
    ap.add_argument(
        "--requests-per-level", type=int, default=None, help="default: max(2c, 8) per level"
    )
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=None, help="default: 64")
    ap.add_argument("--dtype", default="auto", help="auto (the cluster default), float32, bfloat16")
    ap.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    ap.add_argument("--repeat", type=int, default=1, help="runs per cell; medians are kept")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV blocks per worker (levels)")
    ap.add_argument("--colocated-threads", type=int, default=2)
    ap.add_argument("--pd-threads", type=int, default=1, help="per prefill / decode worker")
    ap.add_argument(
        "--kv-transport",
        choices=["auto", "nixl", "ray", "grpc"],
        default="auto",
        help="the P/D clusters' KV transport (auto: nixl where it imports, else ray)",
    )
    ap.add_argument(
        "--sweep-prompt-tokens", type=int, nargs="+", default=None, help="default: 128 512 2048"
    )
    ap.add_argument("--sweep-requests", type=int, default=None, help="per length; default 6")
    ap.add_argument("--sweep-threads", type=int, default=1, help="per sweep worker")
    ap.add_argument(
        "--object-store-mb", type=int, default=256, help="per Ray node (= sweep warm-up volume)"
    )
    ap.add_argument("--quick", action="store_true", help="c=1 2, 4 requests, 16 new; sweep 256x2")
    ap.add_argument("--out", default=None, help="default: bench/results/pd_cluster[_quick].json")
    args = ap.parse_args()
    if args.quick:
        args.concurrency = args.concurrency or [1, 2]
        args.requests_per_level = args.requests_per_level or 4
        args.max_tokens = args.max_tokens or 16
        args.sweep_prompt_tokens = args.sweep_prompt_tokens or [256]
        args.sweep_requests = args.sweep_requests or 2
    args.concurrency = sorted(set(args.concurrency or [1, 8, 32]))
    args.max_tokens = args.max_tokens or 64
    args.sweep_prompt_tokens = sorted(set(args.sweep_prompt_tokens or [128, 512, 2048]))
    args.sweep_requests = args.sweep_requests or 6
    args.out = args.out or f"bench/results/pd_cluster{'_quick' if args.quick else ''}.json"
    if min(args.concurrency) < 1 or args.prompt_tokens < 1 or args.max_tokens < 2:
        ap.error("concurrency and --prompt-tokens must be >= 1, --max-tokens >= 2")
    if min(args.sweep_prompt_tokens) < 1 or args.sweep_requests < 1:
        ap.error("--sweep-prompt-tokens and --sweep-requests must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    from cluster.control.launch import ray_env_defaults

    ray_env_defaults()
    os.environ.setdefault("RAY_TMPDIR", str(Path(tempfile.gettempdir()) / "tandem-pd-bench"))

    import ray
    import torch

    from actors.model.loader import resolve_model_path
    from actors.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_path(resolve_model_path(args.model))
    levels: dict[str, Any] | None = None
    sweeps: list[dict[str, Any]] = []
    with ray_cluster(args.object_store_mb * 2**20) as labels:
        if args.only != "sweep":
            levels = run_levels_phase(args, tokenizer, labels)
        if args.only != "levels":
            sweeps = [run_sweep_phase(args, tokenizer, labels, p) for p in PLACEMENTS]

    # memcpy references, measured with Ray down (one less source of noise)
    report: dict[str, Any] = {}
    if levels is not None:
        report.update(levels_report(args, levels))
    if sweeps:
        report["sweep"] = sweep_report(sweeps)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = (levels or sweeps[0])["info"]
    meta = {
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "ray": ray.__version__,
        "dtype": info["dtype"],
        "dtype_arg": args.dtype,
        "kv_transport_arg": args.kv_transport,  # (each phase records it resolved)
        "bytes_per_block": info["bytes_per_block"],
        "object_store_mb_per_node": args.object_store_mb,
        "node_labels": labels,
        "args": vars(args),
        "metrics": {
            "tok_s": "output tokens / wall time of the run",
            "transfer_s": "save + load copy seconds of the transport's TransferRecords (ray: "
            "gather + ray.put, ray.get + write; nixl: lease, READ posted -> seen done)",
            "load_e2e_s": "decode side: load start -> in the blocks (includes waiting)",
            "per_request_bw": "bytes / transfer_s",
            "aggregate_bw_busy": "bytes / union of the saves' and loads' copy intervals",
            "aggregate_bw_wall": "bytes / wall time of the run",
            "ratio": "per-request bw p50 / memcpy (np.copyto, preallocated, best)",
        },
    }
    out.write_text(json.dumps({"meta": meta, **report}, indent=2, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
