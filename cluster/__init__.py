"""The control plane, by concern (docs/architecture.md)::

    tools/          the `tandem` CLI and the load generator
    serving/        the Ray Serve app: OpenAI-compatible HTTP, gRPC, auth, API errors
    control/        the SchedulerActor, one EngineLoop per instance, Router, placement,
                    recovery, LoRA adapters, launch, ClusterClient
    engine/         the in-process engine (LLM, LLMEngine, AsyncLLM), input / output
                    processing, and the EngineClient contract between serving and any engine
    observability/  Prometheus metrics, request traces, the API span
    config/         ClusterConfig;  errors.py  errors raised to callers

Each floor imports only the floors below it. Importing this package loads nothing heavy:
``LLM``, ``LLMEngine`` and the output types are resolved on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cluster.engine.llm import LLM
    from cluster.engine.llm_engine import LLMEngine
    from cluster.engine.outputs import CompletionOutput, RequestOutput
    from scheduler import LoRARequest, SamplingParams

_EXPORTS = {
    "LLM": "cluster.engine.llm",
    "LLMEngine": "cluster.engine.llm_engine",
    "CompletionOutput": "cluster.engine.outputs",
    "RequestOutput": "cluster.engine.outputs",
    "LoRARequest": "scheduler",
    "SamplingParams": "scheduler",
}

__all__ = ["LLM", "CompletionOutput", "LLMEngine", "LoRARequest", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cluster' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
