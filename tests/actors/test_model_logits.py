"""Our paged model's logits equal Hugging Face transformers' on the same weights (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.actors.conftest import make_checkpoint, transformers
from tests.actors.paged import PagedRunner

TOL = 1e-4


def hf_logits(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 9, 30, 1, 12, 25, 5][:n]
    return [torch.randint(0, 256, (length,), generator=gen).tolist() for length in lengths]


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-rope-llama3", "llama-tied"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    if kind == "llama-rope-llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 50000.0,
        }
        return make_checkpoint(path, "llama", seed=3, rope_parameters=scaling)
    if kind == "llama-tied":
        return make_checkpoint(path, "llama", seed=4, tie_word_embeddings=True)
    return make_checkpoint(path, kind, seed=2)


def test_prefill_batch_matches_hf(checkpoint: Path) -> None:
    seqs = prompts(6)
    runner = PagedRunner(checkpoint)
    # One flattened step: the 1-token prompt is a "decode"-shaped row and goes first.
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]) != 1)
    out = runner.step([(f"s{i}", seqs[i], 0) for i in order])
    for got, i in zip(out, order, strict=True):
        ref = hf_logits(checkpoint, seqs[i])
        assert (got - ref).abs().max().item() <= TOL, f"prompt {i}"


def test_decode_matches_hf(checkpoint: Path) -> None:
    """Prefill, then 12 decode steps with three sequences batched (paged decode)."""
    seqs = prompts(3, seed=5)
    runner = PagedRunner(checkpoint)
    runner.step([(f"s{i}", s, 0) for i, s in enumerate(seqs)])
    gen = torch.Generator().manual_seed(7)
    full = [list(s) for s in seqs]
    got_rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    for _ in range(12):
        batch = []
        for i, f in enumerate(full):
            f.append(int(torch.randint(0, 256, (1,), generator=gen)))
            batch.append((f"s{i}", [f[-1]], len(f) - 1))
        for i, logits in enumerate(runner.step(batch)):
            got_rows[i].append(logits[0])
    for i, f in enumerate(full):
        ref = hf_logits(checkpoint, f)[len(seqs[i]) :]
        got = torch.stack(got_rows[i])
        assert (got - ref).abs().max().item() <= TOL


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch-ops"])
def test_chunked_prefill_matches_hf(checkpoint: Path, cpu_kernels: bool) -> None:
    """A 30-token prompt in chunks of 7 next to a decoding sequence: our C kernels (the chunks
    continuing a prefix on the paged kernel) and the torch ops alike."""
    long, short = prompts(4, seed=9)[3], prompts(2, seed=9)[0]
    runner = PagedRunner(checkpoint, cpu_kernels=cpu_kernels)
    runner.step([("short", short, 0)])
    pieces: list[torch.Tensor] = []
    short_full = list(short)
    for start in range(0, len(long), 7):
        short_full.append(3)
        out = runner.step(
            [("short", [3], len(short_full) - 1), ("long", long[start : start + 7], start)]
        )
        pieces.append(out[1])
    ref = hf_logits(checkpoint, long)
    assert (torch.cat(pieces) - ref).abs().max().item() <= TOL
    ref_short = hf_logits(checkpoint, short_full)[len(short) :]
    assert ref_short.shape[0] == len(short_full) - len(short)


def test_prefix_hit_same_logits_as_no_cache(tiny_llama: Path) -> None:
    """A second sequence reusing the first one's cached blocks computes only its suffix."""
    base = prompts(4, seed=11)[3][:24]
    runner = PagedRunner(tiny_llama)
    runner.step([("a", base, 0)])
    suffix = [5, 6, 7, 8, 9]
    runner.share_prefix("a", "b", 20)  # 5 full blocks of 4
    hit = runner.step([("b", base[20:] + suffix, 20)])[0]
    fresh = PagedRunner(tiny_llama).step([("c", base + suffix, 0)])[0][20:]
    assert (hit - fresh).abs().max().item() <= TOL


def test_decode_equals_full_recompute(tiny_qwen2: Path) -> None:
    """Greedy decoding through the paged cache equals recomputing the whole sequence each
    step without any cache."""
    prompt = prompts(2, seed=13)[1]
    paged = PagedRunner(tiny_qwen2)
    seq = list(prompt)
    logits = paged.step([("x", seq, 0)])[0][-1]
    for _ in range(10):
        token = int(logits.argmax())
        recompute = PagedRunner(tiny_qwen2).step([("y", [*seq, token], 0)])[0][-1]
        seq.append(token)
        logits = paged.step([("x", [token], len(seq) - 1)])[0][0]
        assert (logits - recompute).abs().max().item() <= TOL


def test_loading_imports_neither_dynamo_nor_sympy(tiny_llama: Path) -> None:
    """Building the model on the meta device and giving it storage runs no op whose meta
    kernel is a Python reference: those import torch._dynamo and sympy, which took 1.4 s of
    every worker's start (a fresh process: this one has them from transformers)."""
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; from actors.model.loader import load_model; "
        f"load_model(Path({str(tiny_llama)!r}), progress=False); "
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "[]", (
        out.stdout + out.stderr
    )
