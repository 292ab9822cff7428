"""``tandem bench``: a load generator for any OpenAI-compatible endpoint.

It streams every request (SSE, ``stream_options.include_usage``) and records per request the
time to first token (TTFT), every inter-chunk latency (ITL), the time per output token (TPOT),
the end-to-end latency and the token counts; per run it reports throughput, latency percentiles
and goodput against optional SLOs::

    tandem bench --concurrency 1,4,16 --num-prompts 64 --input-len 128 --output-len 64 \\
        --slo-ttft-ms 2000 --slo-tpot-ms 200 --out results.json --plot-dir plots/
    tandem bench --request-rate 2,8 --max-concurrency 32 --range-ratio 0.5 --endpoint chat

Load shapes: a fixed number of requests in flight (``--concurrency``, a comma list sweeps one run
per level) or Poisson arrivals (``--request-rate``, exponential inter-arrival times from
``--seed``). Completions prompts are random token ids, so their length is exact; chat prompts
are random words (about one token each). Statistics and reports live in
``cluster.tools.loadgen_report``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from cluster.tools.bench_args import LEN_DISTS, check_bench_args
from cluster.tools.loadgen_report import (
    RequestRecord,
    RunResult,
    format_table,
    summarize,
    write_json,
    write_plots,
)

# Common short English words: most are one token in BPE vocabularies.
_WORDS_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use an each which she "
    "do how their if will up other about out many then them these so some her would make like "
    "him into time has look two more write go see number no way could people my than first water"
)
WORDS = _WORDS_TEXT.split()


# -- pure parts: lengths, prompts, arrivals --------------------------------------------------------
@dataclass(frozen=True)
class RequestSpec:
    """What one request sends: token ids (completions) or text (chat), and its output length."""

    prompt: list[int] | str
    prompt_len: int  # tokens sent: exact for ids, approximate (words) for text
    output_len: int


def sample_lengths(
    n: int, mean: int, range_ratio: float, dist: str, rng: random.Random
) -> list[int]:
    """``n`` lengths in ``[mean*(1-r), mean*(1+r)]`` (at least 1): uniform integers as vLLM's
    random dataset, a normal with sigma ``mean*r/2`` clipped to the range, or all ``mean``."""
    if dist not in LEN_DISTS:
        raise ValueError(f"len_dist must be one of {LEN_DISTS}, got {dist!r}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    if dist == "fixed" or lo == hi:
        return [max(1, mean)] * n
    if dist == "uniform":
        return [rng.randint(lo, hi) for _ in range(n)]
    sigma = mean * range_ratio / 2
    return [min(hi, max(lo, round(rng.gauss(mean, sigma)))) for _ in range(n)]


def poisson_schedule(n: int, rate: float, rng: random.Random) -> list[float]:
    """Send offsets (s) of ``n`` Poisson arrivals at ``rate`` req/s: the first at 0, then gaps
    drawn from an exponential distribution with mean ``1/rate``."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


WARMUP_SALT = 0x5A17_3C9D


def warmup_seed(seed: int) -> int:
    """The warm-up's prompts' seed: none of a run's (``seed``) nor of the runs a caller makes
    with nearby seeds (``seed + 1`` was, so one run's warm-up primed the next run's prefix
    cache with its first prompts)."""
    return seed ^ WARMUP_SALT


def level_seed(seed: int, index: int) -> int:
    """The prompts' seed of a run's ``index``-th level (the first: ``seed`` itself)."""
    return seed + 1_000_003 * index


def make_requests(args: argparse.Namespace, n: int, seed: int) -> list[RequestSpec]:
    """``n`` reproducible requests (same seed, same prompts) for ``args.endpoint``."""
    rng = random.Random(seed)
    ins = sample_lengths(n, args.input_len, args.range_ratio, args.len_dist, rng)
    outs = sample_lengths(n, args.output_len, args.range_ratio, args.len_dist, rng)
    specs = []
    for n_in, n_out in zip(ins, outs, strict=True):
        prompt: list[int] | str
        if args.endpoint == "completions":
            prompt = [rng.randint(args.min_token_id, args.max_token_id) for _ in range(n_in)]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(n_in))
        specs.append(RequestSpec(prompt, n_in, n_out))
    return specs


# -- one streamed request --------------------------------------------------------------------------
@dataclass(frozen=True)
class Target:
    """Where and how to send: the endpoint's URL and headers, and the body's fixed fields."""

    url: str
    headers: dict[str, str]
    endpoint: str  # "completions" | "chat"
    model: str
    temperature: float
    ignore_eos: bool

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": spec.output_len,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True  # a vLLM extra: decode exactly max_tokens
        if self.endpoint == "completions":
            body["prompt"] = spec.prompt
        else:
            body["messages"] = [{"role": "user", "content": spec.prompt}]
        return body


def _chunk_text(event: dict[str, Any], endpoint: str) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if endpoint == "completions":
        return str(choices[0].get("text") or "")
    return str((choices[0].get("delta") or {}).get("content") or "")


async def send_request(
    session: aiohttp.ClientSession, target: Target, spec: RequestSpec, index: int, t0: float
) -> RequestRecord:
    """Send one streaming request and time it; every failure (connection, non-2xx, timeout, an
    error event in the stream, no content) becomes a record with ``ok=False``, never a raise."""
    rec = RequestRecord(index, False, spec.prompt_len, 0)
    start = time.perf_counter()
    rec.start_s = start - t0
    chunks, last, done = 0, start, False
    try:
        async with session.post(target.url, json=target.payload(spec), headers=target.headers) as r:
            rec.status = r.status
            if not 200 <= r.status < 300:
                rec.error = f"HTTP {r.status}: {(await r.text())[:2000]}"
                return rec
            buf = b""
            async for data in r.content.iter_any():
                buf += data
                # SSE events arrive split or batched arbitrarily: act on complete lines only.
                while b"\n" in buf and not done:
                    raw, buf = buf.split(b"\n", 1)
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue  # blank separators, ": comments", event names
                    body = line[len("data:") :].strip()
                    if body == "[DONE]":
                        done = True
                        break
                    event = json.loads(body)
                    if not isinstance(event, dict):
                        continue
                    if event.get("error"):
                        rec.error = f"stream error: {json.dumps(event['error'])[:2000]}"
                        return rec
                    if event.get("usage"):
                        rec.prompt_tokens = int(
                            event["usage"].get("prompt_tokens", spec.prompt_len)
                        )
                        rec.output_tokens = int(event["usage"].get("completion_tokens", chunks))
                    if _chunk_text(event, target.endpoint):
                        now = time.perf_counter()
                        if chunks == 0:
                            rec.ttft_s = now - start
                        else:
                            rec.itl_s.append(now - last)
                        chunks, last = chunks + 1, now
                if done:
                    break
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:2000] if str(e) else type(e).__name__
        return rec
    rec.e2e_s = time.perf_counter() - start
    if not done:
        rec.error = "stream ended before data: [DONE]"
    elif rec.ttft_s is None:
        rec.error = "no content in the stream"
    else:
        rec.ok = True
        rec.output_tokens = rec.output_tokens or chunks  # no usage chunk: count content chunks
        if rec.output_tokens > 1:
            rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (rec.output_tokens - 1)
    return rec


# -- runs ------------------------------------------------------------------------------------------
async def run_level(
    session: aiohttp.ClientSession,
    target: Target,
    specs: Sequence[RequestSpec],
    offsets: Sequence[float],
    limit: int | None,
    duration_s: float | None = None,
    on_done: Callable[[], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send ``specs[i]`` at ``offsets[i]`` (s after the start), at most ``limit`` in flight (the
    semaphore is FIFO, so all-zero offsets make a fixed-concurrency run). No request starts after
    ``duration_s``; those already in flight finish. Returns the records and the wall time."""
    sem = asyncio.Semaphore(limit) if limit else None
    t0 = time.perf_counter()

    async def one(i: int) -> RequestRecord | None:
        if duration_s is not None and offsets[i] > duration_s:  # not sent: no wait for it
            if on_done is not None:
                on_done()
            return None
        await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
        if sem is not None:
            await sem.acquire()
        try:
            if duration_s is not None and time.perf_counter() - t0 > duration_s:
                return None
            return await send_request(session, target, specs[i], i, t0)
        finally:
            if sem is not None:
                sem.release()
            if on_done is not None:
                on_done()

    results = await asyncio.gather(*(one(i) for i in range(len(specs))))
    return [r for r in results if r is not None], time.perf_counter() - t0


async def _fetch_model(session: aiohttp.ClientSession, base: str, headers: dict[str, str]) -> str:
    try:
        async with session.get(f"{base}/models", headers=headers) as r:
            if r.status != 200:
                raise RuntimeError(f"GET {base}/models: HTTP {r.status}: {(await r.text())[:500]}")
            data = (await r.json()).get("data") or []
    except (TimeoutError, aiohttp.ClientError) as e:
        raise RuntimeError(
            f"GET {base}/models failed ({e}); is the server up? (or pass --model)"
        ) from e
    if not data:
        raise RuntimeError(f"GET {base}/models listed no model; pass --model")
    return str(data[0]["id"])


async def run_all(args: argparse.Namespace) -> tuple[str, list[RunResult]]:
    """The resolved model, and one RunResult per concurrency level or request rate."""
    from tqdm import tqdm

    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout_s)
    # The load shape, not aiohttp, bounds concurrency. ``--no-keep-alive``: a connection per
    # request, for servers that close a kept-alive one under the client (llama.cpp's server:
    # "Can not write request body" on a connection it closed after a few requests).
    connector = aiohttp.TCPConnector(limit=0, force_close=args.no_keep_alive)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model = args.model or await _fetch_model(session, base, headers)
        path = "completions" if args.endpoint == "completions" else "chat/completions"
        target = Target(
            f"{base}/{path}", headers, args.endpoint, model, args.temperature, args.ignore_eos
        )
        if args.request_rate:
            levels: list[tuple[str, float, int | None]] = [
                (f"rate={r:g}/s", r, args.max_concurrency) for r in args.request_rate
            ]
        else:
            levels = [(f"conc={c}", c, c) for c in args.concurrency]
        if args.warmup:
            warm = make_requests(args, args.warmup, warmup_seed(args.seed))
            recs, _ = await run_level(session, target, warm, [0.0] * len(warm), levels[0][2])
            print(f"warmup: {sum(r.ok for r in recs)}/{len(recs)} ok", file=sys.stderr)
        runs = []
        for index, (label, level, limit) in enumerate(levels):
            # Prompts of its own per level: a level sent the last one's prompts would find
            # them in the server's prefix cache (its TTFT read as if no prefill were needed).
            specs = make_requests(args, args.num_prompts, level_seed(args.seed, index))
            if args.request_rate:
                offsets = poisson_schedule(len(specs), level, random.Random(args.seed))
            else:
                offsets = [0.0] * len(specs)
            bar = tqdm(total=len(specs), desc=label, file=sys.stderr, disable=args.no_progress)
            try:
                recs, dur = await run_level(
                    session, target, specs, offsets, limit, args.duration_s, bar.update
                )
            finally:
                bar.close()
            mode = "rate" if args.request_rate else "concurrency"
            runs.append(RunResult(label, mode, level, recs, dur))
    return model, runs


def run_bench(args: argparse.Namespace) -> int:
    """Run every level, print the table, write ``--out`` / ``--plot-dir``. Returns 1 when a run
    had no successful request (or the model could not be listed), else 0."""
    try:
        check_bench_args(args)
    except ValueError as e:
        parser = getattr(args, "bench_parser", None)
        if parser is not None:
            parser.error(str(e))  # exits 2 with the usage line
        print(f"tandem bench: error: {e}", file=sys.stderr)
        return 2
    if not args.request_rate and not args.concurrency:
        args.concurrency = [1]
    try:
        model, runs = asyncio.run(run_all(args))
    except (TimeoutError, aiohttp.ClientError, OSError, RuntimeError, ValueError) as e:
        print(f"tandem bench: error: {e}", file=sys.stderr)
        return 1
    summaries = [summarize(r, args.slo_ttft_ms, args.slo_tpot_ms) for r in runs]
    print(f"{args.base_url} model={model} endpoint={args.endpoint}")
    print(format_table(summaries))
    config = {
        k: v
        for k, v in vars(args).items()
        if k not in ("bench_parser", "api_key")
        and isinstance(v, (str, int, float, list, type(None)))
    }
    config["model"] = model
    if args.out:
        write_json(args.out, config, runs, summaries)
    if args.plot_dir:
        write_plots(args.plot_dir, runs, summaries)
    for r in runs:
        if not any(x.ok for x in r.records):
            errors = sorted({str(x.error) for x in r.records})[:3]
            print(f"tandem bench: every request of {r.label} failed: {errors}", file=sys.stderr)
            return 1
    return 0
