"""The soak's short version (``bench/soak.py --quick``): 30 s of mixed traffic through the
real Serve app -- streamed and whole, ``n`` = 2, long prompts, LoRA, seeded sampling, dropped
clients, bursts over the waiting bound -- while a worker is killed every 7 s. Nothing may be
lost: every greedy output equals its calm reference, every request has an outcome, and the
KV blocks and the object store are back to idle once the load drains."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.conftest import CHAT_TEMPLATE, free_port, own_ray_env

pytest.importorskip("ray")


def test_mixed_traffic_with_faults_loses_nothing(
    tiny_model: Path, tmp_path: Path
) -> None:
    model = tmp_path / "tiny-chat"
    shutil.copytree(tiny_model, model)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    out = tmp_path / "soak.json"
    command = [sys.executable, "-m", "bench.soak", "--quick", "--model", str(model)]
    command += ["--port", str(free_port()), "--num-blocks", "256", "--out", str(out)]
    with own_ray_env("tandem-soak-") as env:
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    assert out.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert run.returncode == 0 and report["ok"], run.stdout[-3000:]
    requests = report["requests"]
    assert requests["checked"] >= 50  # greedy outputs compared with their references
    assert requests.get("rejected", 0) > 0  # the bursts passed the waiting bound
    assert requests.get("aborted", 0) > 0  # clients dropped their streams
    assert not report["mismatches"] and report["no_outcome"] == 0
    assert not any(report["leaked_blocks"].values())
    assert report["objects_after_drain"] <= report["objects_baseline"]
    kills = report["kills"]
    assert len(kills) >= 2 and all(k["moved_after_s"] is not None for k in kills), kills
    assert all(k["rejoined_after_s"] is not None for k in kills), kills
    assert report["failures"] == {}, report["failures"]
