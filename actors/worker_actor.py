"""The model worker's Ray actor class, importable without torch.

Ray loads an actor's class in every process that unpickles a handle to the actor (it reads
the class's methods). With ``ModelWorker`` itself as the class, each process that only holds
workers' handles imported torch and the model code for them: every engine actor, and the
central scheduler when it comes back from a restart (the handles arrive in the engines'
snapshots) -- about a second of CPU and a few hundred MB each. ``WorkerActor`` builds the
``ModelWorker`` in its constructor, in the worker's own process, and forwards each of
``REMOTE_METHODS`` to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Every public method of ``ModelWorker`` (tests/actors/test_worker.py checks the list).
REMOTE_METHODS = (
    "activation_bytes",
    "add_kv_peers",
    "add_lora",
    "bytes_per_block",
    "execute_model",
    "health",
    "info",
    "init_kv_cache",
    "kv_peer",
    "kv_probe",
    "list_loras",
    "load_model",
    "profile_num_blocks",
    "remove_kv_peers",
    "remove_lora",
    "set_fault_injection",
    "shutdown",
    "size_kv_cache",
    "transfer_history",
    "use_kv_transport",
    "weight_bytes",
)


class WorkerActor:
    """A ``ModelWorker`` (built with the same arguments) behind ``REMOTE_METHODS``."""

    def __init__(self, **kwargs: Any) -> None:
        from actors.worker import ModelWorker

        self.worker = ModelWorker(**kwargs)


def _forward(name: str) -> Callable[..., Any]:
    def method(self: WorkerActor, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.worker, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    return method


for _name in REMOTE_METHODS:
    setattr(WorkerActor, _name, _forward(_name))
