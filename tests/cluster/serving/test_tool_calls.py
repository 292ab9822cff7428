"""Tool calling's parts without an engine: the prompt (tools to the template, or the fallback
system prompt and the history as text), the schemas forced calls are held to, the parsers of
the models' own formats, and the streams -- whose deltas must add up to what the whole
response says, however the text is cut into steps."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from actors.model.chat_template import render_chat
from cluster.serving.tool_calls import (
    NO_PARAMETERS,
    ToolPlan,
    parse_calls,
    parser_for,
    required_schema,
    template_messages,
    template_supports_tools,
)
from cluster.serving.tool_streams import AutoStream, NamedStream, RequiredStream, ToolStream

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
PLAIN_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOLS_TEMPLATE = (
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}[{{ c.function.name }}"
    "({{ c.function.arguments.city }})]{% endfor %}\n{% endfor %}"
)
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "content": "-3 C", "tool_call_id": "c1"},
]


def test_tools_and_history_reach_a_template_that_takes_them() -> None:
    assert template_supports_tools(TOOLS_TEMPLATE) and not template_supports_tools(PLAIN_TEMPLATE)
    messages, extra = template_messages(HISTORY, [WEATHER], TOOLS_TEMPLATE)
    text = render_chat(TOOLS_TEMPLATE, messages, add_generation_prompt=False, **extra)
    assert '"name": "get_weather"' in text  # the tools list
    assert "[get_weather(Oslo)]" in text  # the call's arguments as an object
    assert "<|tool|>-3 C" in text


def test_a_template_without_tools_gets_the_fallback_prompt_and_text_history() -> None:
    messages, extra = template_messages(HISTORY, [WEATHER, TIME], PLAIN_TEMPLATE)
    assert extra == {}
    system = messages[0]
    assert system["role"] == "system" and "<tools>" in system["content"]
    assert '"name": "get_weather"' in system["content"] and "<tool_call>" in system["content"]
    assert messages[2]["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    assert messages[3] == {"role": "user", "content": "<tool_response>\n-3 C\n</tool_response>"}
    # An existing system message is extended, not doubled; no tools and no history: as is.
    with_system = [{"role": "system", "content": "Be brief."}, *HISTORY[:1]]
    merged, _ = template_messages(with_system, [WEATHER], PLAIN_TEMPLATE)
    assert len(merged) == 2 and merged[0]["content"].startswith("Be brief.\n\n")
    assert template_messages(HISTORY[:1], None, PLAIN_TEMPLATE) == (HISTORY[:1], {})
    # Two results in a row: one user turn (strict templates alternate user and assistant);
    # a template that refuses a system role gets the prompt in the first user message.
    two = [*HISTORY, {"role": "tool", "content": "windy", "tool_call_id": "c2"}]
    messages, _ = template_messages(two, [WEATHER], PLAIN_TEMPLATE, system_role=False)
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert (
        messages[0]["content"].startswith("You may call")
        and "Weather in Oslo?" in messages[0]["content"]
    )
    assert messages[2]["content"].count("<tool_response>") == 2


def test_the_parser_follows_the_template_unless_overridden() -> None:
    assert parser_for(PLAIN_TEMPLATE, None) == "hermes"
    assert parser_for("{{ '<|python_tag|>' }}", None) == "llama3_json"
    assert parser_for(PLAIN_TEMPLATE, "llama3_json") == "llama3_json"
    with pytest.raises(ValueError, match="hermes"):
        parser_for(None, "mistral")


def test_required_schema_hoists_each_functions_definitions() -> None:
    """Pydantic-made parameters reference ``#/$defs/...``: in the array schema of
    ``required`` those definitions must sit at the root (a 400 if two functions disagree)."""
    loc = {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}
    with_defs = {
        "type": "function",
        "function": {
            "name": "go",
            "parameters": {
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/Loc"}},
                "required": ["to"],
                "$defs": {"Loc": loc},
            },
        },
    }
    schema = required_schema([with_defs, TIME], parallel=True)
    assert schema["$defs"] == {"Loc": loc}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    other = json.loads(json.dumps(with_defs))
    other["function"]["name"] = "come"
    other["function"]["parameters"]["$defs"]["Loc"] = {"type": "string"}
    with pytest.raises(ValueError, match="Loc differs"):
        required_schema([with_defs, other], parallel=True)


def test_required_schema_lists_each_function_and_bounds_the_count() -> None:
    schema = required_schema([WEATHER, TIME], parallel=True)
    assert schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    time_item = schema["items"]["anyOf"][1]
    assert time_item["properties"]["parameters"] == NO_PARAMETERS  # none given: none taken
    assert required_schema([WEATHER], parallel=False)["maxItems"] == 1


HERMES_OUTPUT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_hermes_and_llama3_outputs_parse_into_calls() -> None:
    content, calls = parse_calls("hermes", HERMES_OUTPUT)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}),
        ("get_time", {}),
    ]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    # A broken block stays text, as does an unclosed one; no calls: the text exactly.
    assert parse_calls("hermes", "<tool_call>{not json}</tool_call>") == (
        "<tool_call>{not json}</tool_call>",
        [],
    )
    assert parse_calls("hermes", "hi <tool_call>{") == ("hi <tool_call>{", [])
    assert parse_calls("hermes", "plain text \n") == ("plain text \n", [])
    # A whole last call without its closing tag (the client's stop ["</tool_call>"] took it,
    # or the turn ended) is a call, as vLLM's hermes parser reads it; so with a cut-off tag.
    for tail in ("", "\n", "\n</tool_", "</tool_call"):
        unclosed = 'Checking. <tool_call>{"name": "get_time", "arguments": {}}' + tail
        content, calls = parse_calls("hermes", unclosed)
        assert content == "Checking." and [c.name for c in calls] == ["get_time"], tail
    names = ("get_weather", "get_time")
    llama = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
        '{"name": "get_time", "parameters": {}}'
    )
    content, calls = parse_calls("llama3_json", llama, names)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Rome"}
    assert parse_calls("llama3_json", "Rome is sunny.", names) == ("Rome is sunny.", [])
    # Any JSON answer could look like a call: it must name a tool and carry arguments.
    for answer in ('{"name": "Bob", "parameters": {}}', '{"name": "get_time", "age": 3}'):
        assert parse_calls("llama3_json", answer, names) == (answer, [])


def _pieces(text: str, seed: int) -> list[str]:
    """``text`` cut at random places (steps of one to six characters)."""
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i : i + n])
        i += n
    return out


def _stream(stream: ToolStream, text: str, seed: int) -> tuple[str, list[dict[str, Any]]]:
    """Feed ``text`` step by step: the content and the calls the deltas add up to."""
    content, calls = "", []
    for piece in _pieces(text, seed):
        more, deltas = stream.feed(piece)
        content += more
        for delta in deltas:
            _merge(calls, delta)
    more, deltas = stream.finish()
    content += more
    for delta in deltas:
        _merge(calls, delta)
    return content, calls


def _merge(calls: list[dict[str, Any]], delta: dict[str, Any]) -> None:
    """How an OpenAI client assembles ``tool_calls`` deltas."""
    index = delta["index"]
    if index == len(calls):
        assert {"id", "type", "function"} <= set(delta)  # a call opens with its header
        calls.append({"id": delta["id"], "name": delta["function"]["name"], "arguments": ""})
    calls[index]["arguments"] += delta["function"].get("arguments", "")


@pytest.mark.parametrize("seed", range(8))
def test_streamed_deltas_add_up_to_the_whole_response(seed: int) -> None:
    plan = ToolPlan("auto", "hermes")
    spaced = f"{HERMES_OUTPUT}\n\n"  # whitespace after the calls is no content
    content, calls = _stream(plan.stream(), spaced, seed)
    whole_content, whole_calls, reason = plan.parse(spaced, "stop")
    assert reason == "tool_calls"
    assert content == whole_content == "Let me check."
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.name, c.arguments) for c in whole_calls
    ]
    # Text that only looks like the start of a tag is content in the end.
    content, calls = _stream(AutoStream("hermes"), "a < b <tool_ca", seed)
    assert (content, calls) == ("a < b <tool_ca", [])
    llama = '  {"name": "get_time", "parameters": {"tz": "UTC"}}'
    content, calls = _stream(AutoStream("llama3_json", ("get_time",)), llama, seed)
    assert content == "" and calls[0]["name"] == "get_time"
    assert _stream(AutoStream("llama3_json"), "  Sunny today.", seed) == ("  Sunny today.", [])
    # Text on both sides of a call stays apart.
    around = 'a <tool_call>{"name": "get_time", "arguments": {}}</tool_call> b'
    assert _stream(AutoStream("hermes"), around, seed)[0] == "a\nb"
    assert ToolPlan("auto", "hermes").parse(around, "stop")[0] == "a\nb"
    # No call at all: the text exactly, its whitespace too.
    assert _stream(AutoStream("hermes"), " a\n\nb \n", seed) == (" a\n\nb \n", [])


@pytest.mark.parametrize("lead", ["", " \n"])
def test_a_python_tag_split_across_deltas_still_streams_the_calls(lead: str) -> None:
    """The first delta may hold only part of ``<|python_tag|>``: its start is held until the
    tag completes (the calls stream as the whole parse finds them) or cannot be it (text)."""
    output = f'{lead}<|python_tag|>{{"name": "f", "parameters": {{"a": 1}}}}; '
    output += '{"name": "g", "parameters": {}}'
    plan = ToolPlan("auto", "llama3_json", names=("f", "g"))
    whole_content, whole_calls, reason = plan.parse(output, "stop")
    assert reason == "tool_calls" and [c.name for c in whole_calls] == ["f", "g"]
    for cut in range(len(lead) + 1, len(lead) + len("<|python_tag|>")):
        stream = plan.stream()
        content, calls = "", []
        for piece in (output[:cut], output[cut:]):
            more, deltas = stream.feed(piece)
            content += more
            calls += deltas
        more, deltas = stream.finish()
        content, calls = content + more, calls + deltas
        assert (content or None) == whole_content
        assert plan.finish_reason("stop", stream) == "tool_calls"
        assert [(d["function"]["name"], d["function"]["arguments"]) for d in calls] == [
            (c.name, c.arguments) for c in whole_calls
        ]
    # A start of the tag that turns out to be text, or that the output ends on, is content.
    for text in ("<|pyt", f"{lead}<|python_t"):
        stream = AutoStream("llama3_json")
        assert stream.feed(text) == ("", [])
        assert stream.feed("hon!") == (f"{text}hon!", [])
        ended = AutoStream("llama3_json")
        assert ended.feed(text)[0] + ended.finish()[0] == text


def test_whole_auto_calls_cut_by_max_tokens_still_end_with_tool_calls() -> None:
    """The model closed a call, then max_tokens cut what followed: the call stands and the
    choice ends with ``tool_calls``, as vLLM (it said ``length``); a call cut short is none."""
    plan = ToolPlan("auto", "hermes")
    cut = HERMES_OUTPUT + "\nAnd then some more text that max_tok"
    _, calls, reason = plan.parse(cut, "length")
    assert [c.name for c in calls] == ["get_weather", "get_time"] and reason == "tool_calls"
    assert plan.parse('Checking. <tool_call>{"name": "get_ti', "length")[1:] == ([], "length")


@pytest.mark.parametrize("seed", range(4))
def test_without_parallel_tool_calls_auto_keeps_the_first_call(seed: int) -> None:
    """``parallel_tool_calls: false`` with ``auto``: a model that writes two calls gets the
    first only, streamed or whole (both were returned; vLLM keeps the first, and OpenAI
    promises at most one)."""
    plan = ToolPlan("auto", "hermes", parallel=False)
    content, calls = _stream(plan.stream(), HERMES_OUTPUT, seed)
    whole_content, whole_calls, reason = plan.parse(HERMES_OUTPUT, "stop")
    assert [c["name"] for c in calls] == [c.name for c in whole_calls] == ["get_weather"]
    assert content == whole_content == "Let me check." and reason == "tool_calls"
    names = ("get_weather", "get_time")
    llama = '{"name": "get_weather", "parameters": {}}; {"name": "get_time", "parameters": {}}'
    plan = ToolPlan("auto", "llama3_json", names=names, parallel=False)
    assert [c.name for c in plan.parse(llama, "stop")[1]] == ["get_weather"]
    unclosed = HERMES_OUTPUT.rsplit("</tool_call>", 1)[0]  # the second call, unclosed
    plan = ToolPlan("auto", "hermes", parallel=False)
    assert [c.name for c in plan.parse(unclosed, "stop")[1]] == ["get_weather"]


@pytest.mark.parametrize("seed", range(8))
def test_forced_calls_stream_their_arguments_as_they_come(seed: int) -> None:
    required = (
        '[{"name": "get_weather", "parameters": {"city": "S\\"ao {Paulo}", "unit": "F"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    stream = RequiredStream()
    content, calls = _stream(stream, required, seed)
    assert content == ""
    _, whole, reason = ToolPlan("required", "hermes").parse(required, "stop")
    assert reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole]
    assert json.loads(calls[0]["arguments"]) == {"city": 'S"ao {Paulo}', "unit": "F"}
    assert [c.id for c in stream.calls] == [c["id"] for c in calls]
    named = NamedStream("get_weather")
    content, calls = _stream(named, '{"city": "Lima"}', seed)
    assert content == "" and calls == [
        {"id": named.call.id, "name": "get_weather", "arguments": '{"city": "Lima"}'}
    ]


def test_forced_calls_whole_agree_with_their_streams() -> None:
    """Cut by max_tokens, a forced call is what was streamed -- a call with the arguments so
    far, finish length; an output with no call in it (unconstrained) is its text."""
    required = ToolPlan("required", "hermes")
    content, calls, reason = required.parse('[{"name": "get_weather", "parameters": {"ci', "length")
    assert (content, reason) == (None, "length")
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"ci')]
    assert required.parse("[1, 2]", "stop") == ("[1, 2]", [], "stop")
    named = ToolPlan("named", "hermes", "get_weather").parse('{"city": "Oslo"}', "stop")
    assert named[0] is None and named[2] == "stop"  # a forced function ends with stop
    assert named[1][0].name == "get_weather" and named[1][0].arguments == '{"city": "Oslo"}'


def test_arguments_json_cannot_read_stay_text_and_bad_definitions_are_refused() -> None:
    """Text ``json`` refuses other than with a JSONDecodeError -- nesting past the recursion
    limit, an integer past 4,300 digits -- is text like any other non-JSON: in the history's
    calls (it was a 500 on the request) and in a model's output (a 500 after generating).
    ``$defs`` that are no object are the client's 400 (``ValueError``), not a 500."""
    for arguments in ("[" * 100_000, "1" * 5000):
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        history = [{"role": "assistant", "content": "", "tool_calls": [call]}]
        for template in (TOOLS_TEMPLATE, PLAIN_TEMPLATE):
            messages, _ = template_messages(history, None, template)
            assert arguments in json.dumps(messages)  # kept as the text it came as
        for output in (
            f"<tool_call>{arguments}</tool_call>",
            f'{{"name": "f", "parameters": {arguments}}}',
        ):
            assert parse_calls("hermes", output)[1] == []
            assert parse_calls("llama3_json", output, ("f",))[1] == []
    for defs in ([1], "Loc"):
        tool = {"type": "function", "function": {"name": "go", "parameters": {"$defs": defs}}}
        with pytest.raises(ValueError, match=r"\$defs of go's parameters must be an object"):
            required_schema([tool], parallel=True)


def test_a_call_whose_json_decodes_to_a_lone_surrogate_can_still_be_sent() -> None:
    """A model may write half of a surrogate pair as a JSON escape (``"\\ud83d"`` alone).
    Decoded, that is no Unicode text: a whole response holding it could not be encoded
    (Starlette's JSONResponse raised UnicodeEncodeError -- a 500 after the whole generation).
    The call's arguments keep it as an escape (the same JSON, whole or streamed); a name or
    string arguments holding one leave the block as the content it was written as."""
    from starlette.responses import JSONResponse

    names = ("get_weather",)
    hermes = '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud83d"}}</tool_call>'
    llama = '{"name": "get_weather", "parameters": {"city": "\\ud83d"}}'
    for parser, text in (("hermes", hermes), ("llama3_json", llama)):
        content, calls = parse_calls(parser, text, names)
        assert [c.name for c in calls] == ["get_weather"], parser
        assert json.loads(calls[0].arguments) == {"city": "\ud83d"}  # the JSON the model wrote
        JSONResponse({"content": content, "tool_calls": [c.as_openai() for c in calls]})
        for seed in range(4):
            _, streamed = _stream(ToolPlan("auto", parser, names=names).stream(), text, seed)
            assert [c["arguments"] for c in streamed] == [calls[0].arguments], (parser, seed)
    for block in (
        '{"name": "get_\\ud83d", "arguments": {}}',
        '{"name": "get_weather", "arguments": "\\ud83d"}',
    ):
        text = f"<tool_call>{block}</tool_call>"
        assert parse_calls("hermes", text) == (text, [])
        JSONResponse({"content": text})


def test_a_call_with_a_lone_surrogate_escape_comes_back_in_the_next_turn() -> None:
    """The agent loop: the call a response carried (its arguments keeping a model's half
    surrogate pair as an escape) is sent back in the history of the next request. It must be
    taken, and rendered -- with a template that reads calls as objects, one that iterates
    them, and with the fallback's text -- as text UTF-8 can encode: its arguments an object
    still, the half pair as the escape it came as (the next turn was a 400, and before that a
    500 from the tokenizer). A pair, or no JSON, renders as before."""
    from cluster.serving.openai_protocol import ChatCompletionRequest

    items = (
        "{% for m in messages %}{% for c in m.get('tool_calls') or [] %}"
        "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v }};{% endfor %}"
        "{% endfor %}{% endfor %}{{ tools | length }}"
    )
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud83d"}}</tool_call>'
    _, (call,) = parse_calls("hermes", text, ("get_weather",))
    for arguments, rendered in (
        (call.arguments, {"city": "\\ud83d"}),  # the escape kept, as six characters
        ('{"x": ["a", "\\udfff"]}', {"x": ["a", "\\udfff"]}),
        ('{"x": "\\ud83d\\ude00"}', {"x": "\U0001f600"}),  # a pair: a character
        ("\\ud800 is no JSON", "\\ud800 is no JSON"),
    ):
        called = {"id": "c1", "type": "function"}
        called["function"] = {"name": "get_weather", "arguments": arguments}
        history = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [called]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ]
        ChatCompletionRequest.model_validate({"model": "m", "messages": history})
        for template in ("{{ tools }}", PLAIN_TEMPLATE):
            messages, _ = template_messages(history, [WEATHER], template)
            json.dumps(messages, ensure_ascii=False).encode()  # no lone surrogate in them
        messages, _ = template_messages(history, [WEATHER], "{{ tools }}")
        assert messages[1]["tool_calls"][0]["function"]["arguments"] == rendered
        if isinstance(rendered, dict):  # iterated as an object (GLM-4.5's, Qwen3-Coder's)
            messages, extra = template_messages(history, [WEATHER], items)
            render_chat(items, messages, add_generation_prompt=False, **extra).encode()


def test_developer_messages_reach_a_template_that_knows_no_such_role_as_system() -> None:
    """OpenAI's ``developer`` messages (its newer models' system messages: what its docs,
    Codex and LangChain for o-series models send) reached the template as they came: one that
    renders only the roles it knows (Qwen's) dropped the instructions without a word. They
    are system messages unless the template names the role; the fallback's tools prompt
    joins one that comes first, as it joins a system message."""
    known_roles = (
        "{% for m in messages %}{% if m['role'] in ('system', 'user', 'assistant') %}"
        "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endif %}{% endfor %}"
    )
    messages = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
    ]
    for template in (known_roles, PLAIN_TEMPLATE, TOOLS_TEMPLATE):
        rendered, extra = template_messages(messages, None, template)
        text = render_chat(template, rendered, add_generation_prompt=False, **extra)
        assert "<|system|>Answer in French." in text, template
        assert "developer" not in text
    rendered, _ = template_messages(messages, [WEATHER], PLAIN_TEMPLATE)
    assert [m["role"] for m in rendered] == ["system", "user"]
    assert rendered[0]["content"].startswith("Answer in French.\n\n")
    assert "<tools>" in rendered[0]["content"]
    # A template that names the role renders it itself.
    names_it = known_roles.replace("'assistant')", "'assistant', 'developer')")
    rendered, _ = template_messages(messages, None, names_it)
    assert rendered == messages
    assert "<|developer|>Answer in French." in render_chat(names_it, rendered)


@pytest.mark.parametrize("seed", range(8))
def test_a_step_sends_each_call_as_one_delta(seed: int) -> None:
    """Forced calls: a step's ``tool_calls`` deltas name each call once -- the header with
    the first arguments of the step. Two entries of one index in a chunk (the header, then
    the first token's arguments: every named call's first chunk) were kept as two calls by
    client accumulators that copy a call list's first appearance as it is (openai-python's
    before its issue #3201), losing the arguments' start."""
    required = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    for make, text in (
        (RequiredStream, required),
        (lambda: NamedStream("get_weather"), '{"city": "Lima"}'),
    ):
        for pieces in (_pieces(text, seed), [text]):
            stream, calls = make(), []
            for piece in pieces:
                _, deltas = stream.feed(piece)
                indexes = [d["index"] for d in deltas]
                assert len(indexes) == len(set(indexes)), deltas
                for delta in deltas:
                    if delta["index"] == len(calls):  # a client's accumulator
                        calls.append({**delta["function"], "id": delta["id"]})
                    else:
                        calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
            assert [(c["name"], c["arguments"]) for c in calls] == [
                (c.name, c.arguments) for c in stream.calls
            ]
    (header,) = NamedStream("get_weather").feed('{"ci')[1]
    assert header["type"] == "function" and header["function"] == {
        "name": "get_weather",
        "arguments": '{"ci',
    }
