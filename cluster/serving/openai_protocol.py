"""The OpenAI-compatible request bodies (``/v1/completions``, ``/v1/chat/completions``) and
their translation into ``SamplingParams``.

Field names, defaults and ranges follow OpenAI's API, with vLLM's extras (``top_k``, ``min_p``,
``min_tokens``, ``ignore_eos``, ``priority``, ``stop_token_ids``, ``repetition_penalty``, ...).
Unknown fields are ignored, as vLLM does. A value out of range fails validation with a message
that names the field and its range (turned into a 400 by the app).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from scheduler import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    priority: int = 0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        items = [value] if isinstance(value, str) else (value or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(items)}")
        return value

    @model_validator(mode="after")
    def _streaming_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The scheduler's parameters (``max_tokens`` already resolved against the context)."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
            stop=tuple(stops),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=None if self.seed is None else self.seed % 2**63,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt (text, token ids, or a batch of either)."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be an empty list")
            batch = not all(isinstance(x, int) for x in value)
            if batch and len(value) > 64:
                raise ValueError(f"at most 64 prompts in one request, got {len(value)}")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n)")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens (OpenAI); either works.
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class ScalePoolRequest(BaseModel):
    """``POST /admin/scale_pool``: resize a pool of the cluster while it serves."""

    model_config = ConfigDict(extra="forbid")

    pool: str = Field(min_length=1, description="The pool's name in the ClusterConfig.")
    replicas: int = Field(ge=1, le=1024, description="Instances the pool should have.")
