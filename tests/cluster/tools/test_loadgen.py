"""``tandem bench`` (cluster/tools/loadgen.py): the statistics as pure functions, then whole runs
against a small OpenAI-shaped streaming server (aiohttp.web on 127.0.0.1, in a background thread)
that stands in for any OpenAI-compatible endpoint. No Ray, no model; a few seconds in all."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import socket
import statistics
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from cluster.tools.bench_args import add_bench_arguments
from cluster.tools.loadgen import (
    make_requests,
    poisson_schedule,
    run_bench,
    sample_lengths,
)
from cluster.tools.loadgen_report import RequestRecord, RunResult, goodput, percentile, summarize


# -- pure statistics -------------------------------------------------------------------------------
def test_percentile_known_data() -> None:
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(xs, 0) == 1.0
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 90) == pytest.approx(4.6)
    assert percentile(xs, 100) == 5.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    rng = random.Random(1)
    data = [rng.random() for _ in range(101)]
    for q in (1, 25, 50, 90, 99):
        assert percentile(data, q) == pytest.approx(float(np.percentile(data, q)))
    with pytest.raises(ValueError, match="percentile q"):
        percentile(xs, 101)


def _rec(i: int, ok: bool, ttft_s: float | None, tpot_s: float | None) -> RequestRecord:
    return RequestRecord(i, ok, 10, 5 if ok else 0, ttft_s=ttft_s, e2e_s=1.0, tpot_s=tpot_s)


def test_goodput_counts_failures_and_each_slo() -> None:
    records = [
        _rec(0, True, 0.05, 0.01),  # meets both
        _rec(1, True, 0.50, 0.01),  # misses TTFT
        _rec(2, True, 0.05, 0.20),  # misses TPOT
        _rec(3, False, None, None),  # failed: never good
        _rec(4, True, 0.05, None),  # one output token: no TPOT to miss
    ]
    assert goodput(records, 2.0, None, None) is None
    ttft_only = goodput(records, 2.0, 100, None)
    assert ttft_only == {"good_requests": 3, "share": 3 / 5, "req_per_s": 1.5}
    both = goodput(records, 2.0, 100, 50)
    assert both == {"good_requests": 2, "share": 2 / 5, "req_per_s": 1.0}
    all_failed = [_rec(i, False, None, None) for i in range(3)]
    assert goodput(all_failed, 1.0, 1e9, 1e9) == {"good_requests": 0, "share": 0.0, "req_per_s": 0}


def test_summarize_counts_only_successful_requests() -> None:
    recs = [_rec(0, True, 0.1, 0.02), _rec(1, True, 0.3, 0.04), _rec(2, False, None, None)]
    recs[0].itl_s, recs[1].itl_s = [0.01, 0.03], [0.02]
    s = summarize(RunResult("conc=2", "concurrency", 2, recs, 2.0), slo_ttft_ms=200)
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["total_output_tokens"] == 10 and s["total_input_tokens"] == 20
    assert s["request_throughput"] == 1.0
    assert s["output_token_throughput"] == 5.0 and s["total_token_throughput"] == 15.0
    assert s["ttft"]["mean_ms"] == pytest.approx(200.0)
    assert s["ttft"]["p50_ms"] == pytest.approx(200.0)
    assert s["itl"]["p50_ms"] == pytest.approx(20.0)  # pooled gaps 10, 20, 30 ms
    assert s["goodput"]["good_requests"] == 1


@pytest.mark.parametrize("dist", ["uniform", "normal"])
def test_lengths_within_bounds_and_seeded(dist: str) -> None:
    lengths = sample_lengths(5000, 100, 0.5, dist, random.Random(7))
    assert min(lengths) >= 50 and max(lengths) <= 150
    assert abs(statistics.mean(lengths) - 100) < 3
    assert len(set(lengths)) > 20  # actually spread, not a constant
    assert lengths == sample_lengths(5000, 100, 0.5, dist, random.Random(7))
    assert lengths != sample_lengths(5000, 100, 0.5, dist, random.Random(8))
    if dist == "uniform":
        assert min(lengths) == 50 and max(lengths) == 150  # both ends reachable
    else:
        assert statistics.pstdev(lengths) < statistics.pstdev(
            sample_lengths(5000, 100, 0.5, "uniform", random.Random(7))
        )


def test_lengths_fixed_zero_ratio_and_bad_input() -> None:
    assert sample_lengths(4, 64, 0.5, "fixed", random.Random(0)) == [64] * 4
    assert sample_lengths(4, 64, 0.0, "uniform", random.Random(0)) == [64] * 4
    assert min(sample_lengths(200, 2, 0.9, "uniform", random.Random(0))) >= 1
    with pytest.raises(ValueError, match="len_dist"):
        sample_lengths(4, 64, 0.5, "zipf", random.Random(0))
    with pytest.raises(ValueError, match="range_ratio"):
        sample_lengths(4, 64, 1.0, "uniform", random.Random(0))


def test_poisson_schedule_mean_gap_is_one_over_rate() -> None:
    offsets = poisson_schedule(20_000, 5.0, random.Random(3))
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.03)
    assert statistics.pstdev(gaps) == pytest.approx(0.2, rel=0.05)  # exponential: sd == mean
    assert offsets == poisson_schedule(20_000, 5.0, random.Random(3))
    with pytest.raises(ValueError, match="rate"):
        poisson_schedule(10, 0.0, random.Random(3))


# -- a fake OpenAI-compatible streaming server -----------------------------------------------------
@dataclass
class FakeServer:
    """Streams one content chunk per max_tokens, then a usage chunk and ``data: [DONE]``."""

    token_delay_s: float = 0.002
    slow_first_s: float = 0.0  # extra first-token delay on every other request (2nd, 4th, ...)
    error_status: int | None = None  # answer every POST with this status and a JSON error
    send_usage: bool = True
    split_writes: bool = False  # write each SSE event in 7-byte pieces
    stream_error: bool = False  # an error event after the first token, then [DONE]
    bodies: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    port: int = 0

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = len(self.bodies)
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        if self.error_status is not None:
            err = {"message": f"fake failure {self.error_status}", "type": "invalid_request_error"}
            return web.json_response({"error": err}, status=self.error_status)
        chat = "messages" in body
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if chat:  # the role chunk carries no content: it must not count as the first token
                await self._event(resp, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            if n % 2 == 1:
                await asyncio.sleep(self.slow_first_s)
            for i in range(body["max_tokens"]):
                await asyncio.sleep(self.token_delay_s)
                choice = (
                    {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
                )
                await self._event(resp, {"choices": [choice]})
                if self.stream_error:
                    await self._event(resp, {"error": {"message": "engine died", "code": 500}})
                    break
            if self.send_usage:
                prompt = body["messages"][0]["content"].split() if chat else body["prompt"]
                usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"]}
                await self._event(resp, {"choices": [], "usage": usage})
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self.in_flight -= 1
        return resp

    async def _event(self, resp: web.StreamResponse, event: dict[str, Any]) -> None:
        data = f"data: {json.dumps(event)}\n\n".encode()
        step = 7 if self.split_writes else len(data)
        for i in range(0, len(data), step):
            await resp.write(data[i : i + step])


@pytest.fixture
def server() -> Iterator[FakeServer]:
    fake = FakeServer()
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/v1/models", fake.models)
    app.router.add_post("/v1/completions", fake.generate)
    app.router.add_post("/v1/chat/completions", fake.generate)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)  # port 0: the OS picks a free one
    loop.run_until_complete(site.start())
    fake.port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield fake
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


def _bench(argv: list[str], tmp_path: Path) -> tuple[int, dict[str, Any]]:
    p = argparse.ArgumentParser(prog="tandem bench")
    add_bench_arguments(p)
    out = tmp_path / "results.json"
    rc = run_bench(p.parse_args([*argv, "--no-progress", "--out", str(out)]))
    return rc, json.loads(out.read_text())


def _url(server: FakeServer) -> list[str]:
    return ["--base-url", f"http://127.0.0.1:{server.port}/v1", "--api-key", "sk-test"]


# -- whole runs ------------------------------------------------------------------------------------
def test_completions_sweep_counts_json_and_plots(
    server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server.token_delay_s = 0.01
    argv = [*_url(server), "--concurrency", "1,2", "--num-prompts", "6", "--warmup", "2"]
    argv += ["--input-len", "16", "--output-len", "5", "--plot-dir", str(tmp_path / "plots")]
    rc, doc = _bench(argv, tmp_path)
    assert rc == 0
    assert set(doc) == {"config", "runs"}
    assert doc["config"]["model"] == "fake-model" and "api_key" not in doc["config"]
    assert [r["summary"]["label"] for r in doc["runs"]] == ["conc=1", "conc=2"]
    for run in doc["runs"]:
        s = run["summary"]
        assert (s["completed"], s["failed"]) == (6, 0)
        assert (s["total_input_tokens"], s["total_output_tokens"]) == (96, 30)
        assert s["output_token_throughput"] == pytest.approx(30 / s["duration_s"])
        assert {"ttft", "tpot", "itl", "e2e", "goodput"} <= set(s)
        assert set(run["requests"][0]) >= {"ok", "ttft_s", "tpot_s", "itl_s", "e2e_s", "error"}
        for r in run["requests"]:
            assert 0 < r["ttft_s"] <= r["e2e_s"] and len(r["itl_s"]) == 4
            assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 4)
    assert len(server.bodies) == 2 + 12  # warmup + two runs
    # The warm-up's prompts are none of this run's, nor of a run with the next seed (a
    # caller's next run on the same server: its first prompts would hit the prefix cache).
    warm = {tuple(b["prompt"]) for b in server.bodies[:2]}
    # And each level has prompts of its own (the second's would be cached from the first's).
    first, second = ({tuple(b["prompt"]) for b in server.bodies[k : k + 6]} for k in (2, 8))
    assert len(first) == len(second) == 6 and not first & second
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(argv)  # (seed 0)
    nearby = make_requests(args, 6, 0) + make_requests(args, 6, 1)
    assert not warm & {tuple(spec.prompt) for spec in nearby}
    body = server.bodies[-1]
    assert len(body["prompt"]) == 16 and all(100 <= t <= 10000 for t in body["prompt"])
    assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert set(server.auth) == {"Bearer sk-test"}
    assert server.max_in_flight == 2  # conc=2 ran two at once, and never more
    for name in ("latency_cdf.png", "throughput.png"):
        png = (tmp_path / "plots" / name).read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 1000
    table = capsys.readouterr().out
    assert "conc=1" in table and "TTFT p99 (ms)" in table and "output tok/s" in table


def test_goodput_with_ttft_slo_missed_by_every_other_request(
    server: FakeServer, tmp_path: Path
) -> None:
    server.slow_first_s = 0.4
    argv = [*_url(server), "--num-prompts", "4", "--output-len", "3", "--slo-ttft-ms", "200"]
    rc, doc = _bench(argv, tmp_path)
    assert rc == 0
    s, reqs = doc["runs"][0]["summary"], doc["runs"][0]["requests"]
    assert s["goodput"]["good_requests"] == 2 and s["goodput"]["share"] == 0.5
    assert s["goodput"]["req_per_s"] == pytest.approx(2 / s["duration_s"])
    assert [r["ttft_s"] >= 0.4 for r in reqs] == [False, True, False, True]  # concurrency 1
    assert s["ttft"]["p99_ms"] >= 400


def test_chat_without_usage_counts_chunks_across_split_writes(
    server: FakeServer, tmp_path: Path
) -> None:
    server.send_usage, server.split_writes = False, True
    argv = [*_url(server), "--endpoint", "chat", "--model", "m", "--num-prompts", "3"]
    argv += ["--input-len", "12", "--output-len", "4", "--concurrency", "3"]
    rc, doc = _bench(argv, tmp_path)
    assert rc == 0
    assert doc["runs"][0]["summary"]["total_output_tokens"] == 12  # 4 content chunks each
    assert [r["prompt_tokens"] for r in doc["runs"][0]["requests"]] == [12, 12, 12]
    assert server.bodies[0]["model"] == "m"
    assert len(server.bodies[0]["messages"][0]["content"].split()) == 12


def test_poisson_rates_with_length_spread(server: FakeServer, tmp_path: Path) -> None:
    argv = [*_url(server), "--request-rate", "50,200", "--max-concurrency", "2"]
    argv += ["--num-prompts", "8", "--output-len", "4", "--range-ratio", "0.5", "--seed", "5"]
    argv += ["--plot-dir", str(tmp_path)]
    rc, doc = _bench(argv, tmp_path)
    assert rc == 0
    runs = doc["runs"]
    assert [(r["summary"]["mode"], r["summary"]["level"]) for r in runs] == [
        ("rate", 50.0),
        ("rate", 200.0),
    ]
    outs = [b["max_tokens"] for b in server.bodies[:8]]
    assert all(2 <= n <= 6 for n in outs) and runs[0]["summary"]["total_output_tokens"] == sum(outs)
    assert server.max_in_flight <= 2
    assert (tmp_path / "throughput.png").stat().st_size > 1000


@pytest.mark.parametrize("status", [400, 500])
def test_http_errors_are_recorded_and_fail_the_run(
    server: FakeServer, tmp_path: Path, status: int
) -> None:
    server.error_status = status
    rc, doc = _bench([*_url(server), "--num-prompts", "3", "--concurrency", "2"], tmp_path)
    assert rc == 1
    s, reqs = doc["runs"][0]["summary"], doc["runs"][0]["requests"]
    assert (s["completed"], s["failed"]) == (0, 3)
    assert {r["status"] for r in reqs} == {status}
    assert all(f"HTTP {status}" in r["error"] and "fake failure" in r["error"] for r in reqs)


def test_error_event_in_stream_fails_the_request(server: FakeServer, tmp_path: Path) -> None:
    server.stream_error = True
    rc, doc = _bench([*_url(server), "--num-prompts", "2"], tmp_path)
    assert rc == 1
    assert all("engine died" in r["error"] for r in doc["runs"][0]["requests"])


def test_connection_refused_is_counted_not_raised(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["--base-url", f"http://127.0.0.1:{port}/v1", "--model", "m", "--num-prompts", "3"]
    rc, doc = _bench([*argv, "--timeout-s", "5"], tmp_path)
    assert rc == 1
    assert doc["runs"][0]["summary"]["failed"] == 3
    assert all(r["status"] is None and r["error"] for r in doc["runs"][0]["requests"])


def test_duration_cap_stops_new_requests(server: FakeServer, tmp_path: Path) -> None:
    server.token_delay_s = 0.05
    argv = [*_url(server), "--num-prompts", "10", "--output-len", "4", "--duration-s", "0.1"]
    rc, doc = _bench(argv, tmp_path)
    assert rc == 0
    assert doc["runs"][0]["summary"]["completed"] == 1  # the next would start after 0.2 s
    assert len(server.bodies) == 1


def test_duration_cap_with_a_request_rate_ends_the_run_at_the_cap(
    server: FakeServer, tmp_path: Path
) -> None:
    """Arrivals scheduled past ``--duration-s`` are not waited for: the run (and the wall
    time its throughput divides by) ends with the last request sent before the cap, not at
    the last arrival it would have sent (20 arrivals at 2/s: about 10 s)."""
    argv = [*_url(server), "--num-prompts", "20", "--output-len", "2", "--request-rate", "2"]
    rc, doc = _bench([*argv, "--duration-s", "0.5"], tmp_path)
    assert rc == 0
    summary = doc["runs"][0]["summary"]
    assert summary["duration_s"] < 3.0
    assert summary["completed"] == len(server.bodies) < 20


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["--concurrency", "1", "--request-rate", "2"], "--request-rate"),
        (["--request-rate", "0"], "--request-rate"),
        (["--request-rate", "1,-2"], "--request-rate"),
        (["--concurrency", "0"], "--concurrency"),
        (["--concurrency", "2", "--max-concurrency", "4"], "--max-concurrency"),
        (["--goodput", "e2el:500"], "--goodput"),
        (["--goodput", "ttft:fast"], "--goodput"),
        (["--goodput", "tpot:0"], "--goodput"),
        (["--goodput", "ttft:500", "--slo-ttft-ms", "400"], "--goodput"),
        (["--range-ratio", "1.5"], "--range-ratio"),
        (["--min-token-id", "500", "--max-token-id", "10"], "--min-token-id"),
        (["--endpoint", "embeddings"], "--endpoint"),
        (["--backend", "openai-chat"], "--backend"),  # (its endpoint is /v1/chat/completions)
        (["--dataset-name", "sharegpt"], "--dataset-name"),
    ],
)
def test_bad_options_exit_with_an_error_naming_the_option(
    argv: list[str], option: str, capsys: pytest.CaptureFixture[str]
) -> None:
    p = argparse.ArgumentParser(prog="tandem bench")
    add_bench_arguments(p)
    with pytest.raises(SystemExit) as exc:
        run_bench(p.parse_args(argv))
    assert exc.value.code == 2
    assert option in capsys.readouterr().err


def test_api_key_defaults_to_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    args = p.parse_args([])
    assert args.api_key == "sk-env" and args.endpoint == "completions"
    assert args.base_url == "http://127.0.0.1:8000/v1" and args.timeout_s == 300


def test_a_vllm_bench_serve_command_line_runs_as_it_is(server: FakeServer, tmp_path: Path) -> None:
    """``vllm bench serve``'s spellings: the server's root as --base-url with the endpoint's
    path, --random-*-len, --max-concurrency without a rate (N in flight), --goodput and
    --ignore-eos (each was refused, or a 404 at the root's /models)."""
    argv = ["--base-url", f"http://127.0.0.1:{server.port}", "--endpoint", "/v1/chat/completions"]
    argv += ["--random-input-len", "8", "--random-output-len", "3", "--random-range-ratio", "0"]
    argv += ["--max-concurrency", "2", "--goodput", "ttft:5000", "tpot:1000", "--ignore-eos"]
    argv += ["--backend", "openai-chat", "--dataset-name", "random"]
    server.token_delay_s = 0.01  # (each request in flight long enough for the other to start)
    rc, doc = _bench([*argv, "--num-prompts", "4"], tmp_path)
    assert rc == 0
    config = doc["config"]
    assert config["base_url"] == f"http://127.0.0.1:{server.port}/v1"
    assert config["endpoint"] == "chat" and config["concurrency"] == [2]
    assert config["slo_ttft_ms"] == 5000 and config["slo_tpot_ms"] == 1000
    assert len(server.bodies) == 4 and server.max_in_flight == 2  # N in flight, not 1
    assert all("messages" in b and b["max_tokens"] == 3 and b["ignore_eos"] for b in server.bodies)
    (run,) = doc["runs"]
    assert run["summary"]["completed"] == 4 and run["summary"]["goodput"]["share"] == 1.0
