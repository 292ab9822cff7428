"""The request parts agents use, shared by the OpenAI request models
(``cluster.serving.openai_protocol``): structured-output specs in each field that asks for
them (OpenAI's ``response_format``, vLLM's ``structured_outputs`` and ``guided_*``), and the
tool definitions, choices and calls of chat requests."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class FieldError(ValueError):
    """A request field's value the API refuses (a 400 naming ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def given_spec(key: str, value: Any) -> dict[str, Any] | None:
    """A guided_* field as a spec (given empty, it is still asked for: the spec's checks
    refuse an empty choice; an empty schema allows any JSON)."""
    return None if value is None else {key: value}


def response_format_spec(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's ``response_format`` as a structured-outputs spec (None: free text)."""
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise FieldError("response_format", "response_format: json_schema must be an object")
        schema = spec.get("schema", {"type": "object"})  # no schema: any JSON object
        if not isinstance(schema, dict | bool):
            raise FieldError(
                "response_format", "response_format: json_schema.schema must be a JSON schema"
            )
        return {"json": schema}  # strict or not: the schema is always enforced
    raise FieldError(
        "response_format",
        f"response_format: type {kind!r} is not supported (text, json_object, json_schema)",
    )


# vLLM's ``structured_outputs`` keys that need nothing here: the fallback and whitespace
# choices describe what Tandem always does (one backend, no fallback; compact JSON).
_STRUCTURED_NO_EFFECT = ("disable_fallback", "disable_any_whitespace")
_STRUCTURED_SPEC_KEYS = ("json", "json_object", "regex", "choice", "grammar")


def structured_outputs_spec(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's ``structured_outputs`` object as a spec; keys that would change the output and
    are not implemented are refused by name."""
    if not value:
        return None
    spec = {}
    for key, item in value.items():
        if key in _STRUCTURED_SPEC_KEYS:
            if item is not None and item is not False:
                spec[key] = item
        elif key in _STRUCTURED_NO_EFFECT or item in (None, False, ""):
            continue
        else:
            raise FieldError("structured_outputs", f"structured_outputs.{key} is not supported")
    return spec or None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (none: no arguments)
    strict: bool | None = None  # enforced or not: forced calls always match the schema

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("parameters must be a JSON schema of an object (arguments by name)")
        return value


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


# A UTF-16 surrogate in a Python string: JSON lets a body escape one alone ("\\ud800"), but it
# is no Unicode text -- UTF-8 cannot encode it, so the tokenizer, the grammar compiler and the
# response's own encoder would all fail on it (a 500 where the client sent bad text).
SURROGATE = re.compile("[\ud800-\udfff]")


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str  # JSON text, as the API returned it


class ToolCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction
