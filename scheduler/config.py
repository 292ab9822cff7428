"""Scheduler, KV-cache and LoRA configuration (pydantic, vLLM's knob names).

Every model forbids unknown fields and checks cross-field rules in a ``model_validator``; a bad
value raises ``ValueError`` (pydantic's ``ValidationError`` is one) whose message names the field
and the allowed range. Nothing here asserts on user input.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SchedulingPolicy = Literal["fcfs", "priority"]
KVLoadFailurePolicy = Literal["recompute", "fail"]

# vLLM accepts these LoRA ranks; anything else is a configuration error.
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class _Config(BaseModel):
    # Frozen: validated once, never half-changed. To change a value, build a new config:
    # SchedulerConfig(**{**cfg.model_dump(), "max_num_seqs": 64}).
    model_config = ConfigDict(extra="forbid", frozen=True)


class SchedulerConfig(_Config):
    """What one instance's scheduler may put into a step (vLLM's ``SchedulerConfig``)."""

    max_num_seqs: int = Field(128, ge=1, description="Most requests running at once.")
    max_num_batched_tokens: int = Field(
        2048,
        ge=1,
        description="Token budget of one step, shared by running then waiting requests "
        "(unset with chunked prefill off: max(max_model_len, 2048)).",
    )
    max_model_len: int = Field(
        8192, ge=2, description="Longest sequence (prompt + output) a request may reach."
    )
    enable_chunked_prefill: bool = Field(
        True, description="Split long prompts across steps to fit the token budget."
    )
    long_prefill_token_threshold: int = Field(
        0,
        ge=0,
        description="Cap on one request's prefill tokens per step when several requests are "
        "present (0 = no cap).",
    )
    policy: SchedulingPolicy = Field("fcfs", description="Waiting-queue order.")
    async_scheduling: bool = Field(
        False,
        description="Schedule step N+1 before step N's output returns (output placeholders).",
    )
    scheduler_reserve_full_isl: bool = Field(
        True, description="Admit a request only if its whole prompt fits in free blocks."
    )
    watermark: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Fraction of blocks kept free when admitting new requests.",
    )
    num_lookahead_slots: int = Field(
        0, ge=0, description="Extra KV slots allocated per step beyond the scheduled tokens."
    )
    # Tandem additions (DESIGN §4).
    strict_fcfs: bool = Field(
        False,
        description="Stop the waiting pass at the first request that cannot be admitted "
        "(vLLM's behaviour). When False, it is skipped so smaller requests behind it run.",
    )
    max_skip_steps: int = Field(
        32,
        ge=0,
        description="Aging bound: after being passed over this many steps, a waiting request "
        "blocks the queue until it is admitted, so it cannot starve.",
    )
    kv_load_failure_policy: KVLoadFailurePolicy = Field(
        "recompute",
        description="What a failed remote KV load does: recompute the prompt locally, or fail "
        "the request.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_budget(cls, data: Any) -> Any:
        # vLLM: without chunked prefill, an unset budget grows to hold a whole prompt.
        if isinstance(data, dict) and data.get("max_num_batched_tokens") is None:
            data = dict(data)
            data.pop("max_num_batched_tokens", None)
            if data.get("enable_chunked_prefill") is False:
                max_model_len = data.get("max_model_len", 8192)
                if isinstance(max_model_len, int):
                    data["max_num_batched_tokens"] = max(max_model_len, 2048)
        return data

    @model_validator(mode="after")
    def _check_cross_fields(self) -> SchedulerConfig:
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) with enable_chunked_prefill=False: a "
                "prompt of max_model_len tokens could never be scheduled. Raise "
                "max_num_batched_tokens, lower max_model_len, or enable chunked prefill."
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}): each running request needs at least "
                "one token of budget per step."
            )
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) must be "
                f"<= max_model_len ({self.max_model_len})."
            )
        if self.long_prefill_token_threshold > 0 and not self.enable_chunked_prefill:
            raise ValueError(
                "long_prefill_token_threshold > 0 splits prefills into chunks and requires "
                "enable_chunked_prefill=True."
            )
        return self


class CacheConfig(_Config):
    """The paged KV cache of one instance."""

    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    num_blocks: int | None = Field(
        None,
        ge=1,
        description="Usable KV blocks (no reserved null block). None = profiled by the worker.",
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse KV blocks of identical prefixes across requests."
    )
    # vLLM's cache_dtype and gpu_memory_utilization are not offered: the cache takes the
    # model's dtype, and a pool sizes its cache with num_blocks, kv_cache_memory_bytes or
    # memory_budget_bytes (the cluster config's ``InstancePool``).


class LoRAConfig(_Config):
    """Multi-LoRA limits (vLLM's ``LoRAConfig``)."""

    max_loras: int = Field(1, ge=1, description="Most distinct adapters in one batch.")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="Adapters kept loaded by a worker (LRU); defaults to max_loras."
    )
    max_lora_rank: int = Field(16, description=f"Highest adapter rank, one of {_LORA_RANKS}.")

    @model_validator(mode="after")
    def _check_cross_fields(self) -> LoRAConfig:
        if self.max_lora_rank not in _LORA_RANKS:
            raise ValueError(
                f"max_lora_rank ({self.max_lora_rank}) must be one of {list(_LORA_RANKS)}."
            )
        if self.max_cpu_loras is None:
            # The model is frozen; the validator may still fill in the derived default.
            self.__dict__["max_cpu_loras"] = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})."
            )
        return self
