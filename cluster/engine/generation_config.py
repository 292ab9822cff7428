"""Sampling defaults from the model's ``generation_config.json`` (vLLM's
``--generation-config``): what a request leaves unset is what the model's authors tuned it for
(Llama-3-Instruct: temperature 0.6, top_p 0.9), not temperature 1 -- the same sampling a vLLM
user gets for the same request. The API reads them per request field (``cluster.serving``),
the in-process ``LLM`` as its default ``SamplingParams`` (vLLM's
``LLM.get_default_sampling_params``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from scheduler import SamplingParams

logger = logging.getLogger(__name__)

# The keys of generation_config.json vLLM reads for --generation-config auto, and the request
# field each is the default of.
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(setting: str, model_path: str | Path | None) -> dict[str, Any]:
    """The defaults by request field: ``setting`` ``auto`` reads the model's own file (in its
    folder, or beside a GGUF file), ``vllm`` none, anything else is a folder holding one.
    {} where there is no file. A file that cannot be read is an error naming it (the
    caller names the setting)."""
    if setting == "vllm" or (setting == "auto" and model_path is None):
        return {}
    folder = Path(model_path if setting == "auto" else setting)  # type: ignore[arg-type]
    if folder.is_file():  # a GGUF file: its folder
        folder = folder.parent
    path = folder / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise FileNotFoundError(f"no {path}")
        return {}
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} cannot be read: {exc}") from None
    defaults = {}
    for key, field in KEYS.items():
        value = found.get(key)
        if value is None:
            continue
        try:  # the scheduler's own bounds: a value it would refuse fails no request
            SamplingParams.model_validate({field: value})
        except ValidationError as exc:
            logger.warning("%s: %s %r ignored: %s", path, key, value, exc.errors()[0]["msg"])
            continue
        defaults[field] = value
    if defaults:
        logger.info("sampling defaults from %s: %s", path, defaults)
    return defaults
