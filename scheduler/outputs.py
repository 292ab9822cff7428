"""The contract between scheduler and workers: plain dataclasses keyed by request id, no tensors.

``SchedulerOutput`` goes scheduler -> worker once per step; ``ModelRunnerOutput`` comes back.
A new request is sent once in full (``NewRequestData``); after that only diffs
(``CachedRequestData``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.request import FinishReason, LoRARequest, PromptLogprob, Request, SamplingParams

# Top-n logprobs of one sampled position: token id -> logprob (includes the sampled token).
TokenLogprobs = dict[int, float]

# How the error of a request whose workers could not read its LoRA adapter again begins
# (``ModelRunnerOutput.failed_req_ids``, made by ``actors.lora.LoRAManager.unreadable``): the
# control plane then stops counting the adapter as loaded on that instance
# (``LoRAAdapters.unreadable``).
ADAPTER_UNREADABLE = "the LoRA adapter `"


@dataclass
class NewRequestData:
    """A request scheduled for the first time, in full."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # outputs it arrived with (P/D hand-off, migration); else []
    sampling_params: SamplingParams
    block_ids: list[int]  # the whole block table, prefix hits first
    num_computed_tokens: int  # prefix hit + external tokens; this step starts here
    lora_request: LoRARequest | None
    eos_token_id: int | None

    @classmethod
    def from_request(cls, request: Request, block_ids: list[int]) -> NewRequestData:
        return cls(
            req_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=list(request.output_token_ids),
            sampling_params=request.sampling_params,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
            lora_request=request.lora_request,
            eos_token_id=request.eos_token_id,
        )


@dataclass
class CachedRequestData:
    """Diffs for requests the worker has seen before; the lists are aligned by index."""

    req_ids: list[str] = field(default_factory=list)
    # True: resumed after preemption; new_block_ids[i] is then the whole new block table and
    # resumed_token_ids[req_id] holds prompt + outputs so far.
    resumed_from_preemption: list[bool] = field(default_factory=list)
    # Input tokens of this step that the scheduler knows: positions
    # [num_computed_tokens, num_computed_tokens + num_scheduled_tokens), minus async
    # placeholders (the worker fills those from its own last samples).
    new_token_ids: list[list[int]] = field(default_factory=list)
    # Blocks appended to the request's table this step (None: none).
    new_block_ids: list[list[int] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    resumed_token_ids: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """One step for one instance's workers."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str]  # their KV is gone; workers drop per-request state
    finished_req_ids: set[str]  # finished since the previous step; workers free state
    kv_connector_metadata: Any = None  # built by the scheduler-side connector, if any
    step_id: int = 0


@dataclass
class ModelRunnerOutput:
    """One step's results; ``req_ids`` and ``sampled_token_ids`` are aligned.

    ``sampled_token_ids[i]`` is ``[]`` for a partial prefill (no sample). The connector fields
    name requests whose KV send/receive finished (or failed) since the previous report; they
    may name requests that were not in this step.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None = None  # aligned with sampled tokens
    # prompt_logprobs requests: req_id -> (the prompt position of the first entry, entries)
    # for the prompt tokens this step's chunk predicted.
    prompt_logprobs: dict[str, tuple[int, list[PromptLogprob]]] | None = None
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    failed_recving: set[str] | None = None
    # Transport-specific reports for the scheduler-side connector (e.g. where a saved
    # request's KV now lives); handed to ``SchedulerConnector.update_connector_output``.
    kv_connector_output: Any = None
    # Requests of this step the workers could not compute (their LoRA adapter could not be
    # read), with why: they sampled nothing, and end with that error; the others go on.
    failed_req_ids: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if len(self.req_ids) != len(self.sampled_token_ids):
            raise ValueError(
                f"req_ids ({len(self.req_ids)}) and sampled_token_ids "
                f"({len(self.sampled_token_ids)}) must be aligned"
            )
        self.req_id_to_index = {rid: i for i, rid in enumerate(self.req_ids)}

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        return cls(req_ids=[], sampled_token_ids=[])


@dataclass(slots=True)
class EngineCoreOutput:
    """What one request produced in one step (vLLM's name): new tokens and, at the end, why."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0  # prefix-cache hit at admission (usage.cached_tokens)
    kv_transfer_params: dict[str, Any] | None = None  # prefill side: where the KV waits
    new_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None
    # With the first output token of a request that asked: one entry per prompt token (the
    # first None).
    prompt_logprobs: list[PromptLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def merge_outputs(a: EngineCoreOutput, b: EngineCoreOutput) -> EngineCoreOutput:
    """One request's output ``a`` then its next ``b`` as one (a reader that fell behind)."""
    logprobs = None
    if a.new_logprobs is not None or b.new_logprobs is not None:
        logprobs = (a.new_logprobs or []) + (b.new_logprobs or [])
    return EngineCoreOutput(
        a.request_id,
        a.new_token_ids + b.new_token_ids,
        b.finish_reason,
        b.stop_reason,
        b.num_cached_tokens or a.num_cached_tokens,
        None,
        logprobs,
        b.error,
        a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
    )


@dataclass
class SchedulerStats:
    """A snapshot for metrics. Gauges are current; counters cover the time since the last call."""

    num_running_reqs: int
    num_waiting_reqs: int  # queued, including those waiting for remote KV
    num_waiting_for_remote_kvs: int
    kv_cache_usage: float
    prefix_cache_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
