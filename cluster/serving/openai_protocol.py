"""The OpenAI-compatible request bodies: ``/v1/completions``, ``/v1/chat/completions`` (on
the fields they share, ``sampling_fields.SamplingFields``, which also holds the policy for
every field: implemented, accepted with no effect, or refused), and the other endpoints'
(LoRA adapters, pool resizes, tokenize / detokenize).

Field names, defaults and ranges follow OpenAI's API, with vLLM's extras (``top_k``, ``min_p``,
``min_tokens``, ``ignore_eos``, ``priority``, ``stop_token_ids``, ``repetition_penalty``, ...).
A value out of range fails validation with a message that names the field and its range
(turned into a 400 by the app).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from cluster.serving.agent_fields import (
    FieldError,
    NamedToolChoice,
    Tool,
    ToolCallItem,
)
from cluster.serving.sampling_fields import (
    REFUSED_CHAT,
    REFUSED_VLLM_CHAT,
    SamplingFields,
    _log_unknown,
    _refuse_active,
    _refuse_surrogates,
)
from scheduler import StructuredOutputsParams

TokenIds = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: a prompt (text, token ids, or a batch of either)."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False  # (before max_tokens: its check reads it)
    # 0 with echo: the prompt alone, with its logprobs (loglikelihood evaluation).
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: a text prompt's BOS (the tokenizer's) or not

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
            raise FieldError("best_of", "best_of is not supported (only best_of == n)")
        if self.suffix:
            raise FieldError("suffix", "suffix is not supported")
        return self

    @field_validator("max_tokens")
    @classmethod
    def _zero_with_echo(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("max_tokens must be at least 1 (0 only with echo: the prompt alone)")
        return value

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs), nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def echo_logprobs(self) -> int | None:
        """The prompt logprobs echo needs: the completion's logprobs count, for the prompt."""
        return self.logprobs if self.echo else None

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
    refusal: str | None = None  # an assistant's earlier refusal: kept as history, no effect
    tool_calls: list[ToolCallItem] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: Any = None
    audio: Any = None

    _refused = field_validator("function_call", "audio")(_refuse_active)

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)  # (as vLLM joins them)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    # vLLM's: the tokenizer's special tokens on top of the template's (which writes BOS
    # itself when the model wants one: off by default).
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling (cluster/serving/tool_calls.py).
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # default true: required may return several
    # Refused when they ask for something (REFUSED_CHAT, REFUSED_VLLM_CHAT).
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    moderation: Any = None
    chat_template: Any = None
    continue_final_message: Any = None
    documents: Any = None
    echo: Any = None

    _refused_chat = field_validator(*REFUSED_CHAT, *REFUSED_VLLM_CHAT)(_refuse_active)

    @model_validator(mode="after")
    def _logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:  # (0 is what some SDKs send: as vLLM)
            raise FieldError("top_logprobs", "top_logprobs needs logprobs set to true")
        return self

    @model_validator(mode="after")
    def _tool_choice(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice not in (None, "none") and self.tools is None:
            # As vLLM and OpenAI: a choice among no tools is a client error, not plain text.
            raise FieldError("tool_choice", "When using `tool_choice`, `tools` must be set.")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise FieldError("tools", "tools: function names must be unique")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError(
                "tool_choice", f"tool_choice: no tool named {choice.function.name!r} in tools"
            )
        if choice == "required" and not names:
            raise FieldError("tool_choice", "tool_choice: required needs tools")
        return self

    @property
    def tool_mode(self) -> str | None:
        """How tools are used: None (no tools), "none", "auto", "required", "named"."""
        if not self.tools:
            return None
        choice = self.tool_choice or "auto"
        return "named" if isinstance(choice, NamedToolChoice) else choice

    def tool(self, name: str) -> dict[str, Any]:
        tool = next(t for t in self.tools or [] if t.function.name == name)
        return tool.model_dump(exclude_none=True)

    def tool_dicts(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def structured(self) -> tuple[StructuredOutputsParams | None, str]:
        """A forced call (``required``, a named function) is a JSON schema held by structured
        outputs; asking for other structured outputs with it is a 400."""
        mode = self.tool_mode
        if mode not in ("required", "named"):
            return super().structured()
        if self._structured_param:
            return self._structured, self._structured_param
        spec, param = super().structured()
        if spec is not None:
            raise FieldError(param, f"{param} cannot be combined with tool_choice {mode}")
        from cluster.serving.tool_calls import named_schema, required_schema

        if isinstance(self.tool_choice, NamedToolChoice):
            schema = named_schema(self.tool(self.tool_choice.function.name))
        else:
            try:
                schema = required_schema(self.tool_dicts(), self.parallel_tool_calls is not False)
            except ValueError as exc:
                raise FieldError("tools", str(exc)) from None
        self._structured = StructuredOutputsParams.model_validate({"json": schema})
        self._structured_param = "tools"
        return self._structured, self._structured_param

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


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a prompt (vLLM's shape)."""

    model_config = ConfigDict(extra="allow")  # kept only to be logged (``_log_unknown``)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False

    _unicode = model_validator(mode="before")(_refuse_surrogates)

    @model_validator(mode="after")
    def _unknown(self) -> TokenizeCompletionRequest:
        _log_unknown(self)
        return self


class TokenizeChatRequest(BaseModel):
    """``POST /tokenize`` with a conversation, rendered by the chat template (vLLM's shape)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # the template writes BOS itself
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    tools: list[Tool] | None = None  # rendered as a chat request with them would be
    # Refused when they ask for something, as on chat completions.
    chat_template: Any = None
    continue_final_message: Any = None
    documents: Any = None

    _refused = field_validator("chat_template", "continue_final_message", "documents")(
        _refuse_active
    )

    _unicode = model_validator(mode="before")(_refuse_surrogates)

    @model_validator(mode="after")
    def _unknown(self) -> TokenizeChatRequest:
        _log_unknown(self)
        return self


TokenizeRequest = TokenizeChatRequest | TokenizeCompletionRequest


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]

    _unicode = model_validator(mode="before")(_refuse_surrogates)

    @model_validator(mode="after")
    def _unknown(self) -> DetokenizeRequest:
        _log_unknown(self)
        return self
