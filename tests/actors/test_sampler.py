"""Sampler: greedy, temperature / top-k / top-p / min-p distributions, penalties against hand
computations, min_tokens, raw logprobs, batch-independent seeds, mixed batches, low-precision
input. Distribution checks draw many samples in one call (one row per draw) under a fixed seed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from actors.batch import TokenSpan
from actors.sampler import (
    Sampler,
    SamplingRow,
    _apply_penalties,
    _top_k_top_p_thresholds,
    draw_seed,
)
from scheduler.request import SamplingParams

sampler = Sampler()
NEG_INF = float("-inf")


@pytest.fixture(autouse=True)
def _fixed_rng() -> None:
    torch.manual_seed(1234)


def row(
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: int | None = None,
    **params: Any,
) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), eos)


def draw(logits: torch.Tensor, num: int, **params: Any) -> torch.Tensor:
    """``num`` independent samples from one row of logits, as counts per token."""
    out = sampler(logits.unsqueeze(0).repeat(num, 1), [row(**params)] * num)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[0])


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson statistic of observed counts against expected probabilities (zero-prob cells
    must be empty)."""
    total = counts.sum().item()
    expected = probs.double() * total
    assert counts[expected == 0].sum() == 0, "sampled a token of probability 0"
    nz = expected > 0
    return float(((counts[nz].double() - expected[nz]) ** 2 / expected[nz]).sum())


# Pearson chi-square critical value for df <= 9 at p ~ 1e-4 (runs are seeded: deterministic).
CHI2_LIMIT = 33.0


# -- greedy -------------------------------------------------------------------------------------
def test_greedy_is_argmax_and_ignores_filters() -> None:
    logits = torch.randn(16, 100)
    out = sampler(logits, [row(temperature=0.0)] * 16)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 16
    # Filters never apply to greedy rows, even a min_p that would cut everything but the max.
    filtered = sampler(logits, [row(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9)] * 16)
    assert filtered.token_ids == out.token_ids
    tiny = sampler(logits, [row(temperature=1e-6)] * 16)
    assert tiny.token_ids == out.token_ids


def test_empty_batch_and_shape_check() -> None:
    assert sampler(torch.empty(0, 10), []).token_ids == []
    with pytest.raises(ValueError, match="num_rows=2"):
        sampler(torch.zeros(3, 10), [row(), row()])


def test_logits_not_mutated() -> None:
    logits = torch.randn(4, 20)
    before = logits.clone()
    rows = [
        row(temperature=0.0, output=[1, 2], repetition_penalty=1.5, frequency_penalty=0.5),
        row(temperature=0.8, top_k=5, top_p=0.7, min_p=0.1),
        row(temperature=1.0, eos=3, min_tokens=4, logprobs=2),
        row(temperature=1.0, seed=7),
    ]
    sampler(logits, rows)
    assert torch.equal(logits, before)


# -- temperature, top-k, top-p, min-p -----------------------------------------------------------
def test_temperature_frequencies_match_softmax() -> None:
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -1.0])
    counts = draw(logits, 40_000, temperature=0.7)
    assert chi2(counts, torch.softmax(logits / 0.7, -1)) < CHI2_LIMIT
    # The check has power: the same counts are far from the untempered distribution.
    assert chi2(counts, torch.softmax(logits, -1)) > 10 * CHI2_LIMIT


def test_high_temperature_flattens() -> None:
    logits = torch.tensor([3.0, 0.0, -3.0])
    counts = draw(logits, 30_000, temperature=5.0)
    assert chi2(counts, torch.softmax(logits / 5.0, -1)) < CHI2_LIMIT


def test_top_k_keeps_only_k_best() -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 0.0, 1.0, -2.0, 0.5])
    counts = draw(logits, 30_000, top_k=3)
    assert set(counts.nonzero().squeeze(1).tolist()) == {1, 3, 5}
    expected = torch.zeros(8)
    expected[[1, 3, 5]] = torch.softmax(logits[[1, 3, 5]], -1)
    assert chi2(counts, expected) < CHI2_LIMIT


def test_top_k_disabled_values_keep_everything() -> None:
    logits = torch.zeros(5)
    for top_k in (0, -1, 5, 50):
        assert (draw(logits, 2_000, top_k=top_k) > 0).all()


def nucleus_logits() -> tuple[torch.Tensor, torch.Tensor]:
    """Known probabilities, shuffled over the vocab: 0.45 0.25 0.15 0.10 0.05."""
    probs = torch.tensor([0.10, 0.45, 0.05, 0.25, 0.15])
    return probs.log(), probs


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.3, {1}), (0.6, {1, 3}), (0.8, {1, 3, 4}), (0.9, {1, 3, 4, 0}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_smallest_nucleus(top_p: float, kept: set[int]) -> None:
    logits, probs = nucleus_logits()
    counts = draw(logits, 30_000, top_p=top_p)
    assert set(counts.nonzero().squeeze(1).tolist()) == kept
    expected = torch.zeros(5)
    expected[list(kept)] = probs[list(kept)] / probs[list(kept)].sum()
    assert chi2(counts, expected) < CHI2_LIMIT


def test_top_k_then_top_p_renormalizes_over_top_k() -> None:
    logits, _ = nucleus_logits()
    # Top-2 renormalized: 0.643, 0.357; top_p=0.6 then keeps only the best token.
    assert draw(logits, 5_000, top_k=2, top_p=0.6).nonzero().squeeze(1).tolist() == [1]
    # Without top-k the same top_p keeps two tokens (0.45 < 0.6).
    assert draw(logits, 5_000, top_p=0.6).nonzero().squeeze(1).tolist() == [1, 3]


def test_top_p_nucleus_wider_than_partial_top_k() -> None:
    # 1000 nearly flat tokens then 1000 negligible ones: the 50% nucleus has hundreds of tokens,
    # more than the partial top-k looks at, so this goes through the full-sort fallback.
    logits = torch.cat([torch.linspace(0.0, -1.0, 1000), torch.full((1000,), -30.0)])
    probs = torch.softmax(logits.double(), -1)
    nucleus = int((probs.cumsum(-1) < 0.5).sum()) + 1
    assert 300 < nucleus < 700
    counts = draw(logits, 3_000, top_p=0.5)
    sampled = set(counts.nonzero().squeeze(1).tolist())
    assert sampled <= set(range(nucleus))
    assert len(sampled) > 0.9 * nucleus


def reference_thresholds(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Per-row full sort in float64: the k-th value, then the smallest top-p prefix."""
    out = []
    for i in range(x.shape[0]):
        values = x[i].double().sort(descending=True).values[: top_k[i]]
        cumulative = torch.softmax(values, -1).cumsum(-1)
        count = int((cumulative < top_p[i]).sum()) + 1 if top_p[i] < 1 else len(values)
        out.append(values[min(count, len(values)) - 1].item())
    return torch.tensor(out)


def test_top_k_top_p_thresholds_match_full_sort_reference() -> None:
    vocab = 1000
    x = torch.randn(12, vocab) * torch.tensor([0.3, 1.0, 3.0, 8.0] * 3).unsqueeze(1)
    top_k = [vocab, vocab, vocab, vocab, 5, 40, 300, 999, vocab, 7, vocab, 600]
    top_p = [0.5, 0.9, 0.95, 0.3, 1.0, 1.0, 1.0, 0.8, 1.0, 0.5, 0.99, 0.7]
    # The sampler filters unnormalized probabilities exp(x - max) (row maximum 1).
    probs = (x - x.amax(-1, keepdim=True)).exp()
    got = _top_k_top_p_thresholds(probs, top_k, top_p)
    want = reference_thresholds(x, top_k, top_p)
    assert got[8] == 0.0  # no filter at all
    keep_got = probs >= got.unsqueeze(1)
    keep_want = x >= want.float().unsqueeze(1)
    keep_want[8] = True
    assert torch.equal(keep_got, keep_want)
    # Several rows really are cut, some below the partial top-k width and some beyond it.
    kept = keep_got.sum(-1)
    assert (kept < 100).sum() >= 4 and (kept > 300).sum() >= 4


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    probs = torch.tensor([0.08, 0.5, 0.12, 0.3])
    counts = draw(probs.log(), 20_000, min_p=0.2)  # cut at 0.1: drops 0.08
    assert set(counts.nonzero().squeeze(1).tolist()) == {1, 2, 3}
    expected = torch.tensor([0.0, 0.5, 0.12, 0.3]) / 0.92
    assert chi2(counts, expected) < CHI2_LIMIT
    counts = draw(probs.log(), 5_000, min_p=0.5)  # cut at 0.25: keeps 0.5 and 0.3
    assert set(counts.nonzero().squeeze(1).tolist()) == {1, 3}


def test_min_p_comes_before_top_p() -> None:
    """vLLM's order: top-p's nucleus is measured over what min-p kept, renormalized. Here
    min-p keeps .5 and .3; the first alone is .625 of that, past top_p = .6."""
    probs = torch.tensor([0.5, 0.3, 0.2])
    counts = draw(probs.log(), 2_000, min_p=0.5, top_p=0.6)
    assert counts.tolist() == [2_000, 0, 0]
    # Min-p at .4 keeps .4/.3/.2 (.44/.33/.22 of what is left): top-p .75 then takes two.
    # Over the whole distribution (.4, .7, .9) it would take three, and min-p keep them.
    # (Top-k's set is the same in either order: k largest, max unchanged.)
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    counts = draw(probs.log(), 5_000, min_p=0.4, top_p=0.75)
    assert set(counts.nonzero().squeeze(1).tolist()) == {0, 1}
    assert chi2(counts, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0])) < CHI2_LIMIT


def test_min_p_uses_tempered_probabilities() -> None:
    probs = torch.tensor([0.6, 0.3, 0.1])
    # At T=0.5 the probabilities become 0.78, 0.20, 0.02: token 2 is now 0.03x the max (0.17x
    # untempered), below min_p=0.1.
    counts = draw(probs.log(), 5_000, temperature=0.5, min_p=0.1)
    assert set(counts.nonzero().squeeze(1).tolist()) == {0, 1}


# -- penalties ----------------------------------------------------------------------------------
def penalized(logits: list[float], r: SamplingRow) -> list[float]:
    x = torch.tensor([logits])
    _apply_penalties(x, [r], [0])
    result: list[float] = x[0].tolist()
    return result


def test_repetition_penalty_over_prompt_and_output() -> None:
    r = row(prompt=[0, 0], output=[1], repetition_penalty=2.0)
    assert penalized([2.0, -1.0, 0.5, 3.0], r) == [1.0, -2.0, 0.5, 3.0]


def test_frequency_penalty_counts_outputs_only() -> None:
    r = row(prompt=[0, 2], output=[2, 2, 3], frequency_penalty=0.5)
    assert penalized([2.0, -1.0, 0.5, 3.0], r) == pytest.approx([2.0, -1.0, -0.5, 2.5])


def test_presence_penalty_once_per_output_token() -> None:
    r = row(prompt=[0], output=[2, 2, 3], presence_penalty=0.75)
    assert penalized([2.0, -1.0, 0.5, 3.0], r) == pytest.approx([2.0, -1.0, -0.25, 2.25])


def test_negative_penalties_reward() -> None:
    r = row(output=[1, 1], frequency_penalty=-1.0, presence_penalty=-0.5)
    assert penalized([0.0, 0.0, 0.0], r) == pytest.approx([0.0, 2.5, 0.0])


def test_penalties_combined() -> None:
    r = row(
        prompt=[0, 4],
        output=[1, 1, 3],
        repetition_penalty=1.25,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    # rep on {0, 1, 3, 4}: 2/1.25, -1*1.25, 4/1.25, -2*1.25; then -(0.5*count + 0.25) on 1 and 3.
    want = [1.6, -1.25 - 1.0 - 0.25, 0.5, 3.2 - 0.5 - 0.25, -2.5]
    assert penalized([2.0, -1.0, 0.5, 4.0, -2.0], r) == pytest.approx(want)


def reference_penalties(logits: list[float], r: SamplingRow) -> list[float]:
    """Dense, one row, straight from the definitions."""
    p, out = r.params, list(r.output_token_ids)
    result = list(logits)
    for t in {*r.prompt_token_ids, *out}:
        v = result[t]
        result[t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
    for t in set(out):
        result[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return result


def test_batched_penalties_match_per_row_reference() -> None:
    vocab = 30
    gen = torch.Generator().manual_seed(5)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    rows = [
        row(prompt=tokens(12), output=tokens(8), repetition_penalty=1.3),
        row(prompt=tokens(5), output=tokens(9)),  # no penalty
        row(prompt=tokens(7), output=tokens(15), frequency_penalty=0.4, presence_penalty=-0.3),
        row(prompt=[], output=tokens(4), repetition_penalty=0.8, presence_penalty=1.1),
        row(prompt=tokens(9), output=[], repetition_penalty=2.0, frequency_penalty=1.0),
        row(prompt=tokens(20), output=tokens(20), repetition_penalty=1.7, frequency_penalty=-0.6),
    ]
    x = torch.randn(len(rows), vocab, generator=gen) * 3
    want = [reference_penalties(x[i].tolist(), r) for i, r in enumerate(rows)]
    _apply_penalties(x, rows, [0, 2, 3, 4, 5])
    assert torch.allclose(x, torch.tensor(want), atol=1e-5)


def test_token_spans_read_as_the_slices_they_stand_for() -> None:
    """The worker hands the sampler views of each request's tokens (no copy per step): they
    read as the slices, keep their bounds as the list grows, and penalize the same."""
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    prompt, output = TokenSpan(tokens, 0, 5), TokenSpan(tokens, 5, 8)
    tokens.append(7)  # this step's sample, appended after the rows were made
    assert (len(prompt), list(prompt), prompt[1], prompt[-1]) == (5, [3, 1, 4, 1, 5], 1, 5)
    assert (len(output), list(output), output[:2], output[-1]) == (3, [9, 2, 6], [9, 2], 6)
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)
    viewed = [SamplingRow(params, prompt, output, None)]
    copied = [SamplingRow(params, tokens[:5], tokens[5:8], None)]
    x = torch.randn(1, 10)
    y, before = x.clone(), x.clone()
    _apply_penalties(x, viewed, [0])
    _apply_penalties(y, copied, [0])
    assert torch.equal(x, y) and not torch.equal(x, before)


def test_penalties_only_touch_their_rows() -> None:
    x = torch.randn(3, 6)
    before = x.clone()
    rows = [row(output=[1]), row(output=[2, 2], frequency_penalty=1.0), row(output=[5])]
    _apply_penalties(x, rows, [1])
    assert torch.equal(x[[0, 2]], before[[0, 2]])
    assert x[1, 2] == pytest.approx(before[1, 2] - 2.0)
    assert torch.equal(x[1, [0, 1, 3, 4, 5]], before[1, [0, 1, 3, 4, 5]])


def test_penalty_token_ids_out_of_vocab_rejected() -> None:
    # A flat offset past the vocab would otherwise land in the next row.
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 4\)"):
        _apply_penalties(torch.zeros(2, 4), [row(output=[4], presence_penalty=1.0)], [0])


def test_non_contiguous_logits() -> None:
    logits = torch.randn(40, 6).t()  # [6, 40], column-major
    top = logits.argmax(-1).tolist()
    rows = [row(temperature=0.0, output=[t] * 10, frequency_penalty=2.0) for t in top]
    want = sampler(logits.contiguous(), rows).token_ids
    assert sampler(logits, rows).token_ids == want
    assert all(w != t for w, t in zip(want, top, strict=True))  # penalties moved every row


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.5, 0.0]] * 3)
    rows = [
        row(temperature=0.0, output=[1], presence_penalty=1.0),  # 3 - 1 < 2.5
        row(temperature=0.0, prompt=[1], repetition_penalty=1.5),  # 3 / 1.5 < 2.5
        row(temperature=0.0, prompt=[1], presence_penalty=1.0),  # prompt does not count
    ]
    assert sampler(logits, rows).token_ids == [2, 2, 1]


# -- min_tokens ---------------------------------------------------------------------------------
MIN_TOKENS_LOGITS = torch.tensor([0.0, 1.0, 2.0, 10.0, 3.0, 9.0])  # eos=3 best, stop=5 next


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = MIN_TOKENS_LOGITS.repeat(4, 1)
    params: dict[str, Any] = {"temperature": 0.0, "eos": 3, "min_tokens": 2, "stop_token_ids": (5,)}
    rows = [row(output=[], **params), row(output=[7], **params), row(output=[7, 7], **params)]
    rows.append(row(output=[], temperature=0.0, eos=3, stop_token_ids=(5,)))
    assert sampler(logits, rows).token_ids == [4, 4, 3, 3]


def test_min_tokens_masks_eos_with_ignore_eos_and_only_stop_ids_without_eos() -> None:
    """vLLM masks its ``all_stop_token_ids`` below min_tokens, EOS among them whatever
    ``ignore_eos`` says: ignore_eos with min_tokens 2 sampled EOS as its first token here."""
    logits = MIN_TOKENS_LOGITS.repeat(4, 1)
    rows = [
        row(temperature=0.0, eos=3, ignore_eos=True, min_tokens=2, stop_token_ids=(5,)),
        row(temperature=0.0, eos=None, min_tokens=2, stop_token_ids=(3,)),
        row(temperature=0.0, eos=None, min_tokens=2, stop_token_ids=(99,)),  # out of vocab
        row(temperature=0.0, eos=3, ignore_eos=True, output=[7, 7], min_tokens=2),  # reached
    ]
    assert sampler(logits, rows).token_ids == [4, 5, 3, 3]


def test_min_tokens_holds_back_the_configs_other_eos_ids_with_ignore_eos() -> None:
    """vLLM's ``all_stop_token_ids`` hold the generation config's other EOS ids too, whatever
    ``ignore_eos`` says (Llama 3.1 Instruct: EOS <|eot_id|>, the config adds <|end_of_text|>
    and <|eom_id|>). Without ignore_eos they are stop ids here as well; with it they are not,
    and the config's second EOS (5) came as the first token of a min_tokens 2 request."""
    logits = MIN_TOKENS_LOGITS.repeat(3, 1)
    params = SamplingParams(temperature=0.0, ignore_eos=True, min_tokens=2)
    rows = [
        SamplingRow(params, [], [], 3, other_eos_ids=(3, 5)),
        SamplingRow(params, [], [7], 3, other_eos_ids=(3, 5, 99)),  # (99: past the vocabulary)
        SamplingRow(params, [], [7, 7], 3, other_eos_ids=(3, 5)),  # reached: EOS may come
    ]
    assert sampler(logits, rows).token_ids == [4, 4, 3]


def test_min_tokens_when_sampling() -> None:
    counts = draw(MIN_TOKENS_LOGITS, 3_000, eos=3, min_tokens=1, stop_token_ids=(5,))
    assert counts[3] == 0 and counts[5] == 0 and counts.sum() == 3_000


# -- logprobs -----------------------------------------------------------------------------------
def test_logprobs_are_raw_top_k_plus_sampled() -> None:
    logits = torch.randn(6, 50) * 2
    rows = [
        row(logprobs=5),
        row(logprobs=0),
        row(),
        row(temperature=0.0, logprobs=3, output=[0, 1], repetition_penalty=3.0),
        row(temperature=0.3, logprobs=20, top_k=2, frequency_penalty=2.0, output=[4]),
        row(temperature=2.0, logprobs=1, eos=int(logits[5].argmax()), min_tokens=1),
    ]
    out = sampler(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    for i, r in enumerate(rows):
        entry = out.logprobs[i]
        if r.params.logprobs is None:
            continue
        assert entry is not None
        k = r.params.logprobs
        token = out.token_ids[i]
        top = raw[i].topk(k).indices.tolist() if k else []
        assert list(entry)[:k] == top  # ranked best first
        assert token in entry
        assert set(entry) == {*top, token}
        assert len(entry) in (k, k + 1)
        for token_id, value in entry.items():
            assert value == pytest.approx(raw[i, token_id].item(), abs=1e-5)
    # The min_tokens row masked its argmax (eos) yet reports it as the raw top-1.
    eos = int(logits[5].argmax())
    assert out.token_ids[5] != eos
    assert list(out.logprobs[5] or {}) == [eos, out.token_ids[5]]


# -- seeds --------------------------------------------------------------------------------------
def test_draw_seed_mixes_seed_and_step() -> None:
    seeds = {draw_seed(s, t) for s in range(20) for t in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 2**63 for s in seeds)
    assert draw_seed(-5, 3) == draw_seed(-5, 3)


def test_seed_is_independent_of_batch() -> None:
    vocab = 1000
    logits = torch.randn(vocab)
    target = row(seed=42, output=[1, 2, 3], top_p=0.95, temperature=0.9)
    alone = sampler(logits.unsqueeze(0), [target]).token_ids[0]
    others = [
        row(),
        row(seed=42, output=[1, 2]),
        row(seed=7, output=[1, 2, 3]),
        row(top_k=500),
        row(temperature=0.0),
        row(top_p=0.2, frequency_penalty=1.0, output=[5]),
        row(seed=3, min_p=0.3),
    ]
    for position in (0, 3, 7):
        for _ in range(3):
            batch = [*others[:position], target, *others[position:]]
            batch_logits = torch.randn(8, vocab)
            batch_logits[position] = logits
            assert sampler(batch_logits, batch).token_ids[position] == alone
    # A fresh sampler, another prompt, a different RNG state: still the same draw.
    torch.manual_seed(99)
    resumed = row(seed=42, prompt=[9, 9], output=[7, 7, 7], top_p=0.95, temperature=0.9)
    assert Sampler()(logits.unsqueeze(0), [resumed]).token_ids[0] == alone


def test_seed_draws_change_with_output_length_and_seed() -> None:
    logits = torch.zeros(1, 1000)
    by_step = {sampler(logits, [row(seed=1, output=[0] * t)]).token_ids[0] for t in range(20)}
    by_seed = {sampler(logits, [row(seed=s, output=[0] * 4)]).token_ids[0] for s in range(20)}
    assert len(by_step) >= 15 and len(by_seed) >= 15


def test_seeded_draws_follow_the_distribution() -> None:
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0])
    rows = [row(seed=s, temperature=0.8) for s in range(10_000)]
    out = sampler(logits.repeat(len(rows), 1), rows)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4)
    assert chi2(counts, torch.softmax(logits / 0.8, -1)) < CHI2_LIMIT


def test_unseeded_rows_vary() -> None:
    logits = torch.zeros(8, 1000)
    first = sampler(logits, [row()] * 8).token_ids
    second = sampler(logits, [row()] * 8).token_ids
    assert first != second


# -- mixed batches and dtypes -------------------------------------------------------------------
def test_mixed_greedy_and_sampled_rows() -> None:
    logits = torch.tensor([[2.0, 2.0, -5.0, 1.9]] * 6)
    rows = [row(temperature=0.0), row(top_k=2), row(temperature=0.0, top_k=2)] * 2
    seen: set[int] = set()
    for _ in range(60):
        tokens = sampler(logits, rows).token_ids
        assert tokens[0] == tokens[2] == tokens[3] == tokens[5] == 0
        assert tokens[1] in (0, 1) and tokens[4] in (0, 1)
        seen.update((tokens[1], tokens[4]))
    assert seen == {0, 1}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_logits(dtype: torch.dtype) -> None:
    logits = (torch.randn(8, 300) * 3).to(dtype)
    greedy = sampler(logits, [row(temperature=0.0)] * 8)
    assert greedy.token_ids == logits.float().argmax(-1).tolist()
    out = sampler(logits, [row(top_k=3, logprobs=2, frequency_penalty=0.5, output=[1])] * 8)
    top3 = logits.float().topk(3).indices
    for i, token in enumerate(out.token_ids):
        assert token in top3[i].tolist()
        entry = out.logprobs[i]
        assert entry is not None
        raw = torch.log_softmax(logits[i].float(), -1)
        for token_id, value in entry.items():
            assert math.isclose(value, raw[token_id].item(), abs_tol=1e-5)


# -- logit bias ---------------------------------------------------------------------------------
def test_logit_bias_moves_greedy_choices_on_its_rows_only() -> None:
    logits = torch.randn(4, 50)
    best = logits.argmax(-1).tolist()
    banned = row(temperature=0.0, logit_bias={best[0]: -100})
    forced = row(temperature=0.0, logit_bias={7: 100})
    plain = row(temperature=0.0)
    outside = row(temperature=0.0, logit_bias={50: 100, 10**9: 100})  # past the vocabulary
    out = sampler(logits, [banned, forced, plain, outside])
    second = logits[0].clone()
    second[best[0]] = NEG_INF
    assert out.token_ids == [int(second.argmax()), 7, best[2], best[3]]


def test_logit_bias_shifts_the_sampled_distribution() -> None:
    logits = torch.tensor([0.0, 0.0, 0.0])
    counts = draw(logits, 4000, temperature=1.0, logit_bias={2: math.log(2.0)})
    assert chi2(counts, torch.tensor([0.25, 0.25, 0.5])) < CHI2_LIMIT


def test_logit_bias_is_checked_and_kept_in_order() -> None:
    params = SamplingParams(logit_bias={"9": 1, 3: -2.5})
    assert params.logit_bias == ((3, -2.5), (9, 1.0))
    with pytest.raises(ValueError, match="outside"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(ValueError, match="negative"):
        SamplingParams(logit_bias={-1: 1})
