"""Requests as the scheduler sees them: token ids, sampling limits, status, KV bookkeeping."""

from __future__ import annotations

import enum
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class RequestRejected(ValueError):
    """A request that can never be served here, by its own fault (its prompt does not fit
    the context, it names an adapter where LoRA is off): the client's error, where other
    ``ValueError``s of ``Scheduler.add_request`` are the caller's (an id in use, a request
    moved with its output already complete)."""


class RequestStatus(enum.IntEnum):
    """Ordered so that ``status > PREEMPTED`` is "finished" (one comparison)."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything below is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


# One prompt position's logprobs: {token id: logprob} (the prompt's own token and the top-k),
# and the rank of the prompt's own token (1: the most likely).
PromptLogprob = tuple[dict[int, float], int]


class FinishReason(str, enum.Enum):
    """OpenAI-style finish reasons reported to clients."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class StructuredOutputsParams(BaseModel):
    """What a request's output must match (vLLM's ``StructuredOutputsParams``): exactly one of
    a JSON schema, any JSON object, a regular expression, a choice of strings, or a grammar
    (Lark, or GBNF as llama.cpp and vLLM's xgrammar take it). The worker's sampler masks every
    token the grammar forbids (``actors/structured_output.py``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    # The schema as JSON text (a schema object is serialized in its own key order: the order
    # of "properties" is the order the keys are generated in).
    json_schema: str | None = Field(None, alias="json")
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_text(cls, value: object) -> object:
        if isinstance(value, dict | bool):
            return json.dumps(value, separators=(",", ":"))
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsParams:
        given = [
            name
            for name, value in (
                ("json", self.json_schema),
                ("json_object", self.json_object or None),
                ("regex", self.regex),
                ("choice", self.choice),
                ("grammar", self.grammar),
            )
            if value is not None
        ]
        if len(given) != 1:
            raise ValueError(
                "structured outputs take exactly one of json, json_object, regex, choice, "
                f"grammar; got {', '.join(given) or 'none'}"
            )
        if self.choice is not None and not self.choice:
            raise ValueError("choice must list at least one string")
        return self

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec): what a compiled grammar is cached by."""
        if self.json_schema is not None:
            return ("json", self.json_schema)
        if self.json_object:
            return ("json", '{"type":"object"}')
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", json.dumps(list(self.choice)))
        assert self.grammar is not None
        return ("grammar", self.grammar)


class SamplingParams(BaseModel):
    """Per-request sampling and stopping parameters (vLLM's names and defaults).

    The scheduler reads the stopping fields (``max_tokens``, ``min_tokens``, ``stop_token_ids``,
    ``ignore_eos``); the worker's sampler reads the rest. ``n > 1`` is fanned out into ``n``
    requests by the front end (engine or ingress), so the scheduler only ever sees ``n == 1``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1 disables top-k.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    seed: int | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    # Per prompt token after the first: its logprob and the top ``prompt_logprobs`` others
    # (vLLM's). Such a request computes its whole prompt: prefix-cache hits are skipped.
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias: -100 bans
    # a token, 100 all but forces it); ids outside the model's vocabulary are ignored.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Read by the front end (engine or ingress), which detokenizes: a stop string found in the
    # text ends the request through ``Scheduler.finish_requests``.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # The output must match this (JSON schema, regex, choice, grammar): the sampler masks
    # what it forbids, and the request ends (EOS) once it is complete.
    structured_outputs: StructuredOutputsParams | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: object) -> object:
        if isinstance(value, str):
            return (value,)
        if value is None:
            return ()
        return value

    @field_validator("seed", mode="before")
    @classmethod
    def _minus_one_is_no_seed(cls, value: object) -> object:
        # vLLM's rule: seed -1 asks for a random draw (no seed), not the fixed seed -1.
        return None if value == -1 else value

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_pairs(cls, value: object) -> object:
        if isinstance(value, dict):
            return tuple(sorted((int(k), float(v)) for k, v in value.items()))
        return () if value is None else value

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        for token_id, bias in value:
            if token_id < 0:
                raise ValueError(f"logit_bias token id {token_id} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias value {bias} is outside [-100, 100]")
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop_string(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @model_validator(mode="after")
    def _check_cross_fields(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})."
            )
        return self

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids)


class LoRARequest(BaseModel):
    """A LoRA adapter a request runs with. Equality and hashing use the name, as in vLLM."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lora_name: str = Field(min_length=1)
    lora_int_id: int = Field(ge=1)
    lora_path: str = Field(min_length=1)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)


class Request:
    """One sequence being generated.

    Invariant the whole scheduler turns on: ``num_computed_tokens`` catches up with
    ``num_tokens`` (prompt + outputs). It is advanced optimistically when a step is scheduled
    (``num_in_flight_tokens`` counts what is scheduled but not yet returned) and reset only by
    preemption or a failed KV load (to 0).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        cache_salt: str | None = None,
        output_token_ids: list[int] | None = None,
        num_samples: int = 1,
        sample_index: int = 0,
        prompt_index: int = 0,
    ) -> None:
        """``num_samples``: the ``n`` of the user request this one is sample ``sample_index``
        of (the scheduler sees only ``n == 1``; admission and metrics count a user request
        once, by its sample 0). ``prompt_index``: its prompt's place among one user
        request's prompts (a batched completion): admission takes those prompts as one, by
        the first. ``output_token_ids``: outputs already produced
        elsewhere (the first token sampled by a prefill instance; the tokens a client already
        has when a request moves to another instance). They count toward ``max_tokens`` and
        are computed (or loaded) like the prompt, and the request continues after them."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.priority = priority
        self.lora_request = lora_request
        self.kv_transfer_params = kv_transfer_params
        self.cache_salt = cache_salt
        self.num_samples = num_samples
        self.sample_index = sample_index
        self.prompt_index = prompt_index

        self.status = RequestStatus.WAITING
        self.num_prompt_tokens = len(self.prompt_token_ids)
        # Prompt + outputs, and outputs. Plain lists for speed (read and appended on every
        # step); outside the scheduler, mutate through append_output_token_ids.
        self.output_token_ids: list[int] = list(output_token_ids or ())
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        # Resolved by the scheduler at add_request (set_limits).
        self.max_tokens: int = sampling_params.max_tokens or 0
        self.stop_token_ids = sampling_params.all_stop_token_ids
        self.stop_reason: int | str | None = None
        # A cheap pre-check for the per-token stop test: any token in stop_check_ids, or
        # reaching max_num_tokens, may stop the request (check_stop then decides how).
        self.stop_check_ids: frozenset[int] = frozenset()
        self.max_num_tokens = 0

        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0  # scheduled, output not yet processed
        self.num_output_placeholders = 0  # async scheduling: samples not yet returned
        self.num_preemptions = 0
        self.num_cached_tokens: int | None = None  # prefix hit at first admission
        self.num_skipped_steps = 0  # aging: steps passed over while it could not be admitted
        # Remote-KV state: set when the load was started, consumed when it completes.
        self.awaiting_remote_kvs = False
        self.preempted_before_load = False  # resume as PREEMPTED once the load completes
        # One hash per full block of all_token_ids, extended lazily by the KV cache manager.
        self.block_hashes: list[bytes] = []
        # Derived from the KV cache manager's tables, written only by it (and checked by
        # check_integrity): token slots its blocks hold, and the token count at which its
        # next block becomes full and must be hashed. They let the scheduler skip the
        # manager for the common decode that needs neither a block nor a hash.
        self.kv_slots = 0
        self.kv_hash_boundary = 0
        # Its blocks hold externally loaded KV not yet known good: do not hash them.
        self.kv_hash_deferred = False
        # prompt_logprobs: entry p is prompt token p's (None for p = 0 and until computed),
        # handed over with the first output token (then None: nothing more to compute, and
        # prefix-cache hits are allowed again). None from the start for a request that
        # arrives with outputs (P/D decode part, a move): its first output carried them.
        wanted = sampling_params.prompt_logprobs is not None and not self.output_token_ids
        self.prompt_logprobs: list[PromptLogprob | None] | None = (
            [None] * self.num_prompt_tokens if wanted else None
        )

    # -- views -----------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0

    @property
    def do_remote_prefill(self) -> bool:
        return bool(self.kv_transfer_params and self.kv_transfer_params.get("do_remote_prefill"))

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    # -- mutation --------------------------------------------------------------------------
    def set_limits(self, max_model_len: int) -> None:
        """Resolve the stopping limits (the scheduler calls this at add_request): an unset
        ``max_tokens`` becomes ``max_model_len - prompt length``, as in vLLM."""
        max_tokens = self.sampling_params.max_tokens
        self.max_tokens = (
            max_tokens if max_tokens is not None else (max_model_len - self.num_prompt_tokens)
        )
        ids = set(self.stop_token_ids)
        if self.eos_token_id is not None and not self.sampling_params.ignore_eos:
            ids.add(self.eos_token_id)
        self.stop_check_ids = frozenset(ids)
        self.max_num_tokens = min(self.num_prompt_tokens + self.max_tokens, max_model_len)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)

    def trim_output_tokens(self, num: int) -> None:
        """Drop the last ``num`` output tokens (tokens sampled after a stop)."""
        if num > 0:
            del self.output_token_ids[-num:]
            del self.all_token_ids[-num:]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
