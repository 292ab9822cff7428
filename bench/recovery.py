"""Time to recovery from worker faults (issue: faults recover in seconds, p99 < 5 s).

A Ray cluster on loopback (head, a prefill node, a decode node) serving the built-in SmolLM2.
Workers run with ``max_restarts`` so a killed one comes back and the next trial reuses the
cluster. Each trial streams ``--concurrency`` greedy requests, waits until every stream has
produced a few tokens (decode faults) or until requests are queued on the victim (prefill
faults), kills a worker process with SIGKILL, and records per request:

- decode kill: for each request moved off the dead instance, its longest wait for a token
  after the kill (it is re-prefilled elsewhere from prompt + tokens already sent);
- prefill kill: for each request queued or prefilling on the dead instance, the time from the
  kill to its first token;
- decode hang: a decode worker's next step never returns (it stays alive and answers health
  checks); for each moved request, its longest wait for a token after the hang began -- at
  most ``--step-timeout-s`` to notice, then the move;
- every stream's tokens are checked against an undisturbed run (greedy: equal, none lost or
  repeated), and the time until the restarted worker rejoined routing is reported too.

    python -m bench.recovery [--trials 5] [--concurrency 6] [--out bench/results/recovery.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from bench.pd_common import ray_cluster, tandem_cluster

BLOCK_SIZE = 16


def _prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 20000) for _ in range(48 + 16 * (i % 4))] for i in range(count)]


async def _stream(
    handle: Any, rid: str, prompt: list[int], params: Any, log: dict[str, Any]
) -> Any:
    from scheduler import Request

    times: list[float] = []
    tokens: list[int] = []
    log[rid] = times
    async for ref in handle.generate.remote(Request(rid, prompt, params, eos_token_id=None)):
        out = await ref
        now = time.perf_counter()
        for token in out.new_token_ids:
            tokens.append(token)
            times.append(now)
        if out.error:
            raise RuntimeError(f"{rid}: {out.error}")
    return tokens


async def _trial(
    handle: Any, prompts: list[list[int]], params: Any, fault: Any, tag: str
) -> tuple[list[list[int]], dict[str, list[float]], float | None]:
    log: dict[str, list[float]] = {}
    streams = [
        asyncio.ensure_future(_stream(handle, f"{tag}-{i}", p, params, log))
        for i, p in enumerate(prompts)
    ]
    killed_at = await fault(log) if fault is not None else None
    tokens = await asyncio.gather(*streams)
    return list(tokens), log, killed_at


def _stats(handle: Any) -> dict[str, Any]:
    import ray

    result: dict[str, Any] = ray.get(handle.stats.remote())
    return result


def _kill(handle: Any, instance_id: str) -> float:
    import ray

    pid = ray.get(handle.worker_health.remote())[instance_id]["pid"]
    os.kill(pid, signal.SIGKILL)
    return time.perf_counter()


def _wait_rejoined(handle: Any, instance_id: str, killed_at: float, timeout_s: float) -> float:
    """Seconds from the kill until the instance rejoined routing."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = _stats(handle)["failures"]
        last = events[-1] if events else {}
        if last.get("instance_id") == instance_id and last.get("event") == "rejoined":
            return time.perf_counter() - killed_at
        time.sleep(0.05)
    events = _stats(handle)["failures"]
    raise TimeoutError(f"{instance_id} did not rejoin within {timeout_s}s; events: {events}")


def _mismatches(
    tokens: list[list[int]],
    reference: list[list[int]],
    log: dict[str, list[float]],
    tag: str,
    killed_at: float,
) -> list[dict[str, int]]:
    """For each stream that differs from the undisturbed run: where it first differs and how
    many tokens its client had before the kill (a difference at or after that point is in
    what was recomputed after the move)."""
    result = []
    for i, (got, want) in enumerate(zip(tokens, reference, strict=True)):
        if got != want:
            pairs = zip(got, want, strict=False)
            first = next((k for k, (a, b) in enumerate(pairs) if a != b), len(want))
            sent = sum(t <= killed_at for t in log[f"{tag}-{i}"])
            result.append({"first_diff": first, "sent_before_kill": sent, "length": len(got)})
    return result


def _stall(times: list[float], fault_at: float) -> float:
    """The longest wait for a token from ``fault_at`` on (0: the stream had ended)."""
    after = [fault_at] + [t for t in times if t > fault_at]
    return max((b - a for a, b in itertools.pairwise(after)), default=0.0)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _summary(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50_s": _pct(values, 0.5),
        "p99_s": _pct(values, 0.99),
        "max_s": max(values) if values else None,
        "mean_s": statistics.fmean(values) if values else None,
    }


def _config(
    args: argparse.Namespace, prefill: int, decode: int, step_timeout_s: float = 300.0
) -> Any:
    from cluster.config import ClusterConfig

    common = {"num_threads": 1, "kv_cache_memory_bytes": 256 << 20, "max_restarts": args.trials}
    return ClusterConfig.model_validate(
        {
            "model": args.model,
            "dtype": args.dtype,
            "block_size": BLOCK_SIZE,
            "pools": [
                {
                    "name": "p",
                    "role": "prefill",
                    "replicas": prefill,
                    "resources": {"prefill": 0.01},
                    "scheduler": {"max_num_seqs": 2},
                    **common,
                },
                {
                    "name": "d",
                    "role": "decode",
                    "replicas": decode,
                    "resources": {"decode": 0.01},
                    **common,
                },
            ],
            "router": {"disaggregation": "always"},
            "kv_transfer": {"timeout_s": 2.0},
            "health_check_interval_s": 0.5,
            "step_timeout_s": step_timeout_s,
        }
    )


def decode_faults(args: argparse.Namespace, hang: bool = False) -> dict[str, Any]:
    """Kill a decode worker while every request streams (or, with ``hang``, make its next
    step never return: found after ``step_timeout_s``); its requests continue elsewhere."""
    from scheduler import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = _prompts(args.concurrency, 1)
    recovery: list[float] = []
    rejoin: list[float] = []
    mismatched: list[dict[str, int]] = []
    name = "recovery-hang" if hang else "recovery-decode"
    timeout = args.step_timeout_s if hang else 300.0  # kills: the default, out of the way
    with tandem_cluster(_config(args, 1, 2, timeout), name) as handle:
        reference, _, _ = asyncio.run(_trial(handle, prompts, params, None, "ref"))
        for trial in range(args.trials):
            victim = f"d-{trial % 2}"
            moves_before = _stats(handle)["num_moves"]

            async def fault(log: dict[str, list[float]], victim: str = victim) -> float:
                while len(log) < len(prompts) or min(len(t) for t in log.values()) < 4:
                    await asyncio.sleep(0.005)
                if hang:  # alive and answering health checks, its next step stuck
                    started = time.perf_counter()  # the call may return only after the hang
                    await handle.set_fault_injection.remote(victim, 0.0, 3600.0)
                    return started
                return await asyncio.to_thread(_kill, handle, victim)

            tokens, log, killed_at = asyncio.run(
                _trial(handle, prompts, params, fault, f"t{trial}")
            )
            assert killed_at is not None
            mismatched += _mismatches(tokens, reference, log, f"t{trial}", killed_at)
            moved = _stats(handle)["num_moves"] - moves_before
            # Each stream's longest stall from the fault on (the fault to its next token, or
            # between two tokens after it: a hung step may still deliver the step in flight);
            # the moved requests are the ones that stalled longest.
            waits = sorted(_stall(times, killed_at) for times in log.values())
            recovery += waits[len(waits) - moved :] if moved else []
            rejoin.append(_wait_rejoined(handle, victim, killed_at, 120))
            kind = "hang" if hang else "decode"
            print(f"{kind} trial {trial}: {moved} moved, waits {[round(w, 2) for w in waits]}")
    return {
        "moved_request_recovery": _summary(recovery),
        "rejoin": _summary(rejoin),
        "outputs_equal_undisturbed": not mismatched,
        "mismatched_streams": mismatched,
    }


def prefill_faults(args: argparse.Namespace) -> dict[str, Any]:
    """Kill a prefill worker while requests are queued on it; they go elsewhere."""
    from scheduler import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = _prompts(2 * args.concurrency, 2)
    recovery: list[float] = []
    rejoin: list[float] = []
    mismatched: list[dict[str, int]] = []
    with tandem_cluster(_config(args, 2, 1), "recovery-prefill") as handle:
        reference, _, _ = asyncio.run(_trial(handle, prompts, params, None, "ref"))
        for trial in range(args.trials):
            victim = f"p-{trial % 2}"
            moves_before = _stats(handle)["num_moves"]

            async def fault(log: dict[str, list[float]], victim: str = victim) -> float:
                def queued() -> bool:
                    return int(_stats(handle)["instances"][victim]["num_unfinished"]) > 2

                while not await asyncio.to_thread(queued):
                    await asyncio.sleep(0.005)
                return await asyncio.to_thread(_kill, handle, victim)

            tokens, log, killed_at = asyncio.run(
                _trial(handle, prompts, params, fault, f"t{trial}")
            )
            assert killed_at is not None
            mismatched += _mismatches(tokens, reference, log, f"t{trial}", killed_at)
            moved = _stats(handle)["num_moves"] - moves_before
            firsts = sorted(times[0] - killed_at for times in log.values() if times[0] > killed_at)
            recovery += firsts[len(firsts) - moved :] if moved else []
            rejoin.append(_wait_rejoined(handle, victim, killed_at, 120))
            print(f"prefill trial {trial}: {moved} moved, firsts {[round(f, 2) for f in firsts]}")
    return {
        "moved_request_first_token": _summary(recovery),
        "rejoin": _summary(rejoin),
        "outputs_equal_undisturbed": not mismatched,
        "mismatched_streams": mismatched,
    }


def central_faults(args: argparse.Namespace) -> dict[str, Any]:
    """Kill the central SchedulerActor (``engine_actors``: Ray restarts it) while every
    request streams; the engines go on streaming, the new actor rebuilds its state from them.
    Per trial: each stream's longest stall after the kill, and the time from the kill to the
    first token of a request sent right after it."""
    import ray

    from cluster.control.client import ClusterClient
    from scheduler import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    prompts = _prompts(args.concurrency, 3)
    stalls: list[float] = []
    served: list[float] = []
    mismatched: list[dict[str, int]] = []
    config = _config(args, 1, 2).model_copy(update={"engine_actors": True})
    with tandem_cluster(config, "recovery-central") as handle:
        client = ClusterClient(handle)

        async def stream(prompt: list[int], log: list[float], tokens: list[int]) -> None:
            async for out in client.generate_async(prompt, params):
                now = time.perf_counter()
                for token in out.outputs[0].new_token_ids:
                    tokens.append(token)
                    log.append(now)

        async def trial(kill: bool) -> tuple[list[list[int]], list[list[float]], float, float]:
            logs: list[list[float]] = [[] for _ in prompts]
            tokens: list[list[int]] = [[] for _ in prompts]
            tasks = [
                asyncio.ensure_future(stream(p, logs[i], tokens[i])) for i, p in enumerate(prompts)
            ]
            killed_at = first_after = 0.0
            if kill:
                started = time.monotonic()
                while min(len(t) for t in logs) < 4:
                    await asyncio.sleep(0.005)
                    if time.monotonic() - started > 120:
                        live = await client.live_requests()
                        raise TimeoutError(f"streams stalled before the kill: {live}")
                ray.kill(handle, no_restart=False)
                killed_at = time.perf_counter()
                async for out in client.generate_async(prompts[0][:16], params):
                    if out.outputs[0].finish_reason == "error":  # not served: no recovery
                        raise RuntimeError(f"the request after the kill failed: {out}")
                    if out.outputs[0].new_token_ids:
                        first_after = time.perf_counter() - killed_at
                        break
                else:
                    raise RuntimeError("the request after the kill ended without a token")
            await asyncio.gather(*tasks)
            return tokens, logs, killed_at, first_after

        reference, _, _, _ = asyncio.run(trial(False))
        for t in range(args.trials):
            tokens, logs, killed_at, first_after = asyncio.run(trial(True))
            for i, (got, want) in enumerate(zip(tokens, reference, strict=True)):
                if got != want:
                    mismatched.append({"trial": t, "stream": i, "got": len(got), "want": len(want)})
            waits = sorted(_stall(times, killed_at) for times in logs)
            stalls += waits
            served.append(first_after)
            print(
                f"central trial {t}: new request's first token {first_after:.2f} s after the "
                f"kill; stalls {[round(w, 2) for w in waits]}"
            )
    return {
        "stream_stall_after_kill": _summary(stalls),
        "new_request_first_token_after_kill": _summary(served),
        "outputs_equal_undisturbed": not mismatched,
        "mismatched_streams": mismatched,
    }


FAULTS = {
    "central_kill": central_faults,
    "decode_kill": decode_faults,
    "prefill_kill": prefill_faults,
    "decode_hang": lambda args: decode_faults(args, hang=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in SmolLM2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--step-timeout-s", type=float, default=2.0, help="for the hang fault")
    parser.add_argument(
        "--faults", nargs="+", choices=sorted(FAULTS), default=list(FAULTS), help="default: all"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from cluster.control.launch import ray_env_defaults

    ray_env_defaults()
    with ray_cluster(256 << 20):
        result: dict[str, Any] = {name: FAULTS[name](args) for name in args.faults}
    result["args"] = vars(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
