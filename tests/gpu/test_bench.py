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

from tests.actors.conftest import make_checkpoint
from tests.gpu.conftest import needs_cuda

pytestmark = needs_cuda

# SmolLM2-135M's layout (Llama; 30 layers, GQA 9/3, tied head).
SMOLLM2_SHAPE = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


@pytest.mark.timeout(900)
def test_model_throughput_runs_on_the_gpu(tmp_path: Path) -> None:
    out = tmp_path / "model_throughput.json"
    model = make_checkpoint(tmp_path / "model", "llama", seed=1, **SMOLLM2_SHAPE)
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
