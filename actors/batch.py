"""A worker's mirror of the requests it runs, kept from the scheduler's diffs (DESIGN.md §3.3):
a new request arrives in full once; afterwards only new block ids, the computed-token count
and the step's input tokens. Tokens the worker samples itself are appended at once, so a later
step whose input tokens the scheduler does not know yet (async scheduling) still finds them.
``collect_batch`` turns a ``SchedulerOutput`` into the step's batch."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import overload

from actors.structured_output import GrammarState
from scheduler import SchedulerOutput
from scheduler.request import LoRARequest, SamplingParams


@dataclass
class RequestState:
    """What the worker keeps per request between steps."""

    req_id: str
    token_ids: list[int]  # prompt + outputs known so far (including this worker's samples)
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    lora: LoRARequest | None
    eos_token_id: int | None
    # Structured outputs: the matcher, fed the outputs so far (built at the first sample;
    # rebuilt from the tokens after a resume, a hand-off, a move).
    grammar: GrammarState | None = None
    # prompt_logprobs asked for and not sent yet elsewhere: false for a request that arrives
    # with outputs (a P/D decode part, a move: its first output carried them).
    wants_prompt_logprobs: bool = False


@dataclass
class Scheduled:
    state: RequestState
    start: int  # num_computed_tokens at this step
    num_tokens: int  # scheduled this step

    @property
    def samples(self) -> bool:
        # Only a request that reaches the end of its known tokens samples; a partial prefill
        # chunk does not.
        return self.start + self.num_tokens >= len(self.state.token_ids)


def update_requests(requests: dict[str, RequestState], so: SchedulerOutput) -> None:
    """Apply a step's diffs: finished requests go, preempted ones lose their blocks, new
    ones arrive in full, running ones get new blocks, resumed tokens and input tokens."""
    for req_id in so.finished_req_ids:
        requests.pop(req_id, None)
    for req_id in so.preempted_req_ids:
        state = requests.get(req_id)
        if state is not None:  # its blocks are gone; the rest is kept for the resume
            state.block_ids = []
    for new in so.scheduled_new_reqs:
        requests[new.req_id] = RequestState(
            req_id=new.req_id,
            token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
            num_prompt_tokens=len(new.prompt_token_ids),
            params=new.sampling_params,
            block_ids=list(new.block_ids),
            lora=new.lora_request,
            eos_token_id=new.eos_token_id,
            wants_prompt_logprobs=(
                new.sampling_params.prompt_logprobs is not None and not new.output_token_ids
            ),
        )
    cached = so.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        state = requests.get(req_id)
        if state is None:
            raise RuntimeError(f"scheduler sent a diff for unknown request {req_id!r}")
        new_blocks = cached.new_block_ids[i]
        if cached.resumed_from_preemption[i]:
            state.block_ids = list(new_blocks or [])
            state.token_ids = list(cached.resumed_token_ids[req_id])
            if len(state.token_ids) > state.num_prompt_tokens:
                # Its prompt's logprobs went out with its first token: recomputing the
                # prompt (prompt length x vocabulary of log-softmax) would be for nobody.
                state.wants_prompt_logprobs = False
            grammar = state.grammar
            if grammar is not None and not grammar.extends(
                state.token_ids[state.num_prompt_tokens :]
            ):
                state.grammar = None  # rebuilt from the resumed outputs
        elif new_blocks:
            state.block_ids.extend(new_blocks)
        start = cached.num_computed_tokens[i]
        for offset, token in enumerate(cached.new_token_ids[i]):
            pos = start + offset
            if pos < len(state.token_ids):
                state.token_ids[pos] = token
            else:
                state.token_ids.append(token)


def collect_batch(
    requests: dict[str, RequestState], so: SchedulerOutput, block_size: int
) -> list[Scheduled]:
    """The step's requests with the span of tokens each runs, checked against what the
    worker knows (tokens, blocks)."""
    batch = []
    starts = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
    cached = so.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    for req_id, num_tokens in so.num_scheduled_tokens.items():
        state = requests.get(req_id)
        if state is None:
            raise RuntimeError(f"request {req_id!r} scheduled but never sent to this worker")
        start = starts[req_id]
        end = start + num_tokens
        if end > len(state.token_ids):
            raise RuntimeError(
                f"request {req_id!r}: tokens [{start}, {end}) scheduled but only "
                f"{len(state.token_ids)} are known"
            )
        if -(-end // block_size) > len(state.block_ids):
            raise RuntimeError(
                f"request {req_id!r}: {end} tokens need more than its {len(state.block_ids)} blocks"
            )
        batch.append(Scheduled(state, start, num_tokens))
    return batch


class TokenSpan(Sequence[int]):
    """``tokens[start:stop]`` without the copy: a request's prompt or outputs so far, as a
    sampling row sees them. Most rows only need its length (min_tokens, a seed's draw), and
    slicing every row's whole context every step cost milliseconds at long contexts. The
    bounds are fixed when it is made; the list may grow past ``stop`` (this step's token)."""

    __slots__ = ("_start", "_stop", "_tokens")

    def __init__(self, tokens: list[int], start: int, stop: int) -> None:
        self._tokens, self._start, self._stop = tokens, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._tokens, self._start, self._stop)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._tokens[self._start : self._stop][index]  # (rare: tests, logging)
