"""The request body of OpenAI's Responses API (``POST /v1/responses``) and the chat
completion it runs as (``cluster.serving.responses_api`` answers it).

The chat request is built when the body is validated -- ``instructions`` a system message
first, ``input`` items chat messages (a ``function_call`` joins the assistant message before
it, a ``function_call_output`` is a ``tool`` message), function tools in chat's nested form,
``max_output_tokens`` as ``max_completion_tokens``, ``text.format`` as ``response_format`` --
so chat's own checks refuse a body with a 400 naming this API's field (``input``,
``max_output_tokens``, ``text.format``, or the field of the same name).

Nothing is stored: ``store`` is accepted and ignored, and ``previous_response_id`` is a 400
(send the whole conversation as ``input``). Tools other than functions are 400s naming
``tools``; ``background``, ``conversation``, ``prompt``, ``reasoning``, ``context_management``,
``moderation`` and ``top_logprobs`` are 400s when they ask for something (``max_tool_calls``
bounds built-in tools only: accepted). Other unknown fields are ignored and logged once.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from cluster.serving.agent_fields import FieldError, FunctionDefinition
from cluster.serving.openai_protocol import ChatCompletionRequest
from cluster.serving.sampling_fields import _log_unknown, _refuse_active, _refuse_surrogates

# The chat request's fields, by their names here (its errors are given these names).
CHAT_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}
# OpenAI's fields that would change the output and are not implemented: a 400 naming the
# field when it asks for something (values that ask for nothing pass, as on chat).
REFUSED_RESPONSES = (
    *("background", "conversation", "prompt", "reasoning"),
    *("context_management", "moderation", "top_logprobs"),
)


class TextContent(BaseModel):
    """A message's text: ``input_text``, or ``output_text`` (an answer this API returned)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text"]
    text: str


def _joined(content: str | list[TextContent]) -> str:
    """Parts one per line, as chat joins them."""
    return content if isinstance(content, str) else "\n".join(part.text for part in content)


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # (an earlier output's id and status)

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextContent]


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str  # JSON text, as this API returned it


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextContent]


def _item_type(value: Any) -> str | None:
    """An input item's type (a message may leave it out)."""
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", 0)
    return kind if isinstance(kind, str) else None


_Message = Annotated[MessageItem, Tag("message")]
_Call = Annotated[FunctionCallItem, Tag("function_call")]
_CallOutput = Annotated[FunctionCallOutputItem, Tag("function_call_output")]
InputItem = Annotated[
    _Message | _Call | _CallOutput,
    Discriminator(
        _item_type,
        custom_error_type="input_item",
        custom_error_message="an input item is a message, function_call or function_call_output",
    ),
]


class FunctionTool(FunctionDefinition):
    """A function tool in this API's flat form (chat nests it under ``function``)."""

    type: Literal["function"]


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: free text, any JSON object, or a JSON schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        """As chat's ``response_format``."""
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "schema": self.schema_, "strict": self.strict}
        given = {key: value for key, value in spec.items() if value is not None}
        return {"type": "json_schema", "json_schema": given}


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``; the chat request it runs as is built when it is validated."""

    model_config = ConfigDict(extra="allow")  # kept only to be logged (``_log_unknown``)

    model: str | None = Field(None, min_length=1)  # None: the served model (as chat)
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    # Their ranges are chat's (checked when the chat request is built).
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    # vLLM's extras on this API (its ``ResponsesRequest``), passed on as chat's.
    top_k: int | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None  # (null: as unset, as on chat)
    priority: int | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    # Accepted with no effect: nothing is stored (the response says ``store: false``).
    store: bool | None = None
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    stream_options: Any = None
    max_tool_calls: Any = None  # (a bound on built-in tools: none here)
    # Refused: there is no stored response to continue from.
    previous_response_id: str | None = None
    # Refused when they ask for something (REFUSED_RESPONSES).
    background: Any = None
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    context_management: Any = None
    moderation: Any = None
    top_logprobs: Any = None  # (0 asks for nothing)
    _chat: ChatCompletionRequest | None = PrivateAttr(None)

    _unicode = model_validator(mode="before")(_refuse_surrogates)
    _refused = field_validator(*REFUSED_RESPONSES)(_refuse_active)

    @field_validator("tools", mode="before")
    @classmethod
    def _functions_only(cls, value: Any) -> Any:
        for tool in value if isinstance(value, list) else []:
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise FieldError("tools", f"only function tools are supported, not type {kind!r}")
        return value

    @field_validator("previous_response_id")
    @classmethod
    def _nothing_stored(cls, value: str | None) -> str | None:
        if value:
            raise FieldError(
                "previous_response_id",
                "previous_response_id is not supported: responses are not stored (store is "
                "accepted and ignored); send the whole conversation as input",
            )
        return value

    @model_validator(mode="after")
    def _as_chat(self) -> ResponsesRequest:
        _log_unknown(self)
        try:
            self._chat = ChatCompletionRequest.model_validate(self._chat_fields())
        except ValidationError as exc:
            raise _field_error(exc) from None
        return self

    def chat_request(self) -> ChatCompletionRequest:
        """The chat completion this request runs as."""
        assert self._chat is not None
        return self._chat

    def _chat_fields(self) -> dict[str, Any]:
        choice: Any = self.tool_choice
        if isinstance(choice, FunctionChoice):
            choice = {"type": "function", "function": {"name": choice.name}}
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "top_k": self.top_k,
            "logit_bias": self.logit_bias,
            "skip_special_tokens": self.skip_special_tokens,
            "priority": self.priority,
            "user": self.user,
            "stream": bool(self.stream),
            "tool_choice": choice,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools is not None:
            fields["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if self.stream:  # (the usage comes in the chat stream's last chunk)
            fields["stream_options"] = {"include_usage": True}
        if self.text is not None and self.text.format is not None:
            fields["response_format"] = self.text.format.response_format()
        return fields

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, FunctionCallItem):
                function = {"name": item.name, "arguments": item.arguments}
                call = {"id": item.call_id, "type": "function", "function": function}
                if messages and messages[-1]["role"] == "assistant":  # (its text, its calls)
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                output = _joined(item.output)
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
            else:
                messages.append({"role": item.role, "content": _joined(item.content)})
        return messages


def chat_name(name: str) -> str:
    """This API's name of a chat request's field (or of a path in it: its first part)."""
    return CHAT_NAMES.get(name.partition(".")[0], name)


def renamed_text(text: str) -> str:
    """A chat error's text, with this API's field names."""
    for chat in ("max_completion_tokens", "response_format"):
        text = text.replace(chat, CHAT_NAMES[chat])
    return text


def _field_error(exc: ValidationError) -> FieldError:
    """Chat's refusal of the request built from this one, naming this API's field."""
    problems: list[str] = []
    param: str | None = None
    for error in exc.errors():
        cause = (error.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError):
            field, problem = chat_name(cause.param), renamed_text(str(cause))
        else:
            name = str(error["loc"][0]) if error["loc"] else "messages"
            field = chat_name(name)
            problem = f"{field}: {error['msg']}"
        param = param or field
        if problem not in problems:
            problems.append(problem)
    return FieldError(param or "input", "; ".join(problems))
