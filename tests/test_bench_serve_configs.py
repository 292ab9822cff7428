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


def test_cpu_per_token_divides_by_the_tokens_the_window_streamed() -> None:
    """8 prompts of 128 tokens, 3 failed, 2 warm-up requests: the window streamed 7 x 128
    tokens (scaling the 5 x 128 by 10 / 8 gave 800: the CPU per token 12 % high)."""
    summary = {"completed": 5, "failed": 3, "total_output_tokens": 5 * 128}
    assert serve_configs.window_tokens(summary) == 7 * 128
    clean = {"completed": 8, "failed": 0, "total_output_tokens": 8 * 128}
    assert serve_configs.window_tokens(clean) == 10 * 128
    nothing = {"completed": 0, "failed": 8, "total_output_tokens": 0}
    assert serve_configs.window_tokens(nothing) == 0.0
