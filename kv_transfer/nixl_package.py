"""Where NVIDIA NIXL's Python package is, found without importing it or torch: the central
scheduler asks (``transport: auto``) in a process that never loads a model."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

# The PyPI wheels: ``nixl-cu12`` imports as ``nixl_cu12``; other builds as ``nixl``.
MODULES = ("nixl_cu12", "nixl")
MISSING = (
    "the nixl KV transport needs NVIDIA NIXL: install the extra, "
    "`pip install 'tandem-serve[nixl]'` (the nixl-cu12 wheel; install torch first)"
)


def nixl_available() -> bool:
    """Whether a NIXL package is installed (without importing it)."""
    return any(importlib.util.find_spec(name) is not None for name in MODULES)


def nixl_api() -> Any:
    """NIXL's ``_api`` module; ImportError naming the extra without one."""
    for name in MODULES:
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError:
            continue
    raise ImportError(MISSING)
