"""LoRA adapters served as model names (the API's ``/v1/models``, ``/v1/load_lora_adapter``):
the registry every ingress replica reads through the SchedulerActor, and which instance has
loaded which adapter (each loads one on first use; every pipeline stage applies it to its own
layers)."""

from __future__ import annotations

import itertools

from cluster.config import ClusterConfig
from cluster.control.placement import InstanceSpec
from scheduler import LoRARequest


class LoRAAdapters:
    """Adapters by name, and per instance the ids it has loaded. ``specs`` is the actor's own
    dict (filled at start)."""

    def __init__(self, config: ClusterConfig, specs: dict[str, InstanceSpec]) -> None:
        self.enabled = config.lora is not None
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._loaded: dict[str, set[int]] = {}
        self._specs = specs
        for name, path in config.serve.lora_modules.items():
            self.by_name[name] = self._new(name, path)

    def _new(self, name: str, path: str) -> LoRARequest:
        return LoRARequest(lora_name=name, lora_int_id=next(self._ids), lora_path=path)

    def reset(self, instance_id: str) -> None:
        """The instance starts (or restarted) with no adapter loaded."""
        self._loaded[instance_id] = set()

    def forget(self, instance_id: str) -> None:
        """The instance left the cluster (a pool shrank)."""
        self._loaded.pop(instance_id, None)

    async def ensure(self, instance_id: str, lora: LoRARequest) -> None:
        """Load ``lora`` on the instance's workers unless they have it."""
        loaded = self._loaded[instance_id]
        if lora.lora_int_id not in loaded:
            await self._specs[instance_id].call_stages("add_lora", lora)
            loaded.add(lora.lora_int_id)

    async def load(self, name: str, path: str, try_on: str | None) -> LoRARequest:
        """Serve the adapter at ``path`` as model ``name``. It is loaded on instance
        ``try_on`` first (a live one), so a bad path or an adapter the model cannot take is a
        ``ValueError`` here, not on a request. Other instances load it on first use."""
        if not self.enabled:
            raise ValueError("LoRA is not enabled on this cluster (no lora section)")
        if name in self.by_name:
            raise ValueError(f"lora_name {name!r} is already loaded")
        lora = self._new(name, path)
        if try_on is not None:
            try:
                await self.ensure(try_on, lora)
            except Exception as exc:
                cause = getattr(exc, "cause", None) or exc  # a worker's error, without Ray's
                raise ValueError(f"lora_path {path!r} could not be loaded: {cause}") from None
        self.by_name[name] = lora
        return lora

    def unload(self, name: str) -> None:
        """Stop serving ``name`` (workers drop it from their cache as others come in)."""
        if self.by_name.pop(name, None) is None:
            raise KeyError(f"lora_name {name!r} is not loaded")
