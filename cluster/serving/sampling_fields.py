"""The sampling fields both OpenAI endpoints share (``SamplingFields``), their translation
into ``SamplingParams``, and the policy for every other field.

No field is silently dropped. Every field of OpenAI's request schemas (and the vLLM extras that
change an output) is one of: implemented; accepted with no effect by design (``ACCEPTED``:
metadata such as ``user`` or ``store``, hints such as ``prompt_cache_key`` -- prefix caching is
automatic -- or ``prediction``, a latency hint that never changes the output); or refused with
a 400 naming it when given a value that would change the output (``REFUSED``: ``tools``,
``response_format``, ... -- ``tools: []`` or ``response_format: {"type":
"text"}`` ask for nothing and pass). Other unknown fields are ignored, as vLLM does, and logged
once per name.
"""

from __future__ import annotations

import logging
import typing
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from cluster.serving.agent_fields import (
    SURROGATE,
    FieldError,
    given_spec,
    response_format_spec,
    structured_outputs_spec,
)
from scheduler import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

# Accepted, with no effect by design (OpenAI's fields; docs/serve.md says why for each).
ACCEPTED = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "safety_identifier",
    "prediction",
)
# Refused with a 400 naming the field when it asks for something (not yet implemented).
REFUSED_CHAT = (
    "functions",
    "function_call",
    "audio",
    "modalities",
    "web_search_options",
    "reasoning_effort",
    "verbosity",
    "moderation",
)
REFUSED_COMPLETION: tuple[str, ...] = ()
REFUSED_VLLM = (  # vLLM's extras that change an output
    "guided_whitespace_pattern",
    "allowed_token_ids",
    "bad_words",
    "logits_processors",
    "truncate_prompt_tokens",
    "use_beam_search",
    "length_penalty",
    "return_tokens_as_token_ids",
)
REFUSED_VLLM_CHAT = ("chat_template", "continue_final_message", "documents", "echo")
# Values that ask for nothing: such a field passes even where it is refused.
_INACTIVE: tuple[Any, ...] = (
    *(None, False, "", [], {}, 1.0),
    *("none", "auto", ["text"], {"type": "text"}),
)
_logged_unknown: set[str] = set()
_MAX_LOGGED_UNKNOWN = 256  # distinct names logged; a client sending random keys stops there


# A field's own further values that ask for nothing: JSON writers drop a float's ".0", so
# length_penalty 1 is 1.0 (elsewhere 1 may ask for something: truncate_prompt_tokens 1); the
# Responses API's top_logprobs 0 asks for no logprobs.
_ALSO_INACTIVE: dict[str, tuple[Any, ...]] = {"length_penalty": (1,), "top_logprobs": (0,)}


def _takes_none(annotation: Any) -> bool:
    return annotation is None or type(None) in typing.get_args(annotation)


def _refuse_active(value: Any, info: ValidationInfo) -> Any:
    inactives = (*_INACTIVE, *_ALSO_INACTIVE.get(info.field_name or "", ()))
    if any(value == inactive and type(value) is type(inactive) for inactive in inactives):
        return value
    raise ValueError(f"{info.field_name} is not supported")


def _surrogate_at(body: Any) -> str | None:
    """Where the first string of a JSON body (a value, or a key: its object's path) holding
    an unpaired surrogate is (``messages.0.content``; ``body`` at the top); None when none
    does. Iterative: the JSON parser's nesting bound is not this stack's."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            if SURROGATE.search(value):
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and SURROGATE.search(key):
                    return path or "body"
                todo.append((f"{path}.{key}" if path else str(key), item))
        elif isinstance(value, list):
            todo.extend(
                (f"{path}.{i}" if path else str(i), x)
                for i, x in enumerate(value)
                if isinstance(x, str | dict | list)  # (not each id of a token-id prompt)
            )
    return None


def _refuse_surrogates(data: Any) -> Any:
    """A body's strings must be Unicode text: a 400 naming the field otherwise."""
    where = _surrogate_at(data)
    if where is not None:
        raise FieldError(
            where,
            "the text holds an unpaired UTF-16 surrogate (a lone \\ud800-\\udfff escape), "
            "which is not valid Unicode",
        )
    return data


def _log_unknown(model: BaseModel) -> None:
    for name in model.model_extra or {}:
        if name not in _logged_unknown and len(_logged_unknown) < _MAX_LOGGED_UNKNOWN:
            _logged_unknown.add(name)
            logger.warning("ignoring the unknown request field %r (logged once)", name)


class StreamOptions(BaseModel):
    """OpenAI's (null: false, as unset)."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow")  # kept only to be logged (``_log_unknown``)

    model: str | None = Field(None, min_length=1)  # None: the served model (as vLLM)
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

    # Accepted with no effect (ACCEPTED; ``user`` is declared above).
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: Any = None
    prediction: Any = None
    # OpenAI's: token id (a string of ASCII digits: JSON keys are strings) -> a bias in
    # [-100, 100], added to its logit; the schema says both.
    logit_bias: (
        dict[
            Annotated[str, Field(pattern=r"^[0-9]+$")],
            Annotated[float, Field(ge=-100.0, le=100.0)],
        ]
        | None
    ) = None
    # Structured outputs (``_structured``): OpenAI's response_format, vLLM's
    # structured_outputs and its older guided_* fields -- one of them per request.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted: one backend (llguidance) serves all
    _structured: StructuredOutputsParams | None = PrivateAttr(None)
    _structured_param: str = PrivateAttr("")
    # vLLM's: per prompt token, its logprob and the top-k (non-streamed responses).
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # Refused when they ask for something (REFUSED_*; see ``_refuse_active``).
    guided_whitespace_pattern: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    truncate_prompt_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    return_tokens_as_token_ids: Any = None

    _refused = field_validator(*REFUSED_COMPLETION, *REFUSED_VLLM, mode="after")(_refuse_active)

    @field_validator("logit_bias")
    @classmethod
    def _bias_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """An id of more than 20 digits is past any vocabulary (and one of more than 4,300
        is past what ``int()`` reads: a 500 where the id is checked against the vocabulary)."""
        for key in value or {}:
            if len(key) > 20:
                raise ValueError(
                    f"token id {key[:20]}... ({len(key)} digits) is outside the vocabulary"
                )
        return value

    def logit_bias_ids(self) -> list[int]:
        return [int(k) for k in self.logit_bias or {}]

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """OpenAI's schema lets a client send ``null`` for an optional field (``n``,
        ``stream``, the penalties, ``logprobs``, ``echo``, ...): where the field's type has no
        null, it means the default, as in vLLM, not a type error. Where it has one, null keeps
        its meaning (``max_tokens``: what the context leaves)."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        defaulted = [
            key
            for key, value in data.items()
            if value is None
            and key in fields
            and not fields[key].is_required()
            and not _takes_none(fields[key].annotation)
        ]
        return {k: v for k, v in data.items() if k not in defaulted} if defaulted else data

    _unicode = model_validator(mode="before")(_refuse_surrogates)

    @model_validator(mode="after")
    def _streaming_options(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "stream_options is only allowed when stream is true")
        if self.stream and self.prompt_logprobs == 0:  # accepted (as vLLM): none streamed
            self.prompt_logprobs = None
        if self.stream and self.prompt_logprobs is not None:
            raise FieldError(
                "prompt_logprobs", "prompt_logprobs is not available when stream is true (as vLLM)"
            )
        _log_unknown(self)
        return self

    def structured(self) -> tuple[StructuredOutputsParams | None, str]:
        """The structured-outputs spec asked for (None: free text) and the field that asked.
        ``FieldError`` names the field when the shape is wrong or two fields ask; whether the
        spec compiles is checked against the tokenizer by the serving layer."""
        if self._structured_param:
            return self._structured, self._structured_param
        asked = [
            (param, spec)
            for param, spec in (
                ("response_format", response_format_spec(self.response_format)),
                ("structured_outputs", structured_outputs_spec(self.structured_outputs)),
                ("guided_json", given_spec("json", self.guided_json)),
                ("guided_regex", given_spec("regex", self.guided_regex)),
                ("guided_choice", given_spec("choice", self.guided_choice)),
                ("guided_grammar", given_spec("grammar", self.guided_grammar)),
            )
            if spec is not None
        ]
        if len(asked) > 1:
            names = ", ".join(param for param, _ in asked)
            raise FieldError(asked[1][0], f"structured outputs asked for twice ({names})")
        if asked:
            param, spec = asked[0]
            try:
                self._structured = StructuredOutputsParams.model_validate(spec)
            except ValidationError as exc:
                problems = "; ".join(
                    str(e["msg"]).removeprefix("Value error, ") for e in exc.errors()
                )
                raise FieldError(param, f"{param}: {problems}") from None
            self._structured_param = param
        return self._structured, self._structured_param

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: dict[str, Any] | None = None,
    ) -> SamplingParams:
        """The scheduler's parameters (``max_tokens`` already resolved against the context;
        ``prompt_logprobs``: at least this many, whatever the request asked; ``defaults``:
        the model's, by field, for the sampling fields the request leaves unset)."""
        given = defaults or {}

        def value(name: str, usual: float) -> Any:
            asked = getattr(self, name)
            return given.get(name, usual) if asked is None else asked

        if prompt_logprobs is not None:
            prompt_logprobs = max(prompt_logprobs, self.prompt_logprobs or 0)
        else:
            prompt_logprobs = self.prompt_logprobs
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,  # (at most max_tokens: checked with it)
            stop=tuple(stops),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            temperature=value("temperature", 1.0),
            top_p=value("top_p", 1.0),
            top_k=value("top_k", 0),
            min_p=value("min_p", 0.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=value("repetition_penalty", 1.0),
            # -1: no seed (vLLM's rule), not 2**63 - 1 -- every such request drew the same text
            seed=None if self.seed is None or self.seed == -1 else self.seed % 2**63,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured()[0],
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)
