"""LoRA adapters served as model names (the API's ``/v1/models``, ``/v1/load_lora_adapter``):
the registry every ingress replica reads through the SchedulerActor, and which instance has
loaded which adapter (each loads one on first use; every pipeline stage applies it to its own
layers)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from cluster.config import ClusterConfig
from cluster.control.placement import InstanceSpec
from cluster.errors import AdapterLoadError
from scheduler import LoRARequest

logger = logging.getLogger(__name__)

# The registry as the engine actors keep it for a restarted central actor: the adapters by
# name, and the next id to give (ids are never given twice: a worker may still cache an
# unloaded adapter under its id, and would apply it to a new adapter given the same id).
Registry = tuple[dict[str, LoRARequest], int]

# A worker's errors for adapter files it cannot read on its node (another node may).
_UNREADABLE = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


class LoRAAdapters:
    """Adapters by name, and per instance the ids it has loaded. ``specs`` is the actor's own
    dict (filled at start). ``on_change`` is called after every load and unload (the actor
    hands the registry to its engine actors)."""

    def __init__(self, config: ClusterConfig, specs: dict[str, InstanceSpec]) -> None:
        self.enabled = config.lora is not None
        self.by_name: dict[str, LoRARequest] = {}
        self._next_id = 1
        self._loaded: dict[str, set[int]] = {}
        self._specs = specs
        self.on_change: Callable[[], None] | None = None
        for name, path in config.serve.lora_modules.items():
            self.by_name[name] = self._new(name, path)

    def _new(self, name: str, path: str) -> LoRARequest:
        lora_id, self._next_id = self._next_id, self._next_id + 1
        return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)

    def registry(self) -> Registry:
        return dict(self.by_name), self._next_id

    def restore(self, registries: list[Registry]) -> None:
        """A restarted central actor takes the registry its engines kept (the newest: the
        one with the highest next id)."""
        if registries:
            by_name, next_id = max(registries, key=lambda r: r[1])
            self.by_name = dict(by_name)
            self._next_id = max(self._next_id, next_id)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def reset(self, instance_id: str) -> None:
        """The instance starts (or restarted) with no adapter loaded."""
        self._loaded[instance_id] = set()

    def forget(self, instance_id: str) -> None:
        """The instance left the cluster (a pool shrank)."""
        self._loaded.pop(instance_id, None)

    def unreadable(self, instance_id: str, lora_int_id: int) -> None:
        """The instance's workers could not read the adapter again (its files went, or
        changed, after they evicted it): it no longer counts as loaded there. The next
        request for it loads it there first (``ensure``): the client's 404 naming it, or
        another instance -- not a step that fails it the same way, a 503 "retry", on this
        instance for as long as the cluster runs."""
        loaded = self._loaded.get(instance_id)
        if loaded is not None:
            loaded.discard(lora_int_id)

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
                self._changed()  # its id is spent (a stage may hold it)
                raise ValueError(f"lora_path {path!r} could not be loaded: {cause}") from None
        self.by_name[name] = lora
        self._changed()
        return lora

    @staticmethod
    def request_error(lora: LoRARequest, instance_id: str, exc: BaseException) -> BaseException:
        """What a request naming ``lora`` fails with when its instance could not load it
        (``ensure``): the adapter's files missing or unreadable on that node (a worker's
        ``FileNotFoundError``, ``PermissionError``...), or an adapter the model cannot take
        or a damaged one (``ValueError``), is the client's ``AdapterLoadError`` naming the
        adapter (404 / 400, as vLLM) -- it was a 500. Anything else (the worker died, a bug)
        stays what it is."""
        cause = getattr(exc, "cause", None) or exc  # a worker's error, without Ray's
        if isinstance(cause, _UNREADABLE):
            missing = True
        elif isinstance(cause, ValueError):
            missing = False
        else:
            return exc
        logger.warning(
            "LoRA adapter %r (%s) could not be loaded on instance %s: %s",
            lora.lora_name,
            lora.lora_path,
            instance_id,
            cause,
        )
        return AdapterLoadError(lora.lora_name, instance_id, missing)

    def unload(self, name: str) -> None:
        """Stop serving ``name`` (workers drop it from their cache as others come in)."""
        if self.by_name.pop(name, None) is None:
            raise KeyError(f"lora_name {name!r} is not loaded")
        self._next_id += 1  # a change: the newest registry has the highest next id (restore)
        self._changed()
