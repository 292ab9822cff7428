"""``bench.serve_configs``'s llama-server baseline: every slot holds the workloads' requests
(llama-server divides ``--ctx-size`` evenly among its ``--parallel`` slots)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import serve_configs


@pytest.mark.parametrize(
    "workloads", [["c1", "c8", "c32"], ["prefill-heavy"], ["c32", "prefill-heavy", "decode-heavy"]]
)
def test_each_llama_server_slot_holds_the_longest_request(
    monkeypatch: pytest.MonkeyPatch, workloads: list[str]
) -> None:
    import actors.model.loader as loader

    monkeypatch.setattr(loader, "builtin_model_path", lambda: Path("/models/smollm2.gguf"))
    args = argparse.Namespace(workloads=workloads, llama_server="/bin/llama-server", port=8014)
    command = serve_configs.llama_server_command(args)
    slots = int(command[command.index("--parallel") + 1])
    ctx = int(command[command.index("--ctx-size") + 1])
    shapes = [serve_configs.WORKLOADS[w] for w in workloads]
    assert slots == max(s["concurrency"] for s in shapes)
    longest = max(s["input"] + s["output"] for s in shapes)
    assert ctx // slots >= longest + 32  # (and room for the chat template)


def test_the_chat_workloads_keep_their_512_token_slots() -> None:
    assert serve_configs.slot_context(["c1", "c8", "c32"]) == 512
