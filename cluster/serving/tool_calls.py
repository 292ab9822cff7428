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
from dataclasses import dataclass
from typing import Any

from cluster.serving.agent_fields import SURROGATE
from cluster.serving.tool_streams import (
    HERMES_CLOSE,
    HERMES_OPEN,
    AutoStream,
    NamedStream,
    RequiredStream,
    ToolCall,
    ToolStream,
)

PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ToolPlan:
    """How one request's output becomes tool calls."""

    mode: str  # "auto", "required" or "named"
    parser: str  # the format auto parses
    name: str | None = None  # the named function
    names: tuple[str, ...] = ()  # the request's functions (auto, llama3_json: calls of others
    # are text; hermes returns them as calls, as vLLM's hermes parser does)
    parallel: bool = True  # parallel_tool_calls (auto: calls after the first are dropped)

    def stream(self) -> ToolStream:
        if self.mode == "named":
            assert self.name is not None
            return NamedStream(self.name)
        if self.mode == "required":
            return RequiredStream()
        return AutoStream(self.parser, self.names, self.parallel)

    def parse(
        self, text: str, finish_reason: str | None
    ) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, calls, finish_reason) of a whole output: what its stream sends, so the
        two always agree. Calls end the choice with ``tool_calls`` (a named function's with
        ``stop``, as OpenAI): with ``auto``, also when max_tokens cut the output after whole
        calls, as vLLM (a call cut short is no call); ``required``'s array cut short keeps
        ``length``. With calls, empty content is null."""
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
        if not stream.calls or self.mode == "named":
            return reason
        if reason == "stop" or (reason == "length" and self.mode == "auto"):
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
        f'{HERMES_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments>}}}}\n'
        f"{HERMES_CLOSE}"
    )


def developer_as_system(
    messages: list[dict[str, Any]], template: str | None
) -> list[dict[str, Any]]:
    """OpenAI's ``developer`` role is the system message of its newer models (its docs' own
    examples, Codex and LangChain for o-series models send it). A chat template that never
    names the role drops such a message without a word (Qwen's: no branch renders it) or
    shows the model a role it never saw (SmolLM2's, Llama 3's): it goes in as ``system``, as
    llama.cpp maps it and vLLM folds it on its Responses API. A template that names the role
    gets it as sent."""
    if template is not None and "developer" in template:
        return messages
    if not any(m["role"] == "developer" for m in messages):
        return messages
    return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]


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
    one user turn: strict templates want user and assistant to alternate). ``developer``
    messages are ``system`` ones unless the template knows that role (``developer_as_system``)."""
    messages = developer_as_system(messages, template)
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
        f"{HERMES_OPEN}\n"
        + json.dumps(
            {"name": c["function"]["name"], "arguments": _loads_or_text(c["function"])},
            ensure_ascii=False,
        )
        + f"\n{HERMES_CLOSE}"
        for c in calls
    ]
    text = "\n".join(([message["content"]] if message["content"] else []) + blocks)
    return {"role": message["role"], "content": text}


def _loads_or_text(function: dict[str, Any]) -> Any:
    # Not only JSONDecodeError: an integer past 4,300 digits is a plain ValueError, nesting
    # past the interpreter's recursion limit a RecursionError (the client's text, not a 500).
    text = function.get("arguments") or "{}"
    try:
        value = json.loads(text)
        # A lone surrogate escape ("\\ud83d": half a pair, as a model may write one and our
        # own responses keep it) decodes to no Unicode text: the template's JSON of it could
        # not be tokenized. Such a surrogate is rendered as the escape it came as, in the
        # object it is part of: templates that read the arguments as an object (``.items()``,
        # ``| items``: GLM-4.5's, Qwen3-Coder's) render them as they would any other.
        if "\\u" in text and SURROGATE.search(json.dumps(value, ensure_ascii=False)):
            return _escaped_surrogates(value)
        return value
    except (ValueError, RecursionError):
        return function.get("arguments")


def _escaped_surrogates(value: Any) -> Any:
    """``value`` (decoded JSON) with each lone surrogate of its strings, keys too, written as
    the escape it came as (``\\ud83d``: six characters): the same shape, text UTF-8 encodes."""
    if isinstance(value, str):
        return SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", value)
    if isinstance(value, list):
        return [_escaped_surrogates(item) for item in value]
    if isinstance(value, dict):
        return {_escaped_surrogates(k): _escaped_surrogates(v) for k, v in value.items()}
    return value


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
            definitions = parameters.pop(key, None) or {}
            if not isinstance(definitions, dict):
                raise ValueError(
                    f"tools: {key} of {tool['function']['name']}'s parameters must be an object "
                    "(definitions by name)"
                )
            for def_name, definition in definitions.items():
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
