"""Reading tool calls out of a model's text: the call, the formats' parsers, and the streams
that turn a choice's text deltas into content and OpenAI's ``tool_calls`` deltas (their
whole responses are built by running them over the whole text: ``tool_calls.ToolPlan``)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from cluster.serving.agent_fields import SURROGATE

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


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


def _call_from_json(blob: str, strict: bool, names: tuple[str, ...] = ()) -> ToolCall | None:
    """A call from ``{"name": ..., "arguments" | "parameters": {...}}``. ``strict``
    (llama3_json, whose calls are bare JSON that any answer could look like): the arguments
    must be there and the name one of ``names``."""
    try:
        value = json.loads(blob)
    except (ValueError, RecursionError):  # (a huge integer, nesting past the recursion limit)
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = "arguments" if "arguments" in value else "parameters"
    if strict and (key not in value or (names and value["name"] not in names)):
        return None
    arguments = value.get(key, {})
    if isinstance(arguments, str):
        if SURROGATE.search(value["name"] + arguments):
            return None  # no text a response can carry: the block stays content, as written
        return ToolCall(value["name"], arguments)
    if SURROGATE.search(value["name"]):
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False)
        if SURROGATE.search(text):  # the same JSON, its surrogates kept as escapes
            text = json.dumps(arguments)
    except RecursionError:  # (nesting json.loads just took, one frame deeper)
        return None
    return ToolCall(value["name"], text)


def _parse_llama3(text: str, names: tuple[str, ...]) -> list[ToolCall]:
    """The calls of a whole llama3_json output ([] when any part is no call)."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
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
def one_per_call(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One step's ``tool_calls`` deltas with one entry per call: a call's header and its
    first arguments (or two pieces of its arguments) joined. Two entries of one ``index`` in
    a chunk are allowed by the schema, but client accumulators kept them as two calls
    (openai-python's ``accumulate_delta`` before its fix of issue #3201: the stream helpers'
    final message had a second, nameless call and the first one's arguments lost their
    start); OpenAI sends one entry per call. A call's deltas of one step are consecutive."""
    merged: list[dict[str, Any]] = []
    for delta in deltas:
        if merged and merged[-1]["index"] == delta["index"]:
            last = merged[-1]
            function = dict(last.get("function") or {})
            more = (delta.get("function") or {}).get("arguments", "")
            function["arguments"] = function.get("arguments", "") + more
            merged[-1] = {**last, "function": function}
        else:
            merged.append(delta)
    return merged


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
        return "", one_per_call(deltas)


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
        return "", one_per_call(deltas)

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
    to calls (dropped: with calls, content is what the model wrote around them). Without
    ``parallel`` (``parallel_tool_calls: false``) calls after the first are dropped, as
    vLLM does: OpenAI promises at most one."""

    def __init__(self, parser: str, names: tuple[str, ...] = (), parallel: bool = True) -> None:
        super().__init__()
        self.parser = parser
        self.names = names
        self.parallel = parallel
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
            start = self.pending.find(HERMES_OPEN)
            if start < 0:
                cut = len(self.pending) - _partial_suffix(self.pending, HERMES_OPEN)
                while cut > 0 and self.pending[cut - 1].isspace():
                    cut -= 1  # whitespace waits: a call may follow it
                content.append(self._content(self.pending[:cut]))
                self.pending = self.pending[cut:]
                break
            end = self.pending.find(HERMES_CLOSE, start)
            if end < 0:  # the whitespace before the tag waits with it
                kept = self.pending[:start].rstrip()
                content.append(self._content(kept))
                self.pending = self.pending[len(kept) :]
                break
            block = self.pending[start + len(HERMES_OPEN) : end].strip()
            call = _call_from_json(block, False)
            if call is None:  # not a call after all: text
                content.append(self._content(self.pending[: end + len(HERMES_CLOSE)]))
            else:
                content.append(self._content(self.pending[:start].rstrip()))
                deltas += self._taken(call)
                self.after_call = True
            self.pending = self.pending[end + len(HERMES_CLOSE) :]
        return "".join(content), deltas

    def _taken(self, call: ToolCall) -> list[dict[str, Any]]:
        """The call's delta, or none for a second call without ``parallel``."""
        if self.calls and not self.parallel:
            return []
        return [self._whole(call)]

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
            if not head or (len(head) < len(PYTHON_TAG) and PYTHON_TAG.startswith(head)):
                # A tag split across deltas ('<|python_t' + 'ag|>...') must not stream out as
                # content: hold its start until it either completes or can no longer be it.
                return "", []
            self.started = True
            if head.startswith("{") or head.startswith(PYTHON_TAG):
                self.buffering_all = True
                return "", []
            text, self.pending = self.pending, ""
        return text, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        pending, self.pending = self.pending, ""
        if self.parser == "llama3_json" and self.buffering_all:
            calls = _parse_llama3(pending, self.names)
            if calls:
                return "", [delta for call in calls for delta in self._taken(call)]
            return pending, []
        head = pending.lstrip()
        if head.startswith(HERMES_OPEN):
            # A last block with no closing tag: the client's stop ["</tool_call>"] took it,
            # or the model ended its turn without it. A whole call still is one (as vLLM's
            # hermes parser reads it); a close cut short by max_tokens is dropped with it.
            block = head[len(HERMES_OPEN) :]
            block = block[: len(block) - _partial_suffix(block, HERMES_CLOSE)].strip()
            call = _call_from_json(block, False)
            if call is not None:
                self.after_call = True
                return "", self._taken(call)
        if self.calls and not pending.strip():
            return "", []  # whitespace after the last call
        return self._content(pending), []


def _partial_suffix(text: str, tag: str) -> int:
    """How many of ``text``'s last characters could begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
