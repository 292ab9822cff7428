"""Reporting for ``bench/pd_cluster.py``: per-cell summaries, the verdicts against the targets,
the sweep rows, and the tables and progress lines it prints."""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from bench.pd_common import BLOCK_SIZE, median_or_none, memcpy_bandwidth, transfer_stats

TRANSFER_TARGET = 0.25  # of memcpy bandwidth, on one node
COLOCATED_TARGET = 0.8  # of in-process LLM throughput


def transfer_note(transport: str | None) -> str:
    """What a transfer is for ``transport`` (the workers' ``TransferRecord``s), and where a
    memcpy-bound path would peak against one memcpy of the same bytes."""
    if transport == "ray":
        return (
            "ray: a transfer is two copies (gather + ray.put, ray.get + write into the blocks): "
            "a memcpy-bound path peaks near 0.5."
        )
    if transport == "nixl":
        return (
            "nixl: a transfer is a lease + one copy straight into the blocks (a READ, or the "
            "same-node copy), its load timed end to end as the decode worker polls (once per "
            "step under load): a memcpy-bound path peaks near 1.0."
        )
    if transport == "grpc":
        return (
            "grpc: a transfer is a lease + a pull (the source serializes, the socket copies) "
            "+ the write into the blocks: several copies, below 0.5."
        )
    return f"transport {transport!r} not recorded: what a transfer is is unknown."


# -- the phases' reports (print, and return the JSON part) -----------------------------------------
def levels_report(args: argparse.Namespace, levels: dict[str, Any]) -> dict[str, Any]:
    """Print the levels' tables and targets; returns their JSON part."""
    info = levels["info"]
    ok_bytes = [p["bytes"] for ps in levels["pairs"].values() for p in ps if p["ok"]]
    expected = -(-args.prompt_tokens // BLOCK_SIZE) * int(info["bytes_per_block"])
    memcpy = memcpy_bandwidth(int(statistics.median(ok_bytes)) if ok_bytes else expected)
    summary = _summarize(levels["rows"])
    verdicts = _verdicts(summary, memcpy, max(args.concurrency))
    _print_tables(summary, memcpy, verdicts)
    print(transfer_note(levels["described"]["disaggregated"].get("kv_transport")))
    return {
        "levels": {
            "kv_transport": levels["described"]["disaggregated"].get("kv_transport"),
            "num_blocks_per_worker": levels["num_blocks"],
            "expected_kv_bytes_per_request": expected,
            "instances": levels["described"],
            "pd_on_distinct_nodes": pd_distinct(levels["described"]["disaggregated"]),
            "runs": levels["rows"],
            "summary": summary,
            "memcpy": memcpy,
            "verdicts": verdicts,
            "transfers": levels["pairs"],
        }
    }


def sweep_report(sweeps: list[dict[str, Any]]) -> dict[str, Any]:
    """memcpy of each byte count, the sweep tables and the verdicts; returns the JSON part."""
    stats = [transfer_stats(ps, None) for sw in sweeps for ps in sw["pairs"].values()]
    sizes = {int(s["bytes_p50"]) for s in stats if s["bytes_p50"]}
    memcpy = {n: memcpy_bandwidth(n, min_time_s=0.2, min_iters=10) for n in sorted(sizes)}
    result = {}
    for sw in sweeps:
        rows = sweep_table(sw, memcpy)
        _print_sweep(sw, rows)
        result[sw["placement"]] = {k: v for k, v in sw.items() if k != "pairs"} | {
            "rows": rows,
            "pairs": {str(k): v for k, v in sw["pairs"].items()},
        }
    return result


def sweep_table(sweep: dict[str, Any], memcpy: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per prompt length: transfer stats, memcpy of the same byte count, the ratio and
    (on one node) the verdict."""
    rows = []
    for length, pairs in sweep["pairs"].items():
        stats = transfer_stats(pairs, None)
        ref = memcpy.get(int(stats["bytes_p50"] or 0))
        bw = stats["per_request_bw_p50"]
        ratio = bw / ref["prealloc_best_bw"] if bw and ref else None
        met = None if ratio is None or not sweep["pd_same_node"] else ratio >= TRANSFER_TARGET
        rows.append({"prompt_tokens": length, **stats, "memcpy": ref, "ratio": ratio, "met": met})
    return rows


# -- summaries and verdicts ------------------------------------------------------------------------
def _summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mode, concurrency): medians over repeats (the single run when repeat=1)."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        cells.setdefault((row["mode"], row["concurrency"]), []).append(row)
    out = []
    for (mode, c), runs in cells.items():
        cell: dict[str, Any] = {"mode": mode, "concurrency": c, "runs": len(runs)}
        for key in ("requests", "tok_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
            values = [r[key] for r in runs if r[key] is not None]
            cell[key] = median_or_none(values)
        if "transfer" in runs[0]:
            cell["transfer"] = {}
            for key in runs[0]["transfer"]:
                values = [r["transfer"][key] for r in runs if r["transfer"][key] is not None]
                cell["transfer"][key] = median_or_none(values)
        out.append(cell)
    return sorted(out, key=lambda r: (r["mode"], r["concurrency"]))


def _verdicts(summary: list[dict[str, Any]], memcpy: dict[str, Any], top: int) -> dict[str, Any]:
    by = {(r["mode"], r["concurrency"]): r for r in summary}
    transfer = {}
    for (mode, c), r in by.items():
        bw = r.get("transfer", {}).get("per_request_bw_p50") if mode == "disaggregated" else None
        if bw:
            ratio = bw / memcpy["prealloc_best_bw"]
            transfer[str(c)] = {"ratio": ratio, "met": ratio >= TRANSFER_TARGET}
    colocated = None
    if ("llm", top) in by and ("colocated", top) in by:
        ratio = by[("colocated", top)]["tok_s"] / by[("llm", top)]["tok_s"]
        colocated = {"concurrency": top, "ratio": ratio, "met": ratio >= COLOCATED_TARGET}
    return {
        "transfer_vs_memcpy_target": TRANSFER_TARGET,
        "transfer_vs_memcpy_cross_node_under_load": transfer,
        "colocated_vs_llm_target": COLOCATED_TARGET,
        "colocated_vs_llm": colocated,
    }


# -- formatting and printing -----------------------------------------------------------------------
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def _print_tables(summary: list[dict[str, Any]], memcpy: dict[str, Any], v: dict[str, Any]) -> None:
    for mode in ("llm", "colocated", "disaggregated"):
        rows = [r for r in summary if r["mode"] == mode]
        if not rows:
            continue
        print(f"\n### {mode}\n")
        print("| conc | reqs | tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['concurrency']} | {r['requests']:.0f} | {r['tok_s']:.1f} "
                f"| {_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p99_s'])} "
                f"| {_ms(r['tpot_p50_s'])} | {_ms(r['tpot_p99_s'])} |"
            )
    rows = [r for r in summary if "transfer" in r]
    if rows:
        print("\n### KV transfer under load (P and D on different nodes; ms p50, MiB/s)\n")
        print(
            "| conc | loads | failed | KiB/req | save ms | load ms | transfer ms | load e2e ms "
            "| per-req p50 | per-req min | aggr (bytes/busy) | aggr (bytes/wall) |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            t = r["transfer"]
            print(
                f"| {r['concurrency']} | {t['transfers']:.0f} | {t['failed']:.0f} "
                f"| {(t['bytes_p50'] or 0) / 1024:.0f} | {_ms(t['save_s_p50'])} "
                f"| {_ms(t['load_copy_s_p50'])} | {_ms(t['transfer_s_p50'])} "
                f"| {_ms(t['load_e2e_s_p50'])} | {mib(t['per_request_bw_p50'])} "
                f"| {mib(t['per_request_bw_min'])} | {mib(t['aggregate_bw_busy'])} "
                f"| {mib(t['aggregate_bw_wall'])} |"
            )
    print(
        f"\nmemcpy of {memcpy['bytes'] / 1024:.0f} KiB in this process: "
        f"preallocated np.copyto {mib(memcpy['prealloc_best_bw'])} MiB/s best "
        f"({mib(memcpy['prealloc_bw'])} median), fresh allocation + copy "
        f"{mib(memcpy['fresh_alloc_bw'])} MiB/s, copy into fresh pages (mmap) "
        f"{mib(memcpy['fresh_pages_bw'])} MiB/s"
    )
    print("\n### targets\n")
    for c, t in v["transfer_vs_memcpy_cross_node_under_load"].items():
        print(
            f"- transfer per-request p50 / memcpy at concurrency {c} (cross-node, under load; "
            f"information, the target is the same-node sweep): {t['ratio']:.3f}"
        )
    col = v["colocated_vs_llm"]
    if col is not None:
        print(
            f"- colocated / in-process LLM tok/s at concurrency {col['concurrency']}: "
            f"{col['ratio']:.2f}x (target >= {COLOCATED_TARGET}x: "
            f"{'met' if col['met'] else 'not met'})"
        )


def _print_sweep(sweep: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    same = sweep["pd_same_node"]
    goal = f"target >= {TRANSFER_TARGET} of memcpy" if same else "information, no target"
    print(f"\n### KV transfer sweep, {sweep['placement']} ({goal})\n")
    print(
        f"{sweep['where']}; KV transport {sweep.get('kv_transport')}; one request at a time, "
        "max_tokens 2; ms and MiB/s per request\n"
    )
    print(
        "| prompt tok | reqs | KiB/req | save ms | load ms | load e2e ms | MiB/s p50 "
        "| MiB/s max | memcpy MiB/s | ratio | verdict |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        ref = r["memcpy"]
        verdict = "info" if r["met"] is None else "met" if r["met"] else "NOT met"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(
            f"| {r['prompt_tokens']} | {r['transfers'] - r['failed']}/{r['transfers']} "
            f"| {(r['bytes_p50'] or 0) / 1024:.0f} | {_ms(r['save_s_p50'])} "
            f"| {_ms(r['load_copy_s_p50'])} | {_ms(r['load_e2e_s_p50'])} "
            f"| {mib(r['per_request_bw_p50'])} | {mib(r['per_request_bw_max'])} "
            f"| {mib(ref and ref['prealloc_best_bw'])} | {ratio} | {verdict} |"
        )
    w = sweep["warmup"]
    print(
        f"\nwarm-up: {w['requests']} x {w['prompt_tokens']} tokens ({mib(w['bytes'])} MiB); "
        f"per request p50 {mib(w['bw_first_half'])} MiB/s (first half), "
        f"{mib(w['bw_second_half'])} MiB/s (second half). "
        "memcpy: np.copyto into a preallocated, pre-touched array, best of >= 10. "
        + transfer_note(sweep.get("kv_transport"))
    )


def setup_line(
    args: argparse.Namespace,
    info: dict[str, Any],
    num_blocks: int,
    described: dict[str, Any],
    labels: dict[str, str],
) -> str:
    lines = [
        f"model dtype {info['dtype']} (--dtype {args.dtype}); prompts {args.prompt_tokens} "
        f"tokens, {args.max_tokens} new (greedy, EOS ignored); {num_blocks} KV blocks per worker",
        f"torch threads: colocated worker {args.colocated_threads}, prefill/decode workers "
        f"{args.pd_threads} each (2 workers on {os.cpu_count()} cores), in-process LLM "
        f"{args.colocated_threads}",
    ]
    lines += [f"{mode}: {where_line(d, labels)}" for mode, d in described.items()]
    distinct = pd_distinct(described["disaggregated"])
    lines.append(f"prefill and decode on different Ray nodes: {'yes' if distinct else 'NO'}")
    return "\n".join(lines)


def where_line(described: dict[str, Any], labels: dict[str, str]) -> str:
    return ", ".join(
        f"{iid} ({i['role']}) on {labels.get(i['node_id'], i['node_id'])}"
        for iid, i in described["instances"].items()
    )


def pd_distinct(described: dict[str, Any]) -> bool:
    """True when no prefill instance shares a Ray node with a decode instance."""
    inst = described["instances"].values()
    p_nodes = {i["node_id"] for i in inst if i["role"] == "prefill"}
    d_nodes = {i["node_id"] for i in inst if i["role"] != "prefill"}
    return bool(p_nodes) and not p_nodes & d_nodes


def progress_line(row: dict[str, Any]) -> str:
    text = (
        f"{row['mode']:13} c={row['concurrency']:<3} rep={row['rep']} {row['requests']} reqs "
        f"{row['tok_s']:.1f} tok/s  TTFT p50 {_ms(row['ttft_p50_s'])} ms  "
        f"TPOT p50 {_ms(row['tpot_p50_s'])} ms  cached {row['cached_prompt_tokens']}"
    )
    if "transfer" in row:
        t = row["transfer"]
        text += (
            f"  KV loads {t['transfers']} (transfer p50 {_ms(t['transfer_s_p50'])} ms, "
            f"{mib(t['per_request_bw_p50'])} MiB/s)"
        )
    return text
