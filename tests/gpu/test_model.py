"""Our model on a GPU: logits against Hugging Face transformers on the same GPU and weights,
through the paged cache (prefill, chunked prefill, batched decode), with the attention backend
the worker would pick (vllm-flash-attn for bf16 where installed); greedy text equal between the
GPU and CPU engines in float32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.actors.conftest import make_checkpoint, transformers
from tests.actors.paged import PagedRunner
from tests.gpu.conftest import needs_cuda

pytestmark = needs_cuda


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gpu-llama"), "llama", seed=2)


def hf_logits(model_dir: Path, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda()
    with torch.no_grad():
        return model(torch.tensor([tokens], device="cuda")).logits[0].float().cpu()


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 9, 30, 1, 12, 25, 5][:n]
    return [torch.randint(0, 256, (length,), generator=gen).tolist() for length in lengths]


# This checkpoint's logits have a spread (std) of about 0.16; transformers' bf16 logits are
# within 0.004 of its float32 ones.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.03}


def flash_installed() -> bool:
    try:
        import vllm_flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def gpu_runner(checkpoint: Path, dtype: torch.dtype) -> PagedRunner:
    # block 16: flash-attn's paged kernel needs block_size % 16 == 0.
    runner = PagedRunner(checkpoint, block_size=16, dtype=dtype, device="cuda")
    if dtype == torch.bfloat16 and flash_installed():
        assert runner.attn.name == "vllm-flash-attn", runner.attn.name  # not a silent fallback
    return runner


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prefill_and_decode_logits_match_transformers(checkpoint: Path, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    seqs = prompts(4)
    runner = gpu_runner(checkpoint, dtype)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]) != 1)
    out = runner.step([(f"s{i}", seqs[i], 0) for i in order])
    for got, i in zip(out, order, strict=True):
        ref = hf_logits(checkpoint, seqs[i], dtype)
        assert (got - ref).abs().max().item() <= tol, f"prompt {i}"
    full = [list(s) for s in seqs]
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in range(8):
        batch = []
        for i, f in enumerate(full):
            f.append(3 + (step * 7 + i) % 200)
            batch.append((f"s{i}", [f[-1]], len(f) - 1))
        for i, logits in enumerate(runner.step(batch)):
            rows[i].append(logits[0])
    for i, f in enumerate(full):
        ref = hf_logits(checkpoint, f, dtype)[len(seqs[i]) :]
        assert (torch.stack(rows[i]) - ref).abs().max().item() <= tol, f"decode {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunked_prefill_matches_transformers(checkpoint: Path, dtype: torch.dtype) -> None:
    """Chunks of 7 continuing a cached prefix (bf16: flash-attn's paged path with an offset)."""
    long = prompts(4, seed=9)[3]
    runner = gpu_runner(checkpoint, dtype)
    pieces = [runner.step([("x", long[s : s + 7], s)])[0] for s in range(0, len(long), 7)]
    ref = hf_logits(checkpoint, long, dtype)
    assert (torch.cat(pieces) - ref).abs().max().item() <= TOLERANCE[dtype]


def test_greedy_text_equal_on_gpu_and_cpu(checkpoint: Path) -> None:
    from cluster.engine.llm import LLM
    from scheduler import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    seqs = prompts(6, seed=4)
    runs = {}
    for device in ("cuda", "cpu"):
        llm = LLM(str(checkpoint), device=device, dtype="float32", block_size=16, progress=False)
        runs[device] = [o.outputs[0].token_ids for o in llm.generate(seqs, params)]
    assert runs["cuda"] == runs["cpu"]


def test_structured_outputs_on_the_gpu(checkpoint: Path) -> None:
    """The grammar's bitmask is built on the CPU and applied to logits on the GPU (a mask on
    another device than the logits failed every step that sampled a constrained row), with
    an unconstrained request in the same batch."""
    from cluster.engine.llm import LLM
    from scheduler import SamplingParams, StructuredOutputsParams

    llm = LLM(str(checkpoint), device="cuda", dtype="float32", block_size=16, progress=False)
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    params = [
        SamplingParams(max_tokens=8, temperature=1.0, seed=s, structured_outputs=choice)
        for s in range(4)
    ] + [SamplingParams(max_tokens=8, temperature=0.0)]
    outs = llm.generate(prompts(5, seed=7), params)
    assert all(o.outputs[0].text in {"yes", "no", "maybe"} for o in outs[:4])
    assert len(outs[4].outputs[0].token_ids) == 8
