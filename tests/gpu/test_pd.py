"""P/D on one GPU: a prefill and a decode instance sharing the GPU (half each), every request
disaggregated, KV handed off by the default transport; the tokens equal a colocated instance's
on the same GPU and the in-process GPU engine's (float32, greedy). The clusters run in a
process of their own (``pd_run``), with a Ray of their own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.actors.conftest import make_checkpoint
from tests.gpu.conftest import needs_cuda

pytestmark = needs_cuda


@pytest.mark.timeout(900)
def test_disaggregated_equals_colocated_equals_in_process_on_one_gpu(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "model", "llama", seed=5)
    out = tmp_path / "runs.json"
    ray_dir = tempfile.mkdtemp(prefix="tandem-ray-")  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": ray_dir}
    subprocess.run(
        [sys.executable, "-m", "tests.gpu.pd_run", str(model), str(out)],
        check=True,
        cwd=Path(__file__).parents[2],
        env=env,
        timeout=840,
    )
    runs = json.loads(out.read_text())
    assert len(runs["in_process"]) == 12 and all(runs["in_process"])
    assert runs["disaggregated"] == runs["in_process"]
    assert runs["colocated"] == runs["in_process"]
