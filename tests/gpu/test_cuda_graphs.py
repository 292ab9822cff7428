"""Captured decode steps (``actors.model.cuda_graphs``) against eager steps on the same GPU:
the same greedy tokens and logprobs (float32) across batch buckets (with padding rows) and
context-width buckets, steps that mix prefill and decode falling back to eager; the same
cache contents as eager steps, and the padding rows' writes in the scratch block."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.actors.conftest import make_checkpoint
from tests.gpu.conftest import needs_cuda

pytestmark = needs_cuda


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("graph-llama"), "llama", seed=3)


def generate(checkpoint: Path, prompts: list[list[int]], eager: bool) -> tuple[list, Any]:
    """The completions and the LLM."""
    from cluster.engine.llm import LLM

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
    outputs = llm.generate(prompts, params())
    return [o.outputs[0] for o in outputs], llm


def params() -> Any:
    from scheduler import SamplingParams

    return SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("batch", [1, 3, 9])
def test_graph_steps_equal_eager_steps(checkpoint: Path, batch: int) -> None:
    # Lengths up to 150 tokens: rows of 1 to 12 blocks (width buckets 4, 8 and 16).
    gen = torch.Generator().manual_seed(batch)
    lengths = [1 + (37 * i + 11 * batch) % 150 for i in range(batch)]
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in lengths]
    eager, eager_llm = generate(checkpoint, prompts, eager=True)
    graphs, llm = generate(checkpoint, prompts, eager=False)
    assert eager_llm.engine.worker.decode_graphs is None
    decode_graphs = llm.engine.worker.decode_graphs
    assert decode_graphs is not None
    assert decode_graphs.replays >= 30  # the decode steps replayed graphs
    assert all(decode_graphs.graphs.values())  # every capture succeeded
    assert max(b for b, _ in decode_graphs.graphs) >= batch
    for got, ref in zip(graphs, eager, strict=True):
        assert got.token_ids == ref.token_ids
        for lp_got, lp_ref in zip(got.logprobs, ref.logprobs, strict=True):
            assert lp_got.keys() == lp_ref.keys()
            for token, value in lp_ref.items():
                assert abs(lp_got[token] - value) <= 1e-4


def test_graph_steps_write_the_cache_as_eager_steps_do(checkpoint: Path) -> None:
    """Three rows in the 4-row bucket: every request's blocks hold what eager steps wrote, and
    the padding row's K/V goes to the scratch block, which no request owns (the scheduler's
    pool stops before it)."""
    prompts = [[5, 6, 7], [8, 9], [10]]
    eager, eager_llm = generate(checkpoint, prompts, eager=True)
    outputs, llm = generate(checkpoint, prompts, eager=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager]
    worker, eager_worker = llm.engine.worker, eager_llm.engine.worker
    graphs = worker.decode_graphs
    assert graphs is not None and graphs.scratch == worker.num_blocks
    assert (4, 4) in graphs.graphs
    n = worker.num_blocks
    for got, ref in zip(worker.kv_caches, eager_worker.kv_caches, strict=True):
        assert got.shape[1] == n + 1 and ref.shape[1] == n
        assert ref.abs().sum() > 0
        torch.testing.assert_close(got[:, :n], ref, rtol=0, atol=1e-4)
    # The captures' warm-ups wrote the scratch block too: clear it, replay, look again.
    for cache in worker.kv_caches:
        cache[:, graphs.scratch].zero_()
    replays = graphs.replays
    again = llm.generate(prompts, params())
    assert graphs.replays > replays and set(graphs.graphs) == {(4, 4)}
    assert [o.outputs[0].token_ids for o in again] == [o.token_ids for o in eager]
    for cache in worker.kv_caches:
        assert cache[:, graphs.scratch].abs().sum() > 0  # the padding row's K/V
