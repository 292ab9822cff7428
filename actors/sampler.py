"""Token sampling for one engine step, vectorized over the requests that sample in it.

One row of ``logits`` per request; every stage works on the whole batch (or on the subset of rows
that need it) with a handful of tensor ops::

    raw logits (any float dtype) ──► float32 copy
        ├─► logprobs: top-k of log_softmax(raw)                  rows with params.logprobs set
        ├─► min_tokens: EOS and stop ids → -inf                  rows below min_tokens
        ├─► logit_bias: + bias at the given ids                   rows with a logit_bias
        ├─► penalties: repetition (prompt + output),              rows with a penalty
        │              frequency / presence (output)
        ├─► grammar: tokens it forbids → -inf (all forbidden: EOS) rows with structured outputs
        ├─► greedy rows (temperature < 1e-5): argmax
        └─► random rows: exp((x - max) / T) ─► min-p, then top-k / top-p cut-offs ─► 0 below
                         ─► ÷ Exp(1) noise ─► argmax            (exponential race = categorical)

The sampler keeps no state between calls. A seeded row draws its noise from a generator seeded
with a mix of ``(seed, len(output_token_ids))``, so its token depends only on its own logits and
that pair: it does not change with the rest of the batch, and a request recomputed on another
worker or resumed after preemption continues exactly where it was.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from actors.structured_output import allowed_tokens
from scheduler.request import SamplingParams

# At or below this temperature a row is sampled greedily (vLLM's epsilon).
_GREEDY_TEMPERATURE = 1e-5
# Top-p first looks for the nucleus among this many best tokens; rows whose nucleus is larger
# fall back to a full sort (a full sort of 64 x 49152 logits costs ~10x a top-256 on CPU).
_PARTIAL_TOPK = 256
_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """One request that samples a token this step."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # outputs so far, before this step's sample
    eos_token_id: int | None
    # The model's other EOS ids (its config's): held back below min_tokens with the EOS,
    # ignore_eos or not, as vLLM's all_stop_token_ids hold them (without ignore_eos they
    # are stop ids too; with it they are not, and only this mask keeps them back).
    other_eos_ids: Sequence[int] = ()


@dataclass
class SamplerOutput:
    """What one call samples, in row order."""

    token_ids: list[int]  # one per row
    # Per row: ``{token id: raw logprob}`` with the top ``params.logprobs`` tokens and then the
    # sampled one (k or k + 1 entries); None where the row did not ask for logprobs.
    logprobs: list[dict[int, float] | None]


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, step: int) -> int:
    """Generator seed (63 bits) for draw number ``step`` of a request seeded with ``seed``.

    Mixed so that neighbouring seeds and neighbouring steps give unrelated streams.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step) >> 1


def _uses_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
    )


class Sampler:
    """Samples one token per row from ``logits`` [num_rows, vocab] (see the module docstring).

    Stateless and safe to share; it never mutates ``logits`` or the rows. Unseeded rows draw from
    the default torch generator of the logits' device (one batched draw per call).
    """

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        grammar: tuple[list[int], torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """Sample one token for each row; ``logits[i]`` belongs to ``rows[i]``. ``grammar``:
        the rows with structured outputs and their bitmask (one int32 row each, bit ``t`` of
        word ``t // 32`` set where token ``t`` is allowed; ``actors.structured_output``)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows={len(rows)}, vocab]; got {tuple(logits.shape)}."
            )
        num_rows, vocab = logits.shape
        if num_rows == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        params = [row.params for row in rows]
        greedy = [p.temperature < _GREEDY_TEMPERATURE for p in params]
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        penalized = [i for i, p in enumerate(params) if _uses_penalties(p)]
        mask_rows, mask_ids = _min_tokens_entries(rows, vocab)
        bias_rows, bias_ids, bias_values = _logit_bias_entries(rows, vocab)
        if all(greedy) and not (lp_rows or penalized or mask_rows or bias_rows or grammar):
            # Argmax is exact in any float dtype, but torch's CPU argmax over bf16 is about
            # twice as slow as converting to float32 first.
            if logits.device.type == "cpu" and logits.dtype != torch.float32:
                logits = logits.float()
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * num_rows)

        x = logits.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
        device = x.device
        raw_logprobs = None
        if lp_rows:
            raw_logprobs = _take_rows(x, lp_rows).log_softmax(dim=-1)
        if mask_rows:
            x[torch.tensor(mask_rows, device=device), torch.tensor(mask_ids, device=device)] = (
                float("-inf")
            )
        if bias_rows:
            x.view(-1).index_add_(
                0,
                torch.tensor(bias_rows, device=device) * vocab
                + torch.tensor(bias_ids, device=device),
                torch.tensor(bias_values, device=device, dtype=torch.float32),
            )
        if penalized:
            _apply_penalties(x, rows, penalized)
        if grammar:
            _apply_grammar(x, rows, *grammar, mask_rows)

        greedy_rows = [i for i in range(num_rows) if greedy[i]]
        random_rows = [i for i in range(num_rows) if not greedy[i]]
        if not random_rows:
            tokens = x.argmax(dim=-1)
        elif not greedy_rows:
            tokens = _sample_random(x, rows)  # x is our copy: may be overwritten
        else:
            tokens = torch.empty(num_rows, dtype=torch.long, device=device)
            greedy_idx = torch.tensor(greedy_rows, device=device)
            random_idx = torch.tensor(random_rows, device=device)
            tokens[greedy_idx] = x[greedy_idx].argmax(dim=-1)
            tokens[random_idx] = _sample_random(x[random_idx], [rows[i] for i in random_rows])

        token_ids: list[int] = tokens.tolist()
        logprobs: list[dict[int, float] | None] = [None] * num_rows
        if raw_logprobs is not None:
            _fill_logprobs(logprobs, raw_logprobs, lp_rows, params, tokens)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def _take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``x[rows]`` (a copy), or ``x`` itself when ``rows`` is every row in order."""
    if len(rows) == x.shape[0]:
        return x
    return x[torch.tensor(rows, device=x.device)]


def _min_tokens_entries(rows: Sequence[SamplingRow], vocab: int) -> tuple[list[int], list[int]]:
    """(row, token id) pairs to mask: EOS and stop ids of the rows that have not yet produced
    ``min_tokens`` outputs. EOS is masked with ``ignore_eos`` too, as vLLM does (its
    ``all_stop_token_ids`` always hold EOS and the config's other EOS ids, ``other_eos_ids``):
    ``min_tokens`` means no EOS before then, whether or not one would end the request. Ids
    outside the vocabulary are skipped."""
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) >= p.min_tokens:
            continue
        ids = set(p.stop_token_ids)
        ids.update(row.other_eos_ids)
        if row.eos_token_id is not None:
            ids.add(row.eos_token_id)
        for token_id in ids:
            if 0 <= token_id < vocab:
                mask_rows.append(i)
                mask_ids.append(token_id)
    return mask_rows, mask_ids


def _logit_bias_entries(
    rows: Sequence[SamplingRow], vocab: int
) -> tuple[list[int], list[int], list[float]]:
    """(row, token id, bias) triples of the rows' ``logit_bias``; ids outside the vocabulary
    are skipped."""
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        for token_id, bias in row.params.logit_bias:
            if 0 <= token_id < vocab:
                bias_rows.append(i)
                bias_ids.append(token_id)
                values.append(bias)
    return bias_rows, bias_ids, values


def _apply_grammar(
    x: torch.Tensor,
    rows: Sequence[SamplingRow],
    grammar_rows: list[int],
    bitmask: torch.Tensor,
    min_tokens_rows: list[int],
) -> None:
    """Send the logits of the tokens each grammar row forbids to -inf. A row left with no
    token (min_tokens held EOS back where the grammar allows only EOS: the only way a row
    can empty) takes EOS: the grammar is complete, and EOS keeps its output valid."""
    forbidden = ~allowed_tokens(bitmask, x.shape[1]).to(x.device)  # (the mask: on the CPU)
    if len(grammar_rows) == x.shape[0]:  # every row: in place
        x.masked_fill_(forbidden, float("-inf"))
    else:
        idx = torch.tensor(grammar_rows, device=x.device)
        x[idx] = x[idx].masked_fill_(forbidden, float("-inf"))
    held_back = set(min_tokens_rows)
    for row in grammar_rows:
        if row in held_back and bool(torch.isneginf(x[row]).all()):
            eos = rows[row].eos_token_id
            if eos is not None:
                x[row, eos] = 0.0


def _apply_penalties(x: torch.Tensor, rows: Sequence[SamplingRow], idx: list[int]) -> None:
    """Apply repetition, frequency and presence penalties to rows ``idx`` of ``x`` (contiguous
    float32 [num_rows, vocab]), in place.

    Repetition looks at prompt and output tokens (a positive logit is divided by the penalty, a
    negative one multiplied); then frequency (x count) and presence (x seen) are subtracted over
    output tokens only. Sparse: gathers and scatters only the (row, token) pairs that occur, so
    the cost follows the number of tokens, not rows x vocab.
    """
    flat_x = x.view(-1)
    params = {i: rows[i].params for i in idx}
    rep_rows = [i for i in idx if params[i].repetition_penalty != 1.0]
    if rep_rows:
        owners = [i for i in rep_rows for _ in range(2)]
        seqs = [s for i in rep_rows for s in (rows[i].prompt_token_ids, rows[i].output_token_ids)]
        row_ids, flat = _flat_index(owners, seqs, x)
        penalty = _per_row(x, {i: params[i].repetition_penalty for i in rep_rows}, 1.0)[row_ids]
        # A token repeated in the sequence is written several times, always with the same value.
        values = flat_x.index_select(0, flat)
        flat_x.index_copy_(0, flat, torch.where(values > 0, values / penalty, values * penalty))

    out_rows = [
        i for i in idx if params[i].frequency_penalty != 0.0 or params[i].presence_penalty != 0.0
    ]
    if out_rows:
        row_ids, flat = _flat_index(out_rows, [rows[i].output_token_ids for i in out_rows], x)
        presence = _per_row(x, {i: params[i].presence_penalty for i in out_rows}, 0.0)[row_ids]
        frequency = _per_row(x, {i: params[i].frequency_penalty for i in out_rows}, 0.0)[row_ids]
        # Presence: a plain write, so a token seen several times is still penalized once.
        flat_x.index_copy_(0, flat, flat_x.index_select(0, flat) - presence)
        # Frequency: accumulated, once per occurrence.
        flat_x.index_add_(0, flat, -frequency)


def _flat_index(
    owners: list[int], seqs: Sequence[Sequence[int]], x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten token sequences (``seqs[j]`` belongs to row ``owners[j]``) into index tensors on
    ``x``'s device: the row of each token, and its offset ``row * vocab + token`` in ``x``."""
    vocab = x.shape[1]
    lengths = [len(s) for s in seqs]
    # np.fromiter reads the Python ints ~5x faster than torch.tensor(list).
    tokens = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=sum(lengths))
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        # A flat offset out of range would silently land in another row.
        raise ValueError(f"token ids must be in [0, {vocab}); got {tokens.min()}..{tokens.max()}.")
    row_ids = torch.repeat_interleave(torch.tensor(owners), torch.tensor(lengths))
    flat = row_ids * vocab + torch.from_numpy(tokens)
    return row_ids.to(x.device), flat.to(x.device)


def _per_row(x: torch.Tensor, values: dict[int, float], default: float) -> torch.Tensor:
    """A [num_rows] float32 tensor on ``x``'s device: ``values[i]`` at row i, else ``default``."""
    column = [values.get(i, default) for i in range(x.shape[0])]
    return torch.tensor(column, dtype=torch.float32, device=x.device)


def _sample_random(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Sample one token per row of ``x`` (float32 logits, overwritten) with temperature, top-k,
    top-p and min-p. Returns the token ids [num_rows] (long)."""
    num_rows = x.shape[0]
    device = x.device
    params = [row.params for row in rows]
    inv_temperature = torch.tensor([1.0 / p.temperature for p in params], device=device)
    # Unnormalized probabilities exp((x - max) / T), in place: the row maximum is exactly 1, and
    # every filter and the race below work without the normalizer (no logsumexp pass).
    x.sub_(x.amax(dim=-1, keepdim=True)).mul_(inv_temperature.unsqueeze(1)).exp_()
    threshold = _cutoff_thresholds(x, params)
    if threshold is not None:
        x.masked_fill_(x < threshold.unsqueeze(1), 0.0)

    # Exponential race: argmax(p_i / q_i) with q_i ~ Exp(1) draws i with probability p_i. With
    # q = -log(u) that is argmin(p_i / log(u_i)); u is clamped away from 0 so log(u) is finite
    # and the row maximum (p = 1, a strictly negative score) always beats a dropped token (-0.0).
    u = torch.empty_like(x)
    seeded = [(j, p.seed) for j, p in enumerate(params) if p.seed is not None]
    if len(seeded) < num_rows:
        u.uniform_()
    for j, seed in seeded:
        generator = torch.Generator(device=device)
        generator.manual_seed(draw_seed(seed, len(rows[j].output_token_ids)))
        u[j].uniform_(generator=generator)
    log_u = u.clamp_min_(torch.finfo(u.dtype).tiny).log_()
    return x.div_(log_u).argmin(dim=-1)


def _cutoff_thresholds(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """Drops (zeroes, in place) the tokens below min-p, then returns the per-row probability
    below which top-k, then top-p, drop tokens, or None when no row has either. ``probs`` is
    unnormalized with row maximum 1. Tokens tied with a cut-off are kept.

    vLLM's order: min-p first, so the top-p nucleus is measured over what min-p left (taking
    the larger of the two cut-offs instead kept a wider nucleus: p = .5 .3 .2 with min_p .5
    and top_p .6 keeps only the first token, renormalized .625 >= .6, not the first two)."""
    if any(p.min_p > 0.0 for p in params):
        # p_i >= min_p * p_max, and p_max is 1 here.
        min_p = torch.tensor([p.min_p for p in params], device=probs.device)
        probs.masked_fill_(probs < min_p.unsqueeze(1), 0.0)
    vocab = probs.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if any(k < vocab for k in top_k) or any(tp < 1.0 for tp in top_p):
        return _top_k_top_p_thresholds(probs, top_k, top_p)
    return None


def _top_k_top_p_thresholds(
    probs: torch.Tensor, top_k: list[int], top_p: list[float]
) -> torch.Tensor:
    """Per-row cut-off probability for top-k (``top_k[i] == vocab``: off) followed by top-p over
    the renormalized top-k (``top_p[i] == 1``: off). ``probs`` may be unnormalized.

    Works on the best ``width`` entries of each row (``torch.topk``, sorted); a top-p row whose
    nucleus is not inside them (possible only without top-k) is redone with a full sort. Both
    paths compute the same prefix sums, so a row's cut-off does not depend on the other rows.
    """
    num_rows, vocab = probs.shape
    device = probs.device
    k = torch.tensor(top_k, device=device)
    # Top-p off is encoded as 2.0 so that a cumulative sum rounding up to 1.0 never cuts.
    p = torch.tensor([tp if tp < 1.0 else 2.0 for tp in top_p], device=device)
    needs_total = [i for i in range(num_rows) if top_k[i] == vocab and top_p[i] < 1.0]
    total = torch.ones(num_rows, device=device)
    if needs_total:
        total[torch.tensor(needs_total, device=device)] = _take_rows(probs, needs_total).sum(-1)

    max_k = max((kk for kk in top_k if kk < vocab), default=1)
    width = min(vocab, max(max_k, _PARTIAL_TOPK if needs_total else 1))
    values = probs.topk(width, dim=-1).values
    threshold, resolved = _thresholds_from_sorted(values, k, p, total, vocab)
    if not bool(resolved.all()):
        # Nucleus wider than `width`: sort those rows in full (top-k is off for them).
        idx = (~resolved).nonzero().squeeze(1)
        full_values = probs[idx].sort(dim=-1, descending=True).values
        threshold[idx], _ = _thresholds_from_sorted(full_values, k[idx], p[idx], total[idx], vocab)
    return threshold


def _thresholds_from_sorted(
    values: torch.Tensor, k: torch.Tensor, p: torch.Tensor, total: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut-offs from each row's best ``width`` probabilities sorted in descending order.

    ``total`` is the row's full mass (used where top-k is off). Returns (threshold, resolved):
    resolved is False where the nucleus may extend past ``width``.

    ``count`` below is the number of tokens kept, e.g. for top_k=4, top_p=0.7::

        values      .40 .30 .20 .05 | .03 ...    (k=4: mass .95 renormalizes the prefix)
        cumulative  .42 .74 .95 1.0 |
        < p ?        1   0   0   0   -> count = 1 + 1 = 2, threshold = values[1] = .30
    """
    width = values.shape[1]
    position = torch.arange(width, device=values.device)
    kept = values.masked_fill(position.unsqueeze(0) >= k.unsqueeze(1), 0.0)
    cumulative = kept.cumsum(dim=-1)
    # With top-k on, top-p renormalizes over the top-k tokens (k <= width here). Taking the
    # norm from the prefix sums keeps it independent of `width`.
    last_k = (k.clamp(max=width) - 1).unsqueeze(1)
    norm = torch.where(k < vocab, cumulative.gather(1, last_k).squeeze(1), total)
    # Smallest prefix whose mass reaches p: the positions still below p, plus one.
    count = (cumulative < (p * norm).unsqueeze(1)).sum(dim=-1) + 1
    count = torch.minimum(count, k)
    last = (count.clamp(max=width) - 1).unsqueeze(1)
    threshold = values.gather(1, last).squeeze(1)
    # Rows with neither filter keep everything (and need no full sort).
    unfiltered = (k >= vocab) & (p > 1.0)
    threshold.masked_fill_(unfiltered, 0.0)
    return threshold, (count <= width) | unfiltered


def _fill_logprobs(
    out: list[dict[int, float] | None],
    raw_logprobs: torch.Tensor,
    lp_rows: list[int],
    params: list[SamplingParams],
    tokens: torch.Tensor,
) -> None:
    """Write ``out[i]`` for each row in ``lp_rows``: its top-k raw logprobs, then the sampled
    token's. ``raw_logprobs[j]`` belongs to row ``lp_rows[j]``."""
    device = raw_logprobs.device
    sampled = tokens[torch.tensor(lp_rows, device=device)].unsqueeze(1)
    sampled_lp: list[float] = raw_logprobs.gather(1, sampled).squeeze(1).tolist()
    sampled_ids: list[int] = sampled.squeeze(1).tolist()
    counts = [params[i].logprobs or 0 for i in lp_rows]
    top_ids: list[list[int]] = [[] for _ in lp_rows]
    top_lp: list[list[float]] = [[] for _ in lp_rows]
    if max(counts) > 0:
        top = raw_logprobs.topk(max(counts), dim=-1)
        top_ids, top_lp = top.indices.tolist(), top.values.tolist()
    for j, i in enumerate(lp_rows):
        entry = dict(zip(top_ids[j][: counts[j]], top_lp[j][: counts[j]], strict=True))
        entry[sampled_ids[j]] = sampled_lp[j]
        out[i] = entry
