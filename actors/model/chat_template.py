"""Render Hugging Face-style Jinja chat templates safely (sandboxed, no file or attribute access).

Mirrors the environment transformers gives templates: ``trim_blocks``/``lstrip_blocks``, the
``loopcontrols`` extension, a ``raise_exception`` global, ``strftime_now`` and a ``tojson`` that
does not HTML-escape (Jinja's built-in one does).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """Compile once per distinct template string (compiling costs ~ms, rendering ~µs)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **kwargs: Any,
) -> str:
    """Render ``messages`` with ``template``; extra ``kwargs`` (``tools``, ...) reach the template.

    Raises ValueError naming the problem for a syntax error, a ``raise_exception(...)`` call in
    the template (e.g. "roles must alternate") or a sandbox violation.
    """
    try:
        compiled = _compile(template)
        return compiled.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            **kwargs,
        )
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"invalid chat template (line {e.lineno}): {e.message}") from e
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from e
