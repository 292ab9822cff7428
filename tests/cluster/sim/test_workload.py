"""Workloads: the shapes' generators, traces written and read back, and ``tandem sim run``
from the command line (a trace, a generator, the same numbers twice: one seed, one run, in
separate processes)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.sim.workload import SHAPES, WorkItem, poisson, read_trace, write_trace


def test_each_shape_draws_lengths_around_its_medians() -> None:
    for name in ("chat", "summarization", "agentic"):
        shape = SHAPES[name]
        items = poisson(10.0, 400, name, seed=3)
        prompts = [w.prompt_len for w in items]
        outputs = [w.output_len for w in items]
        assert 0.75 < statistics.median(prompts) / shape.prompt_median < 1.35, name
        assert 0.75 < statistics.median(outputs) / shape.output_median < 1.35, name
        assert all(shape.prompt_min <= p <= shape.prompt_max for p in prompts)
        arrivals = [w.arrival_s for w in items]
        assert arrivals == sorted(arrivals)
        assert 0.8 < len(items) / arrivals[-1] / 10.0 < 1.25  # the rate
    agentic = poisson(10.0, 200, "agentic", seed=3)
    groups = {w.prefix_group for w in agentic}
    assert groups <= set(range(8)) and len(groups) > 4
    assert all(w.prefix_len == 2000 < w.prompt_len for w in agentic)
    group = agentic[0].prefix_group
    (i, first), (j, second) = [(k, w) for k, w in enumerate(agentic) if w.prefix_group == group][:2]
    a, b = first.prompt(0, i), second.prompt(0, j)
    assert a[:2000] == b[:2000] and a[2000:] != b[2000:]  # the group's prefix, then their own


def test_a_trace_is_written_and_read_back_in_arrival_order(tmp_path: Path) -> None:
    items = poisson(4.0, 20, "agentic", seed=1, loras=["a", None])
    path = tmp_path / "trace.jsonl"
    write_trace(list(reversed(items)), path)
    assert read_trace(path) == items
    (tmp_path / "bad.jsonl").write_text('{"arrival_s": 0.1, "prompt_len": 5}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: not a work item"):
        read_trace(tmp_path / "bad.jsonl")


def _sim_run(*args: str) -> dict[str, float]:
    command = [sys.executable, "-m", "cluster.tools.cli", "sim", "run", "--json", *args]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    summary: dict[str, float] = json.loads(run.stdout)["summary"]
    return summary


def test_tandem_sim_run_serves_a_trace_and_a_generator_alike_every_time(tmp_path: Path) -> None:
    items = [WorkItem(0.1 * i, 64 + i, 16) for i in range(12)]
    trace = tmp_path / "trace.jsonl"
    write_trace(items, trace)
    cluster = ["--prefill", "1", "--decode", "1", "--cost", "llama-3-8b@h100-sxm"]
    from_trace = _sim_run(*cluster, "--trace", str(trace), "--slo-ttft-ms", "500")
    assert from_trace["requests"] == 12 and from_trace["finished"] == 12
    assert from_trace["slo_attainment"] == 1.0
    generated = [*cluster, "--rate", "5", "--num-requests", "30", "--shape", "chat", "--seed", "4"]
    first = _sim_run(*generated)
    # (an instance start time changes nothing where no pool grows)
    again = _sim_run(*generated, "--instance-start-s", "30")
    assert first == {**again, "wall_s": first["wall_s"], "speedup": first["speedup"]}
    assert first["finished"] == 30 and first["errors"] == 0
