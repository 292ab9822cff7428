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
    names: tuple[str, ...] = ()  # the request's functions (auto: calls of others are text)

    def stream(self) -> ToolStream:
        if self.mode == "named":
            assert self.name is not None
            return NamedStream(self.name)
        if self.mode == "required":
            return RequiredStream()
        return AutoStream(self.parser, self.names)

    def parse(
        self, text: str, finish_reason: str | None
    ) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, calls, finish_reason) of a whole output: what its stream sends, so the
        two always agree. Calls end the choice with ``tool_calls`` (a named function's with
        ``stop``, as OpenAI; a call cut by max_tokens keeps ``length``); with calls, empty
        content is null."""
        stream = self.stream()
        content, _ = stream.feed(text)
        more, _ = stream.finish()
        content += more
        return (
            (content or None) if stream.calls else content,
            stream.calls,
            self.finish_reason(finish_reason, stream),
        )

    def finish_reason(self, reason: str | None, stream: ToolStream) -> str | None:
        if reason == "stop" and stream.calls and self.mode != "named":
            return "tool_calls"
        return reason


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
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template: str | None,
    system_role: bool = True,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and extra template variables to render: with ``tools`` (None: left out)
    for a template that takes them; otherwise the fallback prompt -- a system message, or
    (``system_role`` false, for templates that refuse one) the start of the first user
    message -- and the history's calls and results written as text (consecutive results in
    one user turn: strict templates want user and assistant to alternate)."""
    if template_supports_tools(template):
        parsed = [_with_parsed_arguments(m) for m in messages]
        return parsed, ({"tools": tools} if tools else {})
    has_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not tools and not has_history:
        return messages, {}
    rendered: list[dict[str, Any]] = []
    for message in messages:
        text = _as_text(message)
        if message["role"] == "tool" and rendered and rendered[-1].get("_results"):
            last = rendered[-1]
            rendered[-1] = {**last, "content": f"{last['content']}\n{text['content']}"}
        else:
            rendered.append({**text, "_results": True} if message["role"] == "tool" else text)
    rendered = [{k: v for k, v in m.items() if k != "_results"} for m in rendered]
    if tools:
        prompt = fallback_system_prompt(tools)
        first = rendered[0] if rendered else None
        if first is not None and first["role"] == "system":
            rendered[0] = {**first, "content": f"{first['content']}\n\n{prompt}"}
        elif system_role or first is None or first["role"] != "user":
            rendered.insert(0, {"role": "system", "content": prompt})
        else:
            rendered[0] = {**first, "content": f"{prompt}\n\n{first['content']}"}
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
    arguments that match its schema (one call at most without ``parallel_tool_calls``).
    Each function's ``$defs`` / ``definitions`` move to the root, where its references
    point; ``ValueError`` if two functions define one name differently."""
    hoisted: dict[str, dict[str, Any]] = {}
    variants = []
    for tool in tools:
        parameters = dict(_parameters(tool))
        for key in ("$defs", "definitions"):
            for def_name, definition in (parameters.pop(key, None) or {}).items():
                into = hoisted.setdefault(key, {})
                if def_name in into and into[def_name] != definition:
                    raise ValueError(
                        f"tools: {key}.{def_name} differs between functions (one schema holds "
                        "them all for tool_choice required)"
                    )
                into[def_name] = definition
        variants.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": variants}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(hoisted)
    return schema


def named_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A named ``tool_choice``: the output is that function's arguments."""
    return _parameters(tool)


# -- auto: parsing the model's own format ----------------------------------------------------
def parse_calls(
    parser: str, text: str, names: tuple[str, ...] = ()
) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole ``auto`` output (``ToolPlan.parse``: its stream)."""
    return ToolPlan("auto", parser, names=names).parse(text, None)[:2]


def _call_from_json(blob: str, strict: bool, names: tuple[str, ...] = ()) -> ToolCall | None:
    """A call from ``{"name": ..., "arguments" | "parameters": {...}}``. ``strict``
    (llama3_json, whose calls are bare JSON that any answer could look like): the arguments
    must be there and the name one of ``names``."""
    try:
        value = json.loads(blob)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = "arguments" if "arguments" in value else "parameters"
    if strict and (key not in value or (names and value["name"] not in names)):
        return None
    arguments = value.get(key, {})
    if isinstance(arguments, str):
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _parse_llama3(text: str, names: tuple[str, ...]) -> list[ToolCall]:
    """The calls of a whole llama3_json output ([] when any part is no call)."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return []
    calls = []
    for blob in _split_objects(body):
        call = _call_from_json(blob, True, names)
        if call is None:
            return []
        calls.append(call)
    return calls


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
    that JSON sends each call's header when its parameters begin and their text as it comes.
    An output with no call in it (unconstrained after a grammar failure) ends as content."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []  # the whole output, for that case
        self.depth = 0
        self.in_str = self.escaped = self.in_value = False
        self.text: list[str] = []  # the current string's characters
        self.key: str | None = None
        self.name: str | None = None
        self.capturing = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        deltas: list[dict[str, Any]] = []
        args: list[str] = []
        self.seen.append(text)
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

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return ("" if self.calls else "".join(self.seen)), []

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
    """``auto``: content streams as it comes, except what may be the start of a call (held
    until it is one, then sent whole, or is not, then sent as content) and whitespace next
    to calls (dropped: with calls, content is what the model wrote around them)."""

    def __init__(self, parser: str, names: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.parser = parser
        self.names = names
        self.pending = ""  # text held back
        self.started = False  # any non-space output yet (llama3_json decides on the first)
        self.buffering_all = False  # llama3_json: the output may be calls: read it at the end
        self.after_call = False  # a call went out and no text since
        self.wrote = False  # some content went out

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.parser == "llama3_json":
            return self._feed_llama3(text)
        self.pending += text
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        while self.pending:
            start = self.pending.find(_HERMES_OPEN)
            if start < 0:
                cut = len(self.pending) - _partial_suffix(self.pending, _HERMES_OPEN)
                while cut > 0 and self.pending[cut - 1].isspace():
                    cut -= 1  # whitespace waits: a call may follow it
                content.append(self._content(self.pending[:cut]))
                self.pending = self.pending[cut:]
                break
            end = self.pending.find(_HERMES_CLOSE, start)
            if end < 0:  # the whitespace before the tag waits with it
                kept = self.pending[:start].rstrip()
                content.append(self._content(kept))
                self.pending = self.pending[len(kept) :]
                break
            block = self.pending[start + len(_HERMES_OPEN) : end].strip()
            call = _call_from_json(block, False)
            if call is None:  # not a call after all: text
                content.append(self._content(self.pending[: end + len(_HERMES_CLOSE)]))
            else:
                content.append(self._content(self.pending[:start].rstrip()))
                deltas.append(self._whole(call))
                self.after_call = True
            self.pending = self.pending[end + len(_HERMES_CLOSE) :]
        return "".join(content), deltas

    def _content(self, text: str) -> str:
        """Text to send; right after a call, its leading whitespace is dropped (one newline
        keeps it apart from text before the call)."""
        if self.after_call:
            text = text.lstrip()
            self.after_call = not text
            if text and self.wrote:
                text = "\n" + text
        self.wrote = self.wrote or bool(text)
        return text

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
            calls = _parse_llama3(pending, self.names)
            if calls:
                return "", [self._whole(call) for call in calls]
            return pending, []
        if self.calls and not pending.strip():
            return "", []  # whitespace after the last call
        return self._content(pending), []


def _partial_suffix(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
