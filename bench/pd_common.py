"""Reusable parts of ``bench/pd_cluster.py``: per-request samples and latency statistics, the
closed-loop runners (cluster client and in-process engine), the Ray and Tandem cluster context
managers and config builders, KV transfer pairing and statistics, and the memcpy reference."""

from __future__ import annotations

import argparse
import asyncio
import mmap
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

BLOCK_SIZE = 16  # KV block size of every instance and of the baseline


# -- samples ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    """One finished request as a runner saw it (seconds, from ``time.perf_counter``)."""

    request_id: str
    ttft_s: float
    tpot_s: float | None  # None for a single-token request
    num_tokens: int
    num_cached_tokens: int


RunFn = Callable[[list[list[int]], list[str], int], tuple[float, list[Sample]]]


def _sample(rid: str, t0: float, first: float | None, end: float, final: Any, want: int) -> Sample:
    out = final.outputs[0] if final is not None else None
    if out is None or first is None or len(out.token_ids) != want:
        got = None if out is None else (len(out.token_ids), out.finish_reason, out.error)
        raise RuntimeError(f"request {rid}: expected {want} tokens, got {got}")
    n = len(out.token_ids)
    tpot = (end - first) / (n - 1) if n > 1 else None
    return Sample(rid, first - t0, tpot, n, final.num_cached_tokens)


# -- contenders --------------------------------------------------------------------------------
def cluster_runner(client: Any, params: Any) -> RunFn:
    """A closed loop through ``ClusterClient.generate_async``: a semaphore keeps c in flight."""

    async def run(prompts: list[list[int]], ids: list[str], c: int) -> tuple[float, list[Sample]]:
        sem = asyncio.Semaphore(c)

        async def one(prompt: list[int], rid: str) -> Sample:
            async with sem:
                t0 = time.perf_counter()
                first, final = None, None
                async for out in client.generate_async(prompt, params, request_id=rid):
                    if first is None and out.outputs[0].token_ids:
                        first = time.perf_counter()
                    final = out
                return _sample(rid, t0, first, time.perf_counter(), final, params.max_tokens)

        start = time.perf_counter()
        samples = await asyncio.gather(*(one(p, r) for p, r in zip(prompts, ids, strict=True)))
        return time.perf_counter() - start, list(samples)

    return lambda prompts, ids, c: asyncio.run(run(prompts, ids, c))


def llm_runner(llm: Any, params: Any) -> RunFn:
    """The same closed loop on the in-process engine: admit up to c, step, refill on finish."""
    engine = llm.engine

    def run(prompts: list[list[int]], ids: list[str], c: int) -> tuple[float, list[Sample]]:
        todo = list(zip(ids, prompts, strict=True))[::-1]
        live: dict[str, list[float | None]] = {}  # rid -> [submitted, first token]
        samples: list[Sample] = []

        def admit() -> None:
            while todo and len(live) < c:
                rid, prompt = todo.pop()
                live[rid] = [time.perf_counter(), None]
                engine.add_request(rid, prompt, params)

        start = time.perf_counter()
        admit()
        while live:
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                times = live[out.request_id]
                if times[1] is None and out.outputs[0].token_ids:
                    times[1] = now
                if out.finished:
                    t0, first = live.pop(out.request_id)
                    assert t0 is not None
                    samples.append(_sample(out.request_id, t0, first, now, out, params.max_tokens))
            admit()
        return time.perf_counter() - start, samples

    return run


# -- Ray and Tandem clusters -------------------------------------------------------------------
@contextmanager
def ray_cluster(object_store_bytes: int) -> Iterator[dict[str, str]]:
    """Head + prefill node + decode node on loopback, connected; yields node id -> label.
    Ray is shut down on the way out, whatever happened."""
    import ray
    from ray.cluster_utils import Cluster

    from cluster.control.launch import DEFAULT_NAMESPACE

    common: dict[str, Any] = {
        "node_ip_address": "127.0.0.1",
        "object_store_memory": object_store_bytes,
        "num_cpus": 1,
    }
    cluster: Any = Cluster(
        initialize_head=True, head_node_args={**common, "include_dashboard": False}
    )
    try:
        p_node = cluster.add_node(**common, resources={"prefill": 1})
        d_node = cluster.add_node(**common, resources={"decode": 1})
        ray.init(
            address=cluster.address,
            _node_ip_address="127.0.0.1",
            namespace=DEFAULT_NAMESPACE,
            log_to_driver=False,
        )
        yield {
            cluster.head_node.node_id: "head",
            p_node.node_id: "prefill-node",
            d_node.node_id: "decode-node",
        }
    finally:
        ray.shutdown()
        cluster.shutdown()


@contextmanager
def tandem_cluster(config: Any, name: str) -> Iterator[Any]:
    """A started Tandem cluster (its SchedulerActor handle), shut down on the way out."""
    from cluster.control.launch import build_cluster, shutdown_cluster

    handle = build_cluster(config, name=name)
    try:
        yield handle
    finally:
        try:
            shutdown_cluster(handle)
        except Exception as exc:  # keep going: the Ray cluster must still come down
            print(f"cluster {name} shutdown failed: {type(exc).__name__}: {exc}")


def cluster_configs(args: argparse.Namespace, num_blocks: int) -> dict[str, Any]:
    from cluster.config import ClusterConfig, InstancePool

    common: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "block_size": BLOCK_SIZE,
        # (auto: nixl where it imports, else ray -- what a transfer is, and so the numbers,
        # depend on which: pd_report.transfer_note)
        "kv_transfer": {"transport": getattr(args, "kv_transport", "auto")},
    }
    both = InstancePool(
        name="both",
        role="both",
        resources={"decode": 0.01},
        num_blocks=num_blocks,
        num_threads=args.colocated_threads,
    )
    return {
        "colocated": ClusterConfig(**common, pools=[both], router={"disaggregation": "never"}),
        "disaggregated": ClusterConfig(
            **common,
            pools=pd_pools(num_blocks, args.pd_threads, "prefill"),
            router={"disaggregation": "always"},
        ),
    }


def pd_pools(num_blocks: int, threads: int, prefill_resource: str) -> list[Any]:
    """A prefill pool asking for ``prefill_resource`` and a decode pool on the decode node."""
    from cluster.config import InstancePool

    return [
        InstancePool(
            name=role,
            role=role,
            resources={resource: 0.01},
            num_blocks=num_blocks,
            num_threads=threads,
        )
        for role, resource in (("prefill", prefill_resource), ("decode", "decode"))
    ]


# -- measurements --------------------------------------------------------------------------------
def latency_stats(wall: float, samples: list[Sample]) -> dict[str, Any]:
    ttft = [s.ttft_s for s in samples]
    tpot = [s.tpot_s for s in samples if s.tpot_s is not None]
    tokens = sum(s.num_tokens for s in samples)
    return {
        "requests": len(samples),
        "wall_s": wall,
        "output_tokens": tokens,
        "tok_s": tokens / wall,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50),
        "tpot_p99_s": _pct(tpot, 99),
        "cached_prompt_tokens": sum(s.num_cached_tokens for s in samples),
    }


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _pct(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    return float(np.percentile(values, q)) if values else None


def pair_transfers(history: dict[str, list[Any]], wanted: set[str]) -> list[dict[str, Any]]:
    """One row per KV load of a request in ``wanted``, joined with its save (the prefill
    instance's record of the same request). ``ok``: both ends succeeded. Records carry the
    schedulers' internal id, ``"<client id>@<n>"``: one per admission, shared by both ends."""
    saves: dict[str, Any] = {}
    loads: dict[str, Any] = {}
    for records in history.values():
        for r in records:
            if _client_id(r.req_id) in wanted:
                (saves if r.kind == "save" else loads)[r.req_id] = r
    rows = []
    for rid, load in loads.items():
        save = saves.get(rid)
        ok = bool(load.ok and save is not None and save.ok)
        save_s = None if save is None else save.copy_seconds
        rows.append(
            {
                "req_id": _client_id(rid),
                "internal_id": rid,
                "ok": ok,
                "bytes": load.num_bytes if save is None else save.num_bytes,
                "bytes_loaded": load.num_bytes,  # fewer when the decode side had a prefix
                "save_s": save_s,
                "load_copy_s": load.copy_seconds,
                "load_e2e_s": load.seconds,
                "transfer_s": save_s + load.copy_seconds if ok and save_s is not None else None,
                "save_started_at": None if save is None else save.started_at,
                "load_started_at": load.started_at,
            }
        )
    # A failed save leaves no load (the decode side recomputes): still a failed transfer.
    rows += [
        {"req_id": _client_id(rid), "internal_id": rid, "ok": False, "bytes": 0}
        for rid, save in saves.items()
        if not save.ok and rid not in loads
    ]
    return rows


def _client_id(internal_id: str) -> str:
    return internal_id.rpartition("@")[0] or internal_id


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total time covered by ``(start, length)`` intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for start, length in sorted(intervals):
        stop = start + length
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def transfer_stats(pairs: list[dict[str, Any]], wall: float | None) -> dict[str, Any]:
    """Medians of per-request times and bandwidths, and aggregate bandwidths (bytes / busy time,
    the union of the saves' and loads' copy intervals; bytes / ``wall`` if given)."""
    ok = [p for p in pairs if p["ok"] and p["transfer_s"] > 0]
    total = sum(p["bytes"] for p in ok)
    busy = _union_length(
        [(p["save_started_at"], p["save_s"]) for p in ok]
        + [(p["load_started_at"], p["load_copy_s"]) for p in ok]
    )
    bw = [p["bytes"] / p["transfer_s"] for p in ok]

    def p50(key: str) -> float | None:
        return statistics.median(p[key] for p in ok) if ok else None

    return {
        "transfers": len(pairs),
        "failed": len(pairs) - len(ok),
        "bytes_p50": p50("bytes"),
        "save_s_p50": p50("save_s"),
        "load_copy_s_p50": p50("load_copy_s"),
        "transfer_s_p50": p50("transfer_s"),
        "load_e2e_s_p50": p50("load_e2e_s"),
        "per_request_bw_p50": median_or_none(bw),
        "per_request_bw_min": min(bw, default=None),
        "per_request_bw_max": max(bw, default=None),
        "total_bytes": total,
        "busy_s": busy,
        "aggregate_bw_busy": total / busy if busy else None,
        "aggregate_bw_wall": total / wall if wall else None,
    }


def memcpy_bandwidth(nbytes: int, min_time_s: float = 0.3, min_iters: int = 20) -> dict[str, Any]:
    """Bandwidth of ``np.copyto`` into a preallocated, pre-touched array (best and median); of
    ``ndarray.copy`` (a fresh allocation, which malloc may serve from memory it already holds);
    and of a copy into a new anonymous mapping (fresh pages, faulted in by the copy: what a
    first pass through the object store pays)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in

    def timed(fn: Callable[[], Any]) -> list[float]:
        times: list[float] = []
        while len(times) < min_iters or sum(times) < min_time_s:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return times

    def fresh_pages() -> None:
        with mmap.mmap(-1, nbytes) as buf:  # new anonymous pages: every one faults in
            np.copyto(np.frombuffer(buf, dtype=np.uint8), src)

    prealloc = timed(lambda: np.copyto(dst, src))
    return {
        "bytes": nbytes,
        "prealloc_best_bw": nbytes / min(prealloc),
        "prealloc_bw": nbytes / statistics.median(prealloc),
        "fresh_alloc_bw": nbytes / statistics.median(timed(src.copy)),
        "fresh_pages_bw": nbytes / statistics.median(timed(fresh_pages)),
    }
