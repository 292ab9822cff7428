"""No request field is silently dropped: every field of OpenAI's request schemas (read from the
official ``openai`` SDK's types, so a field added there fails this test until it is classified)
is implemented, accepted with no effect by design, or refused with a 400 naming it -- and so
are vLLM's extras that change an output. Unknown fields are ignored and logged once."""

from __future__ import annotations

import logging
import typing
from typing import Any

import pytest
from pydantic import ValidationError

from cluster.serving.openai_protocol import ChatCompletionRequest, CompletionRequest
from cluster.serving.sampling_fields import (
    ACCEPTED,
    REFUSED_CHAT,
    REFUSED_COMPLETION,
    REFUSED_VLLM,
    REFUSED_VLLM_CHAT,
)

openai = pytest.importorskip("openai")

IMPLEMENTED_COMMON = {
    *("model", "n", "stop", "stream_options", "temperature", "top_p", "seed"),
    *("presence_penalty", "frequency_penalty", "max_tokens", "logprobs", "logit_bias"),
    "response_format",
}
IMPLEMENTED = {
    "completions": IMPLEMENTED_COMMON | {"prompt", "echo", "best_of", "suffix"},
    "chat": IMPLEMENTED_COMMON
    | {"messages", "max_completion_tokens", "top_logprobs"}
    | {"tools", "tool_choice", "parallel_tool_calls"},
}
# best_of (== n) and suffix (empty) are implemented where they change nothing, refused otherwise.
REFUSED = {
    "completions": set(REFUSED_COMPLETION) | set(REFUSED_VLLM),
    "chat": set(REFUSED_CHAT)
    | set(REFUSED_COMPLETION)
    | set(REFUSED_VLLM)
    | set(REFUSED_VLLM_CHAT),
}
ACTIVE: dict[str, Any] = {  # a value that asks for something
    "modalities": ["text", "audio"],
    "reasoning_effort": "high",
    "verbosity": "low",
    "echo": True,
    "continue_final_message": True,
    "use_beam_search": True,
    "return_tokens_as_token_ids": True,
    "prompt_logprobs": 1,
    "truncate_prompt_tokens": 5,
    "length_penalty": 2.0,
}
BASE = {
    "completions": {"model": "m", "prompt": "hi"},
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
}
MODELS: dict[str, Any] = {"completions": CompletionRequest, "chat": ChatCompletionRequest}


def _sdk_fields(endpoint: str) -> set[str]:
    if endpoint == "completions":
        from openai.types.completion_create_params import CompletionCreateParamsBase as params
    else:
        from openai.types.chat.completion_create_params import (
            CompletionCreateParamsBase as params,
        )
    return set(typing.get_type_hints(params))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_openai_field_is_implemented_accepted_or_refused(endpoint: str) -> None:
    fields = _sdk_fields(endpoint)
    classified = IMPLEMENTED[endpoint] | set(ACCEPTED) | REFUSED[endpoint]
    assert fields - classified == set(), "new OpenAI fields to implement or refuse"
    declared = set(MODELS[endpoint].model_fields)
    assert fields <= declared  # none of them falls through to "unknown, ignored"
    assert REFUSED[endpoint] <= declared


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_refused_fields_are_400s_naming_them(endpoint: str) -> None:
    for field in sorted(REFUSED[endpoint]):
        body = {**BASE[endpoint], field: ACTIVE.get(field, {"x": 1})}
        with pytest.raises(ValidationError) as refused:
            MODELS[endpoint].model_validate(body)
        (error,) = refused.value.errors()
        assert error["loc"] == (field,) and f"{field} is not supported" in error["msg"], field


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_accepted_fields_and_values_that_ask_for_nothing_pass(endpoint: str) -> None:
    asks_nothing = {
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "logit_bias": {},
        "modalities": ["text"],
        "use_beam_search": False,
    }
    fields = REFUSED[endpoint] | set(ACCEPTED)
    body = {**BASE[endpoint]} | {k: v for k, v in asks_nothing.items() if k in fields}
    body |= {"user": "u", "metadata": {"k": "v"}, "store": True, "prompt_cache_key": "c"}
    MODELS[endpoint].model_validate(body)
    # JSON writers drop a float's ".0": length_penalty 1 asks for what 1.0 does; True is not
    # 1 though, and elsewhere 1 may ask for something (truncate_prompt_tokens: keep one).
    MODELS[endpoint].model_validate({**BASE[endpoint], "length_penalty": 1})
    for field, value in (("length_penalty", True), ("truncate_prompt_tokens", 1)):
        with pytest.raises(ValidationError, match=f"{field} is not supported"):
            MODELS[endpoint].model_validate({**BASE[endpoint], field: value})


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_null_means_the_default(endpoint: str) -> None:
    """OpenAI's schema lets clients send null for optional fields (n, stream, the penalties,
    logprobs, echo, and vLLM's extras): an optional field whose type has no null takes its
    default, none is a type error; one whose type has null keeps it (max_tokens: null is
    what the context leaves, not the default 16). A required one stays required."""
    model = MODELS[endpoint]
    default = model.model_validate(BASE[endpoint])
    optional = [k for k, f in model.model_fields.items() if not f.is_required() and k != "model"]
    assert {"n", "stream", "presence_penalty", "logprobs", "min_tokens"} <= set(optional)
    for name in optional:
        got = getattr(model.model_validate({**BASE[endpoint], name: None}), name)
        assert got is None or got == getattr(default, name), name
    assert model.model_validate({**BASE[endpoint], "n": None}).n == 1
    assert model.model_validate({**BASE[endpoint], "max_tokens": None}).max_tokens is None
    required = "prompt" if endpoint == "completions" else "messages"
    with pytest.raises(ValidationError, match=required):
        model.model_validate({**BASE[endpoint], required: None})


def test_tool_calls_in_the_history_reach_the_template() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": history})
    assistant, tool = (m.as_template_input() for m in req.messages[1:])
    assert assistant["tool_calls"] == [call] and assistant["content"] == ""
    assert tool == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    for bad, words in (
        ({"role": "tool", "content": "42"}, "tool_call_id"),
        ({"role": "user", "content": "x", "tool_calls": [call]}, "assistant messages"),
    ):
        with pytest.raises(ValidationError, match=words):
            ChatCompletionRequest.model_validate({"model": "m", "messages": [bad]})


def test_content_parts_reach_the_template_one_per_line() -> None:
    """A message's text parts are joined with newlines, as vLLM joins them for a template
    that takes a string (they were run together: another prompt than vLLM's)."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": parts}]}
    )
    assert req.messages[0].as_template_input()["content"] == "Hello\nWorld"


def test_tool_choice_is_checked_against_the_tools() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for extra, words in (
        ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "g"),
        ({"tools": [], "tool_choice": "required"}, "required needs tools"),
        ({"tools": [tool, tool]}, "unique"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "pattern"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "an object",
        ),
    ):
        with pytest.raises(ValidationError, match=words):
            ChatCompletionRequest.model_validate({**base, **extra})
    auto = ChatCompletionRequest.model_validate({**base, "tools": [tool]})
    assert auto.tool_mode == "auto" and auto.structured() == (None, "")
    assert ChatCompletionRequest.model_validate(base).tool_mode is None
    named = ChatCompletionRequest.model_validate(
        {**base, "tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}}
    )
    spec, param = named.structured()
    assert named.tool_mode == "named" and param == "tools"
    assert spec is not None and spec.key == ("json", '{"type":"object"}')


def test_tool_choice_without_tools_is_a_400_naming_it() -> None:
    """As vLLM and OpenAI: a tool_choice (other than none) with no ``tools`` is refused,
    not answered as if it asked for nothing."""
    from cluster.serving.agent_fields import FieldError

    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    named = {"type": "function", "function": {"name": "f"}}
    for choice in ("auto", "required", named):
        with pytest.raises(ValidationError) as refused:
            ChatCompletionRequest.model_validate({**base, "tool_choice": choice})
        (error,) = refused.value.errors()
        assert error["loc"] == () and "`tools` must be set" in error["msg"], choice
        assert isinstance(error["ctx"]["error"], FieldError)
        assert error["ctx"]["error"].param == "tool_choice"
    for choice in ("none", None):
        ChatCompletionRequest.model_validate({**base, "tool_choice": choice})


def test_unknown_fields_are_ignored_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="cluster.serving.sampling_fields"):
        for _ in range(3):
            CompletionRequest.model_validate({**BASE["completions"], "frobnicate_xyz": 1})
    logged = [r for r in caplog.records if "frobnicate_xyz" in r.getMessage()]
    assert len(logged) == 1


def test_unknown_field_names_kept_for_logging_are_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Random keys in every request (a hostile or buggy client) do not grow the ingress's
    memory, or its log, without bound."""
    from cluster.serving import sampling_fields

    monkeypatch.setattr(sampling_fields, "_logged_unknown", set())
    for k in range(sampling_fields._MAX_LOGGED_UNKNOWN + 50):
        CompletionRequest.model_validate({**BASE["completions"], f"junk_{k}": 1})
    assert len(sampling_fields._logged_unknown) == sampling_fields._MAX_LOGGED_UNKNOWN


def test_empty_guided_fields_are_still_asked_for() -> None:
    """An empty choice is a 400 (as structured_outputs.choice []), an empty schema allows
    any JSON: neither is silently dropped."""
    from cluster.serving.agent_fields import FieldError

    base = {"model": "m", "prompt": "hi"}
    with pytest.raises(FieldError, match="at least one"):
        CompletionRequest.model_validate({**base, "guided_choice": []}).structured()
    spec, param = CompletionRequest.model_validate({**base, "guided_json": {}}).structured()
    assert param == "guided_json" and spec is not None and spec.key == ("json", "{}")
    nothing = CompletionRequest.model_validate(
        {**base, "structured_outputs": {"disable_fallback": True}}
    )
    assert nothing.structured() == (None, "")


def test_zero_logprobs_fields_ask_for_nothing_and_pass() -> None:
    """As vLLM: ``top_logprobs: 0`` without ``logprobs`` (some SDKs send it by default), and
    ``prompt_logprobs: 0`` on a stream, are accepted (they were 400s); more is refused."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest.model_validate({**chat, "top_logprobs": 0}).top_logprobs == 0
    with pytest.raises(ValidationError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest.model_validate({**chat, "top_logprobs": 2})
    streamed = {"model": "m", "prompt": "hi", "stream": True}
    request = CompletionRequest.model_validate({**streamed, "prompt_logprobs": 0})
    assert request.prompt_logprobs is None  # nothing to compute: none is streamed
    with pytest.raises(ValidationError, match="prompt_logprobs is not available"):
        CompletionRequest.model_validate({**streamed, "prompt_logprobs": 1})


def test_stream_options_may_be_null() -> None:
    """A null stream option is accepted, as unset (it was a 400)."""
    streamed = {"model": "m", "prompt": "hi", "stream": True}
    options = {"include_usage": None, "continuous_usage_stats": None}
    null = CompletionRequest.model_validate({**streamed, "stream_options": options})
    assert null.stream_options is not None and not null.stream_options.include_usage


def test_a_logit_bias_id_of_thousands_of_digits_is_a_400_naming_the_field() -> None:
    """Past 4,300 digits ``int()`` refuses a string: such a key was a 500 where its id is
    checked against the vocabulary. Any id longer than 20 digits is refused with the body."""
    base = {"model": "m", "prompt": "hi"}
    for key in ("1" * 5000, "0" * 4400 + "1", "1" * 21):
        with pytest.raises(ValidationError, match="outside the vocabulary") as refused:
            CompletionRequest.model_validate({**base, "logit_bias": {key: 1}})
        assert refused.value.errors()[0]["loc"] == ("logit_bias",)
    request = CompletionRequest.model_validate({**base, "logit_bias": {"9" * 20: 1, "007": 2}})
    assert request.logit_bias_ids() == [10**20 - 1, 7]  # (then past the vocabulary: a 400)


def test_seed_minus_one_asks_for_no_seed() -> None:
    """vLLM's rule (``SamplingParams``: seed -1 is None): -1 is a fresh draw each time, not
    a fixed seed -- it became 2**63 - 1 here, so every such request returned the same text."""
    from scheduler import SamplingParams

    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2 and SamplingParams(seed=0).seed == 0
    for endpoint, model in (("completions", CompletionRequest), ("chat", ChatCompletionRequest)):
        unseeded = model.model_validate({**BASE[endpoint], "seed": -1})
        assert unseeded.sampling_params(16, None).seed is None
        seeded = model.model_validate({**BASE[endpoint], "seed": -2})
        assert seeded.sampling_params(16, None).seed == -2 % 2**63
