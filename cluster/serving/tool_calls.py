"""Tool calling for chat completions: tools into the prompt, calls out of the output.

``tool_choice`` decides how a call is obtained (OpenAI's values, vLLM's behaviour):

- ``none``: the tools are left out of the prompt (as vLLM's
  ``--exclude-tools-when-tool-choice-none``); the answer is text.
- ``auto`` (the default with tools): the tools reach the chat template; the output is parsed
  for calls in the model's own format (``ToolParser``: ``hermes`` -- ``<tool_call>`` blocks
  holding ``{"name", "arguments"}``, as Hermes, Qwen and the fallback prompt write them -- or
  ``llama3_json`` -- a bare ``{"name", "parameters"}`` object, Llama 3.1's custom-tool format),
  chosen from the template or by ``tool_call_parser`` (vLLM's ``--tool-call-parser``).
- ``required``: structured outputs hold the output to a JSON array of calls
  (``[{"name": ..., "parameters": {...}}]``, one at most without ``parallel_tool_calls``),
  each with arguments that match its function's schema.
- a named function (``{"type": "function", "function": {"name": ...}}``): structured outputs
  hold the output to that function's parameters; the whole output is its arguments.

A chat template that never mentions ``tools`` (SmolLM2's, for one) gets them in a system
prompt instead (``fallback_system_prompt``: the tools as JSON schemas and Hermes' call format),
and the history's calls and results as text in that format (assistant ``<tool_call>`` blocks,
``tool`` results as user turns in ``<tool_response>`` blocks).

Streams carry calls as OpenAI's ``tool_calls`` deltas: the first delta of a call has its
``index``, ``id``, ``type`` and ``function.name`` (arguments ``""``), later ones append to
``function.arguments``. Named and required calls stream their arguments as they are generated;
``auto`` sends a call whole once its block is complete (text around it streams as content).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

PARSERS = ("hermes", "llama3_json")

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolPlan:
    """How one request's output becomes tool calls."""

    mode: str  # "auto", "required" or "named"
    parser: str  # the format auto parses
    name: str | None = None  # the named function

    def stream(self) -> ToolStream:
        if self.mode == "named":
            assert self.name is not None
            return NamedStream(self.name)
        if self.mode == "required":
            return RequiredStream()
        return AutoStream(self.parser)

    def parse(
        self, text: str, finish_reason: str | None
    ) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, calls, finish_reason) of a whole output. A call cut short by max_tokens
        stays text (``length``); calls found end the choice with ``tool_calls`` (a named
        choice with ``stop``, as OpenAI)."""
        if self.mode == "named":
            assert self.name is not None
            if finish_reason != "stop":
                return text, [], finish_reason
            return None, [ToolCall(self.name, text)], finish_reason
        if self.mode == "required":
            calls = calls_from_required(text) if finish_reason == "stop" else None
            if not calls:
                return text, [], finish_reason
            return None, calls, "tool_calls"
        content, calls = parse_calls(self.parser, text)
        return content, calls, "tool_calls" if calls and finish_reason == "stop" else finish_reason


# -- the prompt ------------------------------------------------------------------------------
def template_supports_tools(template: str | None) -> bool:
    """Whether the chat template renders a ``tools`` list itself."""
    return template is not None and re.search(r"\btools\b", template) is not None


def parser_for(template: str | None, override: str | None) -> str:
    """The output format to parse for ``auto``: the override, else the template's own, else
    Hermes' (what the fallback prompt asks for)."""
    if override is not None:
        if override not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}")
        return override
    if template and ("<|python_tag|>" in template or "ipython" in template):
        return "llama3_json"
    return "hermes"


def fallback_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Tools for a template that cannot render them: their schemas and how to call them."""
    lines = "\n".join(json.dumps(tool["function"], ensure_ascii=False) for tool in tools)
    return (
        f"You may call these functions (JSON schemas):\n<tools>\n{lines}\n</tools>\n"
        "To call one, reply with one block per call:\n"
        f'{_HERMES_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n'
        f"{_HERMES_CLOSE}"
    )


def template_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables to render: with ``tools`` (None: left out)
    for a template that takes them; otherwise the fallback prompt, and the history's calls
    and results written as text."""
    if template_supports_tools(template):
        rendered = [_with_parsed_arguments(m) for m in messages]
        return rendered, ({"tools": tools} if tools else {})
    has_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not tools and not has_history:
        return messages, {}
    rendered = [_as_text(m) for m in messages]
    if tools:
        prompt = fallback_system_prompt(tools)
        if rendered and rendered[0]["role"] == "system":
            first = rendered[0]
            rendered[0] = {**first, "content": f"{first['content']}\n\n{prompt}"}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, {}


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """Templates read a call's arguments as an object (``| tojson``); the API carries text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        function = dict(call["function"])
        function["arguments"] = _loads_or_text(function)  # not JSON: the text as it came
        parsed.append({**call, "function": function})
    return {**message, "tool_calls": parsed}


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {
            "role": "user",
            "content": f"<tool_response>\n{message['content']}\n</tool_response>",
        }
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [
        f"{_HERMES_OPEN}\n"
        + json.dumps(
            {"name": c["function"]["name"], "arguments": _loads_or_text(c["function"])},
            ensure_ascii=False,
        )
        + f"\n{_HERMES_CLOSE}"
        for c in calls
    ]
    text = "\n".join(([message["content"]] if message["content"] else []) + blocks)
    return {"role": message["role"], "content": text}


def _loads_or_text(function: dict[str, Any]) -> Any:
    try:
        return json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        return function.get("arguments")


# -- forced calls: the schemas structured outputs enforce ------------------------------------
# A function without ``parameters`` takes none (OpenAI: "an empty parameter list").
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or NO_PARAMETERS


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """``tool_choice: required``: a non-empty array of calls, each a function's name with
    arguments that match its schema (one call at most without ``parallel_tool_calls``)."""
    items = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    "parameters": _parameters(tool),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
    }
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A named ``tool_choice``: the output is that function's arguments."""
    return _parameters(tool)


def calls_from_required(text: str) -> list[ToolCall] | None:
    """The calls of a ``required`` output (None: not a complete array -- cut by length)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [
        ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items
    ]


# -- auto: parsing the model's own format ----------------------------------------------------
def parse_calls(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole ``auto`` output: calls that do not parse stay content."""
    if parser == "llama3_json":
        return _parse_llama3(text)
    return _parse_hermes(text)


def _call_from_json(blob: str, args_key: str) -> ToolCall | None:
    try:
        value = json.loads(blob)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(args_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    while True:
        start = text.find(_HERMES_OPEN, pos)
        if start < 0:
            content.append(text[pos:])
            break
        end = text.find(_HERMES_CLOSE, start)
        if end < 0:  # an unclosed block (cut by length): text
            content.append(text[pos:])
            break
        call = _call_from_json(text[start + len(_HERMES_OPEN) : end].strip(), "arguments")
        if call is None:
            content.append(text[pos : end + len(_HERMES_CLOSE)])
        else:
            content.append(text[pos:start])
            calls.append(call)
        pos = end + len(_HERMES_CLOSE)
    rest = "".join(content).strip() if calls else "".join(content)
    return (rest or None) if calls else rest, calls


def _parse_llama3(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    for blob in _split_objects(body):
        call = _call_from_json(blob, "parameters")
        if call is None:
            return text, []
        calls.append(call)
    return None, calls


def _split_objects(body: str) -> list[str]:
    """Top-level JSON objects separated by ``;`` (Llama 3's parallel calls) or whitespace."""
    blobs, depth, start, in_str, esc = [], 0, None, False, False
    for i, ch in enumerate(body):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            if depth == 0:
                start = i
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0 and start is not None:
                blobs.append(body[start : i + 1])
                start = None
        elif depth == 0 and ch not in "; \n\t\r":
            return [body]  # something else between objects: not calls
    return blobs if depth == 0 else [body]


# -- streaming -------------------------------------------------------------------------------
class ToolStream:
    """One streamed choice's text deltas turned into content and ``tool_calls`` deltas
    (``feed`` per step, ``finish`` at the end); ``calls`` the calls sent."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return "", []

    def _whole(self, call: ToolCall) -> dict[str, Any]:
        index = len(self.calls)
        self.calls.append(call)
        return {"index": index, **call.as_openai()}


class NamedStream(ToolStream):
    """A named ``tool_choice``: every token is the call's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.call = ToolCall(name, "")

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        deltas = []
        if not self.calls:
            self.calls.append(self.call)
            deltas.append({"index": 0, **ToolCall(self.call.name, "", self.call.id).as_openai()})
        if text:
            self.call.arguments += text
            deltas.append({"index": 0, "function": {"arguments": text}})
        return "", deltas


class RequiredStream(ToolStream):
    """``tool_choice: required``: the output is ``[{"name": ..., "parameters": {...}}, ...]``
    (the grammar fixes the key order and the separators); a scanner that knows where it is in
    that JSON sends each call's header when its parameters begin and their text as it comes."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.in_str = self.escaped = self.in_value = False
        self.text: list[str] = []  # the current string's characters
        self.key: str | None = None
        self.name: str | None = None
        self.capturing = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        deltas: list[dict[str, Any]] = []
        args: list[str] = []
        for ch in text:
            if self.capturing:
                args.append(ch)
            if self.in_str:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_str = False
                    self._string("".join(self.text))
                else:
                    self.text.append(ch)
                continue
            if ch == '"':
                self.in_str, self.text = True, []
            elif ch in "{[":
                if self.depth == 2 and self.key == "parameters" and not self.capturing:
                    self._flush(args, deltas)
                    call = ToolCall(self.name or "", "")
                    deltas.append({"index": len(self.calls), **call.as_openai()})
                    self.calls.append(call)
                    self.capturing = True
                    args.append(ch)
                self.depth += 1
                if self.depth == 2:
                    self.in_value, self.key = False, None
            elif ch in "}]":
                self.depth -= 1
                if self.capturing and self.depth == 2:
                    self._flush(args, deltas)
                    self.capturing = False
            elif self.depth == 2 and ch == ":":
                self.in_value = True
            elif self.depth == 2 and ch == ",":
                self.in_value, self.key = False, None
        self._flush(args, deltas)
        return "", deltas

    def _string(self, value: str) -> None:
        if self.depth != 2:
            return
        if not self.in_value:
            self.key = value
        elif self.key == "name":
            self.name = value

    def _flush(self, args: list[str], deltas: list[dict[str, Any]]) -> None:
        if args and self.calls:
            chunk = "".join(args)
            self.calls[-1].arguments += chunk
            deltas.append({"index": len(self.calls) - 1, "function": {"arguments": chunk}})
        args.clear()


class AutoStream(ToolStream):
    """``auto``: content streams as it comes, except what may be the start of a call, which
    waits until it is one (then sent whole) or is not (then sent as content)."""

    def __init__(self, parser: str) -> None:
        super().__init__()
        self.parser = parser
        self.pending = ""  # text held back
        self.started = False  # any non-space output yet (llama3_json decides on the first)
        self.buffering_all = False  # llama3_json: the output is a call: parse it at the end

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.parser == "llama3_json":
            return self._feed_llama3(text)
        self.pending += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self.pending:
            start = self.pending.find(_HERMES_OPEN)
            if start < 0:
                keep = _partial_suffix(self.pending, _HERMES_OPEN)
                content.append(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                break
            end = self.pending.find(_HERMES_CLOSE, start)
            if end < 0:
                content.append(self.pending[:start])
                self.pending = self.pending[start:]
                break
            block = self.pending[start + len(_HERMES_OPEN) : end].strip()
            call = _call_from_json(block, "arguments")
            if call is None:
                content.append(self.pending[: end + len(_HERMES_CLOSE)])
            else:
                content.append(self.pending[:start])
                deltas.append(self._whole(call))
            self.pending = self.pending[end + len(_HERMES_CLOSE) :]
        return "".join(content), deltas

    def _feed_llama3(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.buffering_all:
            self.pending += text
            return "", []
        if not self.started:
            self.pending += text
            head = self.pending.lstrip()
            if not head:
                return "", []
            self.started = True
            if head.startswith("{") or head.startswith(_PYTHON_TAG):
                self.buffering_all = True
                return "", []
            text, self.pending = self.pending, ""
        return text, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        pending, self.pending = self.pending, ""
        if self.parser == "llama3_json" and self.buffering_all:
            content, calls = _parse_llama3(pending)
            if calls:
                return "", [self._whole(call) for call in calls]
            return content or "", []
        return pending, []


def _partial_suffix(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
