"""What agents ask of the API, through the official ``openai`` SDK against the live Serve app:
structured outputs parsed into Pydantic models (``beta.chat.completions.parse``), and tool
calling -- named, required and auto choices, single and parallel calls, streamed deltas the
SDK reassembles into the non-streamed result, a conversation carrying tool results.
Disaggregated (the shared app: every request prefilled on one instance and decoded on
another) and colocated (a second app, on a one-instance cluster of its own).

The model is the tiny random checkpoint: its outputs mean nothing, which is the point -- only
the constraints make them parse. Schemas bound their strings, numbers and arrays so that a
random model finishes them within max_tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from tests.cluster.conftest import API_KEY, ServeApp

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")


class Address(BaseModel):
    city: str = Field(max_length=6)
    zone: Literal["north", "south"]


class Person(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=120)
    home: Address  # nested (a $ref in the schema)
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)
    active: bool


class Reading(BaseModel):
    sensor: Literal["t1", "t2"]
    values: list[int] = Field(max_length=4)
    ok: bool


@pytest.fixture(scope="module")
def colocated(serve_app: ServeApp) -> Iterator[Any]:
    """A second app, route /colocated, on a cluster of one colocated instance."""
    from ray import serve

    from cluster.config import ClusterConfig
    from cluster.control.launch import app_cluster_name, shutdown_cluster
    from cluster.serving.app import build_app_from_config

    config = ClusterConfig.model_validate(
        {
            "model": str(serve_app.model_dir),
            "block_size": 4,
            "pools": [
                {"name": "c", "role": "both", "num_blocks": 160, "scheduler": {"max_num_seqs": 8}}
            ],
            "serve": {"api_key": API_KEY, "grpc_port": None},
        }
    )
    serve.run(build_app_from_config(config), name="colocated", route_prefix="/colocated")
    try:
        yield openai.OpenAI(
            base_url=f"{serve_app.url}/colocated/v1", api_key=API_KEY, max_retries=0
        )
    finally:
        serve.delete("colocated")
        from cluster.control.launch import DEFAULT_NAMESPACE

        handle = ray.get_actor(app_cluster_name("colocated"), namespace=DEFAULT_NAMESPACE)
        shutdown_cluster(handle)


@pytest.fixture(params=["disaggregated", "colocated"])
def client(request: pytest.FixtureRequest, serve_app: ServeApp) -> Any:
    if request.param == "colocated":
        return request.getfixturevalue("colocated")
    return serve_app.openai()


MESSAGES: list[Any] = [{"role": "user", "content": "Describe someone."}]


def test_parse_returns_pydantic_objects(client: Any, serve_app: ServeApp) -> None:
    """Nested objects, enums, arrays, required fields; greedy and sampled; streamed and not."""
    for model, extra in (
        (Person, {"temperature": 0}),
        (Person, {"temperature": 1.0, "seed": 3}),
        (Reading, {"temperature": 1.0, "seed": 8}),
    ):
        done = client.beta.chat.completions.parse(
            model=serve_app.model,
            messages=MESSAGES,
            response_format=model,
            max_tokens=200,
            **extra,
        )
        choice = done.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, model)
        with client.beta.chat.completions.stream(
            model=serve_app.model,
            messages=MESSAGES,
            response_format=model,
            max_tokens=200,
            **extra,
        ) as stream:
            streamed = stream.get_final_completion()
        assert isinstance(streamed.choices[0].message.parsed, model)
        if extra.get("seed") is not None or extra.get("temperature") == 0:
            # The same request, streamed: the same object.
            assert streamed.choices[0].message.parsed == choice.message.parsed


# Short definitions: the tiny model's tokenizer spends a token per byte, its context is 640
# tokens, and the fallback prompt carries the tools' schemas.
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 4},
                "unit": {"enum": ["C", "F"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK: Any = {"type": "function", "function": {"name": "time"}}


def _calls(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


def _streamed(client: Any, **kwargs: Any) -> Any:
    """The SDK's own reassembly of a streamed chat completion."""
    with client.beta.chat.completions.stream(**kwargs) as stream:
        return stream.get_final_completion()


def test_tool_calls_named_required_auto_streamed_and_not(client: Any, serve_app: ServeApp) -> None:
    base: dict[str, Any] = {
        "model": serve_app.model,
        "messages": [{"role": "user", "content": "Oslo?"}],
        "tools": [WEATHER, CLOCK],
        "max_tokens": 150,
        "temperature": 0,
    }
    named = {**base, "tool_choice": {"type": "function", "function": {"name": "weather"}}}
    whole = client.chat.completions.create(**named)
    ((name, arguments),) = _calls(whole.choices[0].message)
    assert name == "weather" and arguments["unit"] in ("C", "F")
    assert len(arguments["city"]) <= 4
    assert _calls(_streamed(client, **named).choices[0].message) == [(name, arguments)]

    single = {**base, "tool_choice": "required", "parallel_tool_calls": False}
    whole = client.chat.completions.create(**single)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert len(whole.choices[0].message.tool_calls) == 1
    streamed = _streamed(client, **single)
    assert _calls(streamed.choices[0].message) == _calls(whole.choices[0].message)

    parallel = {**base, "tool_choice": "required", "temperature": 1.0, "seed": 5}
    whole = client.chat.completions.create(**parallel)
    calls = _calls(whole.choices[0].message)
    assert calls and {n for n, _ in calls} <= {"weather", "time"}
    assert all(a == {} for n, a in calls if n == "time")
    assert _calls(_streamed(client, **parallel).choices[0].message) == calls

    # auto: the model's own format, parsed. The random model never writes a call by itself,
    # so a regex (vLLM's guided_regex) writes two for it; the parser does the rest.
    block = (
        r'<tool_call>\n\{"name": "weather", "arguments": \{"city": "Oslo", "unit": "C"\}\}'
        r'\n</tool_call>\n<tool_call>\n\{"name": "time", "arguments": \{\}\}\n</tool_call>'
    )
    auto = {**base, "extra_body": {"guided_regex": block}}
    whole = client.chat.completions.create(**auto)
    expected = [("weather", {"city": "Oslo", "unit": "C"}), ("time", {})]
    assert whole.choices[0].finish_reason == "tool_calls"
    assert _calls(whole.choices[0].message) == expected
    streamed = _streamed(client, **auto)
    assert _calls(streamed.choices[0].message) == expected
    assert streamed.choices[0].finish_reason == "tool_calls"


def test_a_conversation_with_tool_results(client: Any, serve_app: ServeApp) -> None:
    """Call a tool, send its result back with the call in the history, get an answer: the
    history reaches the prompt (its tokens grow with the tool turns)."""
    messages: list[Any] = [{"role": "user", "content": "Oslo?"}]
    first = client.chat.completions.create(
        model=serve_app.model,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    messages.append(message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temp": -3}'})
    answer = client.chat.completions.create(
        model=serve_app.model, messages=messages, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.role == "assistant"
    grown = answer.usage.prompt_tokens - first.usage.prompt_tokens
    assert grown >= len(call.function.arguments) + len('{"temp": -3}')
    with pytest.raises(openai.BadRequestError) as missing:  # a tool result must name its call
        client.chat.completions.create(
            model=serve_app.model,
            messages=[*messages[:2], {"role": "tool", "content": "x"}],
            max_tokens=2,
        )
    assert "tool_call_id" in missing.value.body["message"]


def test_the_responses_api_through_the_sdk(serve_app: ServeApp) -> None:
    """``/v1/responses`` as the Agents SDK drives it: ``responses.parse`` into a Pydantic
    model (``text.format`` json_schema), ``responses.stream`` (the SDK validates each event
    and rebuilds the response from them), and a function call answered with a
    ``function_call_output`` item."""
    client = serve_app.openai()
    parsed = client.responses.parse(
        model=serve_app.model,
        input="Describe a reading.",
        text_format=Reading,
        max_output_tokens=120,
        temperature=1.0,
        extra_body={"seed": 8},  # (no such argument in the SDK's Responses API)
    )
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Reading)
    deltas: list[str] = []
    with client.responses.stream(
        model=serve_app.model, input="Hi", max_output_tokens=6, temperature=0
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert final.status == "incomplete" and final.incomplete_details is not None
    assert final.output_text == "".join(deltas) and final.usage is not None
    assert final.usage.output_tokens == 6
    tool = {"type": "function", "name": "weather", **WEATHER["function"]}
    first = client.responses.create(
        model=serve_app.model,
        input="Oslo?",
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,  # (a random model's 4 characters may take many byte tokens)
        temperature=0,
    )
    assert first.status == "completed", first.output
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "weather" and json.loads(call.arguments)["unit"] in ("C", "F")
    history: list[Any] = [
        {"role": "user", "content": "Oslo?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": -3}'},
    ]
    answer = client.responses.create(
        model=serve_app.model, input=history, tools=[tool], max_output_tokens=4, temperature=0
    )
    assert answer.usage is not None and first.usage is not None
    assert answer.usage.input_tokens - first.usage.input_tokens >= len(call.arguments)
