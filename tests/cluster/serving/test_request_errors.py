"""The 400 a body FastAPI refuses gets: its ``param`` is the field's path as the client wrote it
(not pydantic's union-member tags, not a character offset into a body that is no JSON).
FastAPI itself validates the body (a bare app with the ingress's error handler, driven as
ASGI); nothing of Ray or Serve runs."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("ray")

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from cluster.serving.app import app as ingress_app
from cluster.serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)
from cluster.serving.responses_protocol import ResponsesRequest

bare = FastAPI()
bare.exception_handlers[RequestValidationError] = ingress_app.exception_handlers[
    RequestValidationError
]


@bare.post("/completions")
async def _completions(body: CompletionRequest) -> dict[str, Any]:
    return {}


@bare.post("/chat")
async def _chat(body: ChatCompletionRequest) -> dict[str, Any]:
    return {}


@bare.post("/tokenize")
async def _tokenize(body: TokenizeRequest) -> dict[str, Any]:
    return {}


@bare.post("/responses")
async def _responses(body: ResponsesRequest) -> dict[str, Any]:
    return {}


def _post(path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    """(status, error body) of one POST, through FastAPI's own validation."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(bare(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    content = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(content)["error"]


def _refused(path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, error = _post(path, json.dumps(body).encode())
    assert status == 400 and error["type"] == "BadRequestError", error
    return error


def test_a_union_fields_error_names_the_field_not_the_union_member() -> None:
    error = _refused("/completions", {"model": "m", "prompt": 5})
    assert error["param"] == "prompt"
    assert "str" not in error["message"].split(":")[0]
    error = _refused("/completions", {"model": "m", "prompt": [1, "a"]})
    assert error["param"] == "prompt" and "constrained" not in error["message"]
    assert "prompt.1: Input should be a valid integer" in error["message"]  # the item at fault
    message = {"role": "user", "content": 5}
    error = _refused("/chat", {"model": "m", "messages": [message]})
    assert error["param"] == "messages.0.content"
    message = {"role": "user", "content": [{"type": "text"}]}
    error = _refused("/chat", {"model": "m", "messages": [message]})
    assert error["param"] == "messages.0.content"
    assert "; messages.0.content.0.text: Field required" in error["message"]  # in a member
    error = _refused("/tokenize", {"model": "m"})  # a union of two request models
    assert error["param"] in ("messages", "prompt") and "function-after" not in error["message"]
    # Plain fields and checks across fields keep their names.
    error = _refused("/chat", {"model": "m", "messages": [{"content": "x"}]})
    assert error["param"] == "messages.0.role"
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert _refused("/chat", {**base, "n": 0})["param"] == "n"
    assert _refused("/chat", {**base, "logit_bias": {"a": 1}})["param"] == "logit_bias.a"
    assert _refused("/chat", {**base, "top_logprobs": 2})["param"] == "top_logprobs"


def test_a_body_that_is_no_json_is_a_400_without_a_param() -> None:
    status, error = _post("/completions", b'{"model": "m", "prompt": }')
    assert status == 400 and error["param"] is None
    assert error["message"].startswith("could not parse the JSON body: Expecting value")


def test_text_with_an_unpaired_surrogate_is_a_400_naming_its_field() -> None:
    """JSON may escape a UTF-16 surrogate alone (``\\ud800``); that is no Unicode text (UTF-8
    has no encoding of it): the tokenizer, the grammar compiler and the response encoder
    would fail on it, a 500. Refused with the body, naming where it is."""

    def post(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return _post(path, json.dumps(body).replace("LONE", "\\ud800").encode())

    def refused(path: str, body: dict[str, Any]) -> str:
        status, error = post(path, body)
        assert status == 400 and "unpaired UTF-16 surrogate" in error["message"], error
        assert error["message"].count("surrogate") == 1, error  # (once: a union's members)
        return str(error["param"])

    user = {"role": "user", "content": "x"}
    assert refused("/completions", {"model": "m", "prompt": "aLONEb"}) == "prompt"
    assert refused("/completions", {"prompt": ["ok", "LONE"]}) == "prompt.1"
    parts = {"role": "user", "content": [{"type": "text", "text": "LONE"}]}
    assert refused("/chat", {"messages": [parts]}) == "messages.0.content.0.text"
    assert refused("/chat", {"messages": [user], "guided_regex": "aLONE"}) == "guided_regex"
    assert refused("/tokenize", {"prompt": "LONE"}) == "prompt"
    # A key holding one names the object it is in; a surrogate pair is a character.
    assert refused("/completions", {"prompt": "a", "logit_bias": {"LONE": 1}}) == "logit_bias"
    pair = _post("/completions", b'{"prompt": "\\ud83d\\ude00", "n": 0}')
    assert pair[0] == 400 and pair[1]["param"] == "n"  # refused for n alone


def test_responses_refusals_name_the_responses_apis_fields() -> None:
    """/v1/responses: what it cannot do (continue a stored response, run a tool other than a
    function, reason) is a 400 naming the field; so is what the chat completion it is built
    into refuses, under this API's name for the field (input, max_output_tokens)."""
    base = {"model": "m", "input": "hi"}
    error = _refused("/responses", {**base, "previous_response_id": "resp_1"})
    assert error["param"] == "previous_response_id" and "not stored" in error["message"]
    error = _refused("/responses", {**base, "tools": [{"type": "web_search"}]})
    assert error["param"] == "tools" and "'web_search'" in error["message"]
    assert _refused("/responses", {**base, "reasoning": {"effort": "high"}})["param"] == "reasoning"
    tools = [{"type": "function", "name": "lookup"}]
    named = {"type": "function", "name": "nope"}
    error = _refused("/responses", {**base, "tools": tools, "tool_choice": named})
    assert error["param"] == "tool_choice" and "nope" in error["message"]
    error = _refused("/responses", {"model": "m", "input": []})
    assert error["param"] == "input" and "messages" not in error["message"]
    assert _refused("/responses", {**base, "max_output_tokens": 0})["param"] == "max_output_tokens"
    assert _refused("/responses", {**base, "temperature": 3})["param"] == "temperature"
    error = _refused("/responses", {"model": "m", "input": [{"type": "reasoning"}]})
    assert error["param"].startswith("input")
    # Fields that would change the output, not implemented: refused, not silently dropped.
    active = {
        "top_logprobs": 5,
        "context_management": [{"type": "compaction", "compact_threshold": 1000}],
        "moderation": {"policy": {"input": {"mode": "block"}}},
    }
    for field, value in active.items():
        assert _refused("/responses", {**base, field: value})["param"] == field
    # What asks for nothing passes: no stored response, no reasoning, store false.
    quiet: dict[str, Any] = {**base, "previous_response_id": None, "reasoning": None}
    quiet |= {"store": False, "top_logprobs": 0, "max_tool_calls": 3}
    assert ResponsesRequest.model_validate(quiet).chat_request().messages[0].content == "hi"


def test_vllms_responses_sampling_fields_reach_the_chat_request() -> None:
    """vLLM's ``ResponsesRequest`` takes ``top_k``, ``logit_bias``, ``skip_special_tokens`` and
    ``priority``: they were unknown fields here, dropped with a log line (top_k 1 sampled at
    random, a -100 bias banned nothing). Passed on to chat, they act and are checked there."""
    base = {"model": "m", "input": "hi"}
    body = {**base, "top_k": 1, "logit_bias": {"7": -100}, "skip_special_tokens": False}
    chat = ResponsesRequest.model_validate({**body, "priority": 3}).chat_request()
    assert (chat.top_k, chat.skip_special_tokens, chat.priority) == (1, False, 3)
    params = chat.sampling_params(16, None)
    assert params.top_k == 1 and params.logit_bias == ((7, -100.0),)
    assert not params.skip_special_tokens
    unset = ResponsesRequest.model_validate({**base, "priority": None}).chat_request()
    assert (unset.top_k, unset.logit_bias, unset.priority) == (None, None, 0)
    assert unset.skip_special_tokens
    assert _refused("/responses", {**base, "logit_bias": {"7": 500}})["param"] == "logit_bias"
    assert _refused("/responses", {**base, "top_k": -2})["param"] == "top_k"
