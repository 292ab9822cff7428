"""Captured decode steps (``actors.model.cuda_graphs``) against eager steps on the same GPU:
the same greedy tokens and logprobs (float32) across batch buckets (with padding rows) and
context-width buckets, steps that mix prefill and decode falling back to eager, and the
scratch block taking the padding rows' writes (every request's own cache is intact)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.actors.conftest import make_checkpoint
from tests.gpu.conftest import needs_cuda

pytestmark = needs_cuda


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("graph-llama"), "llama", seed=3)


def generate(checkpoint: Path, prompts: list[list[int]], eager: bool) -> tuple[list, object]:
    from cluster.engine.llm import LLM
    from scheduler import SamplingParams

    llm = LLM(
        str(checkpoint),
        device="cuda",
        dtype="float32",
        block_size=16,
        enforce_eager=eager,
        max_num_seqs=16,
        max_num_batched_tokens=64,  # long prompts are chunked: mixed steps run eagerly
        progress=False,
    )
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params)
    return [o.outputs[0] for o in outputs], llm.engine.worker


@pytest.mark.parametrize("batch", [1, 3, 9])
def test_graph_steps_equal_eager_steps(checkpoint: Path, batch: int) -> None:
    # Lengths up to 150 tokens: rows of 1 to 12 blocks (width buckets 4, 8 and 16).
    gen = torch.Generator().manual_seed(batch)
    lengths = [1 + (37 * i + 11 * batch) % 150 for i in range(batch)]
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in lengths]
    eager, eager_worker = generate(checkpoint, prompts, eager=True)
    graphs, worker = generate(checkpoint, prompts, eager=False)
    assert eager_worker.decode_graphs is None
    assert worker.decode_graphs is not None
    assert worker.decode_graphs.replays >= 30  # the decode steps replayed graphs
    batches = {b for b, _ in worker.decode_graphs.graphs}
    assert max(batches) >= batch and all(b in (1, 2, 4, 8, 16) for b in batches)
    for got, ref in zip(graphs, eager, strict=True):
        assert got.token_ids == ref.token_ids
        for lp_got, lp_ref in zip(got.logprobs, ref.logprobs, strict=True):
            assert lp_got.keys() == lp_ref.keys()
            for token, value in lp_ref.items():
                assert abs(lp_got[token] - value) <= 1e-4


def test_padding_rows_write_only_the_scratch_block(checkpoint: Path) -> None:
    """Three rows in the 4-row bucket: the padding row's K/V goes to the scratch block, which
    no request owns (the scheduler's pool stops before it)."""
    outputs, worker = generate(checkpoint, [[5, 6, 7], [8, 9], [10]], eager=False)
    graphs = worker.decode_graphs
    assert graphs is not None and graphs.scratch == worker.num_blocks
    assert (4, 4) in graphs.graphs
    assert worker.kv_caches[0].shape[1] == worker.num_blocks + 1
    scratch = worker.kv_caches[0][:, graphs.scratch]
    assert scratch.abs().sum().item() > 0  # written by the padding rows
    assert all(len(o.token_ids) == 40 for o in outputs)
