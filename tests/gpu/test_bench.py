"""Runs ``bench/model_throughput.py`` on the GPU (a short cell: bf16, batches 1 and 8) on a
random checkpoint of the built-in SmolLM2's shape (the same speed as its real weights; the
GGUF package need not be installed there): it completes and reports positive decode rates for
Tandem with and without its CUDA graphs and for transformers. The full run's numbers go in
docs/model.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.random_checkpoint import write
from tests.gpu.conftest import needs_cuda

pytestmark = needs_cuda


@pytest.mark.timeout(900)
def test_model_throughput_runs_on_the_gpu(tmp_path: Path) -> None:
    out = tmp_path / "model_throughput.json"
    model = write("smollm2-135m", tmp_path / "model", device="cuda")
    cmd = [
        sys.executable,
        "-m",
        "bench.model_throughput",
        "--device",
        "cuda",
        "--model",
        str(model),
    ]
    cmd += ["--batches", "1", "8", "--dtypes", "bfloat16", "--new-tokens", "32"]
    cmd += ["--repeat", "1", "--quantizations", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=Path(__file__).parents[2], timeout=840)
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [row["batch"] for row in rows] == [1, 8]
    for row in rows:
        assert row["tandem"]["decode_tok_s"] > 0
        assert row["tandem-eager"]["decode_tok_s"] > 0
        assert row["hf-loop"]["decode_tok_s"] > 0
