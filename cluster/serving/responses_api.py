"""OpenAI's Responses API (``POST /v1/responses``) as an adapter over chat completions: the
request (``responses_protocol.ResponsesRequest``) runs as the chat completion it was built
into, through ``OpenAIServing.chat`` -- its validation, limits, tool parsing and structured
outputs all apply -- and the answer is mapped back: a whole chat completion to a ``response``
object (its text a ``message`` item, its calls ``function_call`` items), a chat stream's
chunks to the Responses events (``event: <type>`` and ``data: <json>``, each with its
``sequence_number``; no ``[DONE]``, as OpenAI). A response cut by ``max_output_tokens`` is
``incomplete`` (streamed, its last event is still ``response.completed``, which the openai
SDK's stream helper needs); a stream that fails after its 200 ends with an ``error`` event
and ``response.failed``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from cluster.serving.errors import APIError, api_error
from cluster.serving.openai_serving import OpenAIServing
from cluster.serving.responses_protocol import (
    CHAT_NAMES,
    FunctionChoice,
    ResponsesRequest,
    chat_name,
    renamed_text,
)
from cluster.serving.sse import ClosingGenerator


async def create_response(
    serving: OpenAIServing, req: ResponsesRequest, trace_headers: dict[str, str] | None = None
) -> dict[str, Any] | AsyncGenerator[str, None]:
    """``/v1/responses``: the response object, or (``stream``) its SSE events."""
    chat = req.chat_request()
    try:
        result = await serving.chat(chat, trace_headers)
    except APIError as exc:
        raise _renamed(exc) from None
    rid = f"resp_{uuid.uuid4().hex}"
    if isinstance(result, dict):
        return whole_response(rid, req, result)
    events = _ResponseEvents(rid, req, chat.model or serving.model_name)
    return ClosingGenerator(events.run(result), result.aclose)  # (closing it aborts the chat)


def _renamed(exc: APIError) -> APIError:
    """An error of the chat request, naming this API's field."""
    if exc.param is None or exc.param.partition(".")[0] not in CHAT_NAMES:
        return exc
    return APIError(exc.status, renamed_text(exc.message), chat_name(exc.param), exc.headers)


# -- responses -------------------------------------------------------------------------------
def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def _message_item(text: str | None, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [] if text is None else [_text_part(text)],
    }


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def response_body(
    rid: str,
    req: ResponsesRequest,
    model: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """The ``response`` object: its outcome and the request's settings, as OpenAI echoes them."""
    text_format: dict[str, Any] = {"type": "text"}
    if req.text is not None and req.text.format is not None:
        text_format = req.text.format.model_dump(by_alias=True, exclude_none=True)
    choice: Any = req.tool_choice or "auto"
    if isinstance(choice, FunctionChoice):
        choice = choice.model_dump()
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": None,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "text": {"format": text_format},
        "tool_choice": choice,
        "tools": [tool.model_dump() for tool in req.tools or []],
        "metadata": req.metadata or {},
        "store": False,
        "truncation": "disabled",
        "user": req.user,
        "usage": _usage(usage),
    }


def whole_response(rid: str, req: ResponsesRequest, chat: dict[str, Any]) -> dict[str, Any]:
    """A whole chat completion as a response: its text a message, its calls function calls
    (a message too when there is neither); cut by ``max_output_tokens``: incomplete."""
    choice = chat["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    status = "incomplete" if choice["finish_reason"] == "length" else "completed"
    output: list[dict[str, Any]] = []
    if message.get("content") or not calls:
        output.append(_message_item(message.get("content") or "", "completed"))
    for call in calls:
        function = call["function"]
        output.append(_call_item(call["id"], function["name"], function["arguments"], "completed"))
    output[-1]["status"] = status
    return response_body(rid, req, chat["model"], int(time.time()), status, output, chat["usage"])


class _ResponseEvents:
    """The Responses events of a streamed chat completion (its SSE chunks in): an item per
    run of text and per call, each added, its deltas, then done, in the order they came."""

    def __init__(self, rid: str, req: ResponsesRequest, model: str) -> None:
        self.rid, self.req, self.model = rid, req, model
        self.created = int(time.time())
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: int | None = None  # the output index of the item being streamed
        self.text: list[str] = []  # the open message's text so far
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its output index
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def event(self, kind: str, /, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    def response(self, status: str) -> dict[str, Any]:
        if status == "in_progress":
            return response_body(self.rid, self.req, self.model, self.created, status, [], None)
        output, usage = self.output, self.usage
        return response_body(self.rid, self.req, self.model, self.created, status, output, usage)

    def fail(self, error: dict[str, Any]) -> list[str]:
        """A stream that failed after its 200: an ``error`` event, then ``response.failed``
        with what was output so far (as OpenAI ends one; Codex reads the failure from
        ``response.failed`` alone). The open item gets no done events: the openai SDK's
        stream helper would parse a cut ``text.format`` answer at its text's done event."""
        code, param = error.get("code"), error.get("param")
        message = str(error.get("message", "error"))
        text_code = None if code is None else str(code)
        events = [self.event("error", code=text_code, message=message, param=param)]
        if self.open is not None:  # the item being streamed: cut where it was
            item = self.output[self.open]
            item["status"] = "incomplete"
            if item["type"] == "message":
                item["content"] = [_text_part("".join(self.text))]
        failed = self.response("failed")
        kind = "rate_limit_exceeded" if code == 429 else "server_error"
        failed["error"] = {"code": kind, "message": message}
        events.append(self.event("response.failed", response=failed))
        return events

    async def run(self, chunks: AsyncIterator[str]) -> AsyncGenerator[str, None]:
        yield self.event("response.created", response=self.response("in_progress"))
        yield self.event("response.in_progress", response=self.response("in_progress"))
        try:
            async for line in chunks:
                payload = line.removeprefix("data: ").strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:  # the chat stream failed after its 200
                    for event in self.fail(chunk["error"]):
                        yield event
                    return
                for event in self.feed(chunk):
                    yield event
        except Exception as exc:
            for event in self.fail(api_error(exc).body()["error"]):
                yield event
            return
        for event in self.finish():
            yield event

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        self.usage = chunk.get("usage") or self.usage
        events: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self.add_text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self.add_call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def finish(self) -> list[str]:
        status = "incomplete" if self.finish_reason == "length" else "completed"
        # Nothing at all: an empty message (as a whole response has).
        events: list[str] = [] if self.output else self.open_message()
        events += self.close(status)
        # ``response.completed`` also for an incomplete one (its status says so): the openai
        # SDK's stream helper (``get_final_response``), which the Agents SDK builds on,
        # takes the final response from that event alone -- after OpenAI's
        # ``response.incomplete`` it raised "Didn't receive a `response.completed` event".
        events.append(self.event("response.completed", response=self.response(status)))
        return events

    def _add(self, item: dict[str, Any]) -> list[str]:
        self.output.append(item)
        self.open = len(self.output) - 1
        return [self.event("response.output_item.added", output_index=self.open, item=item)]

    def open_message(self) -> list[str]:
        events = self.close("completed") + self._add(_message_item(None, "in_progress"))
        part = _text_part("")
        events.append(self.event("response.content_part.added", **self._in_text(), part=part))
        return events

    def add_text(self, delta: str) -> list[str]:
        is_message = self.open is not None and self.output[self.open]["type"] == "message"
        events: list[str] = [] if is_message else self.open_message()
        self.text.append(delta)
        where = self._in_text()
        events.append(self.event("response.output_text.delta", **where, delta=delta, logprobs=[]))
        return events

    def _in_text(self) -> dict[str, Any]:
        """Where the open message's text is (its only part)."""
        return {"item_id": self.output[-1]["id"], "output_index": self.open, "content_index": 0}

    def add_call(self, delta: dict[str, Any]) -> list[str]:
        function = delta.get("function") or {}
        events: list[str] = []
        if "id" in delta:  # a call's first delta: a new item
            item = _call_item(delta["id"], function.get("name", ""), "", "in_progress")
            events += self.close("completed") + self._add(item)
            self.calls[delta.get("index", 0)] = len(self.output) - 1
        index = self.calls.get(delta.get("index", 0))
        arguments = function.get("arguments") or ""
        if index is not None and arguments:
            item = self.output[index]
            item["arguments"] += arguments
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=arguments,
                )
            )
        return events

    def close(self, status: str) -> list[str]:
        """The open item's done events (``status``: its own)."""
        index, self.open = self.open, None
        if index is None:
            return []
        item = self.output[index]
        item["status"] = status
        where: dict[str, Any] = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            text, self.text = "".join(self.text), []
            part = _text_part(text)
            item["content"] = [part]
            events = [
                self.event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=[]
                ),
                self.event("response.content_part.done", **where, content_index=0, part=part),
            ]
        else:
            arguments = item["arguments"]
            done = "response.function_call_arguments.done"
            events = [self.event(done, **where, name=item["name"], arguments=arguments)]
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events
