"""A small request's time to first token while large requests are refused (issue 17's
head-of-line check), against a running server (``make serve``):

    python -m bench.large_requests [--url http://127.0.0.1:8000] [--api-key KEY]

Three phases, one after another, each timing ``--samples`` small streamed chat requests
(4 tokens); in the last two, each small request is sent ``--lead-ms`` after a large request
was started on another connection (one large request in flight at a time, as the issue asks:
what a large request does to a small one beside it, not what a flood of them does to a 2-core
machine):

- ``idle``: nothing else;
- ``oversized body``: a body of ``--huge-mb`` MiB (over the body limit: a 413 before it is
  read);
- ``max-size prompt``: a body just under the limit (8 MiB by default) holding one prompt far
  longer than the context (a 400 once parsed, refused by its length without tokenizing it).

Prints the small request's TTFT p50 / max per phase and the ratio to idle, and what the large
requests were answered (status codes; -1: the connection was closed while the body was still
being sent, before the client could read an answer). Writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def _has_text(data: bytes) -> bool:
    choices = json.loads(data).get("choices") or []
    return any((c.get("delta") or {}).get("content") for c in choices)


def _post(url: str, body: bytes, key: str | None, stream: bool = False) -> tuple[int, float]:
    """(status, seconds to the first streamed content byte -- or to the whole answer)."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            if stream:  # the first chunk with text (the role chunk's content is "")
                for line in response:
                    if line.startswith(b"data: {") and _has_text(line[6:]):
                        break
            first = time.monotonic() - start
            response.read()
            return response.status, first
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code, time.monotonic() - start
    except (ConnectionError, urllib.error.URLError):  # closed while we were still sending
        return -1, time.monotonic() - start  # (reported as -1: a reset, not a 413 read)


def run(args: argparse.Namespace) -> dict[str, Any]:
    chat = f"{args.url}/v1/chat/completions"
    with urllib.request.urlopen(f"{args.url}/v1/models", timeout=30) as response:
        model = json.loads(response.read())["data"][0]["id"]
    small = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 4,
            "stream": True,
        }
    ).encode()
    limit = args.limit_mb * 1024 * 1024
    envelope = json.dumps({"model": model, "prompt": ""}).encode()
    words = (limit - len(envelope) - 64) // 5
    floods = {
        "oversized body": json.dumps(
            {"model": model, "prompt": "x" * (args.huge_mb * 1024 * 1024)}
        ).encode(),
        "max-size prompt": json.dumps({"model": model, "prompt": "word " * words}).encode(),
    }
    results: dict[str, Any] = {}

    def measure(name: str, large: bytes | None) -> None:
        statuses: list[int] = []
        large_s: list[float] = []
        ttfts = []
        for _ in range(args.samples):
            thread = None
            if large is not None:

                def send(body: bytes = large) -> None:
                    status, seconds = _post(f"{args.url}/v1/completions", body, args.api_key)
                    statuses.append(status)
                    large_s.append(seconds)

                thread = threading.Thread(target=send)
                thread.start()
                time.sleep(args.lead_ms / 1000)
            status, ttft = _post(chat, small, args.api_key, stream=True)
            assert status == 200, status
            ttfts.append(ttft)
            if thread is not None:
                thread.join()
        results[name] = {
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_max_ms": 1000 * max(ttfts),
            "large_statuses": sorted(set(statuses)),
            "large_answer_ms_p50": 1000 * statistics.median(large_s) if large_s else 0.0,
            "body_mb": round(len(large) / 2**20, 2) if large else 0,
        }

    measure("idle", None)
    for name, body in floods.items():
        measure(name, body)
    idle = results["idle"]["ttft_p50_ms"]
    head = f"{'phase':<18}{'body MiB':>10}{'TTFT p50 ms':>13}{'max ms':>9}{'x idle':>8}"
    print(f"{head}  large: status, answered in (p50 ms)")
    for name, r in results.items():
        r["ratio_to_idle"] = r["ttft_p50_ms"] / idle
        print(
            f"{name:<18}{r['body_mb']:>10}{r['ttft_p50_ms']:>13.1f}{r['ttft_max_ms']:>9.1f}"
            f"{r['ratio_to_idle']:>8.2f}  {r['large_statuses']} {r['large_answer_ms_p50']:.0f}"
        )
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--lead-ms", type=float, default=20.0, help="large request's head start")
    p.add_argument("--huge-mb", type=int, default=50)
    p.add_argument("--limit-mb", type=int, default=8, help="the server's body limit (MiB)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    results = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
