"""``tandem bench`` against ``tandem serve`` (the default P/D config: one prefill and one
decode instance) with each KV transport, interleaved: round after round, each transport's
server is started, loaded and stopped in turn (the order alternates), so a slow phase of the
host hits them alike. Prompts are longer than the router's disaggregation threshold (256
uncached tokens by default), so every request is handed off.

For each run: TTFT / TPOT / E2E percentiles and output tokens/s from ``tandem bench``; the
report is the median of the runs' p50 (and p90) per transport.

    python -m bench.serve_transports                      # nixl vs ray, 3 rounds, c=8
    python -m bench.serve_transports --transports nixl ray grpc --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem serve exited ({proc.returncode})")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError("tandem serve did not become healthy")


def stop(serve: subprocess.Popen[bytes]) -> None:
    """Stop a ``tandem serve`` started in a session of its own: Ctrl-C, then a kill after
    60 s."""
    os.killpg(serve.pid, signal.SIGINT)
    try:
        serve.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(serve.pid, signal.SIGKILL)
        serve.wait()


def one_run(args: argparse.Namespace, transport: str, workdir: Path, tag: str) -> dict[str, Any]:
    """Start ``tandem serve`` with ``transport``, run ``tandem bench`` once, stop it."""
    url = f"http://127.0.0.1:{args.port}"
    log = (workdir / f"serve-{tag}.log").open("wb")
    serve = subprocess.Popen(
        [str(BIN / "tandem"), "serve", "--kv-transport", transport, "--port", str(args.port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_ready(url, serve, args.startup_timeout_s)
        out = workdir / f"bench-{tag}.json"
        subprocess.run(
            [
                str(BIN / "tandem"),
                "bench",
                "--base-url",
                f"{url}/v1",
                "--concurrency",
                str(args.concurrency),
                "--num-prompts",
                str(args.num_prompts),
                "--input-len",
                str(args.input_len),
                "--output-len",
                str(args.output_len),
                "--len-dist",
                "fixed",
                "--warmup",
                "2",
                "--seed",
                tag.split("-")[-1],
                "--no-progress",
                "--out",
                str(out),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        summary: dict[str, Any] = json.loads(out.read_text())["runs"][0]["summary"]
        return summary
    finally:
        stop(serve)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--transports", nargs="+", default=["nixl", "ray"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--port", type=int, default=8013)
    ap.add_argument("--startup-timeout-s", type=float, default=240.0)
    ap.add_argument("--out", default="bench/results/serve_transports.json")
    args = ap.parse_args()

    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in args.transports}
    with tempfile.TemporaryDirectory(prefix="tandem-serve-bench-") as tmp:
        for r in range(args.rounds):
            order = args.transports if r % 2 == 0 else args.transports[::-1]
            for transport in order:
                summary = one_run(args, transport, Path(tmp), f"{transport}-{r}")
                runs[transport].append(summary)
                print(
                    f"round {r} {transport:5s}: TTFT p50 {summary['ttft']['p50_ms']:.1f} ms, "
                    f"TPOT p50 {summary['tpot']['p50_ms']:.1f} ms, "
                    f"{summary['output_token_throughput']:.1f} tok/s, "
                    f"{summary['failed']} failed",
                    flush=True,
                )
    rows = []
    for transport, summaries in runs.items():

        def median(metric: str, q: str, group: list[dict[str, Any]] = summaries) -> float:
            return float(statistics.median(s[metric][q] for s in group))

        rows.append(
            {
                "transport": transport,
                "runs": len(summaries),
                "ttft_p50_ms": median("ttft", "p50_ms"),
                "ttft_p90_ms": median("ttft", "p90_ms"),
                "tpot_p50_ms": median("tpot", "p50_ms"),
                "e2e_p50_ms": median("e2e", "p50_ms"),
                "output_tok_s": statistics.median(s["output_token_throughput"] for s in summaries),
                "failed": sum(s["failed"] for s in summaries),
                "ttft_p50_ms_runs": [s["ttft"]["p50_ms"] for s in summaries],
            }
        )
    print(f"\nc={args.concurrency}, {args.input_len}-token prompts, {args.output_len} out")
    print(f"{'transport':9s} {'TTFT p50':>9s} {'TTFT p90':>9s} {'TPOT p50':>9s} {'tok/s':>7s}")
    for row in rows:
        print(
            f"{row['transport']:9s} {row['ttft_p50_ms']:9.1f} {row['ttft_p90_ms']:9.1f} "
            f"{row['tpot_p50_ms']:9.1f} {row['output_tok_s']:7.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.platform(), "cpu_count": os.cpu_count(), "args": vars(args)}
    out.write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
