"""Multi-LoRA serving: keep PEFT adapters in an LRU and add their deltas into the fused
projections of one mixed batch (some requests on adapter A, some on B, some on none).

Three tiers, as in vLLM: the adapter directory on disk -> a CPU cache of ``max_cpu_loras``
adapters -> ``max_loras`` device "slots". Both caches are LRU; an adapter the current batch uses
is never evicted. A step's ``LoRABatch`` holds references to its adapters' device tensors, so a
slot evicted by a later ``prepare`` never pulls weights from under a step still in flight.
Loading and the weight layout: ``actors.lora_loader``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from actors.lora_loader import AdapterWeights, adapter_nbytes, load_adapter
from actors.model.config import ModelConfig
from scheduler.config import LoRAConfig
from scheduler.outputs import ADAPTER_UNREADABLE
from scheduler.request import LoRARequest

logger = logging.getLogger(__name__)


Rows = slice | torch.Tensor  # one contiguous run of tokens, or their indices


class LoRABatch:
    """One step's view of the adapters: which token rows use which adapter. Built by
    ``LoRAManager.prepare``; valid for the batch it was built for (checked by token count)."""

    def __init__(self, entries: list[tuple[AdapterWeights, Rows]], num_tokens: int) -> None:
        self.entries = entries
        self.num_tokens = num_tokens

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add every adapter's delta for ``module`` of ``layer`` into ``out`` [T, out] in place;
        ``x`` [T, in] is the projection's input."""
        if x.shape[0] != self.num_tokens:
            raise RuntimeError(
                f"LoRA batch prepared for {self.num_tokens} tokens, got {x.shape[0]}"
            )
        for weights, rows in self.entries:
            fused = weights.get((layer, module))
            if fused is None:
                continue
            if isinstance(rows, slice):  # views only: no gather, addmm_ writes in place
                h = x[rows] @ fused.a.t()
                dst = out[rows]
                for p in fused.parts:
                    dst[:, p.cols].addmm_(h[:, p.ranks], p.bt)
            else:
                h = x.index_select(0, rows) @ fused.a.t()
                for p in fused.parts:
                    out[:, p.cols].index_add_(0, rows, h[:, p.ranks] @ p.bt)


class LoRAManager:
    """Worker-side adapter store. Mutates its two LRU caches in ``add_lora``, ``remove_lora``
    and ``prepare``; the ``LoRABatch`` that ``prepare`` returns stays usable afterwards."""

    def __init__(
        self,
        model_config: ModelConfig,
        lora_config: LoRAConfig,
        device: torch.device,
        dtype: torch.dtype,
        layers: range | None = None,
    ) -> None:
        """``layers``: the model layers this worker holds (a pipeline stage's): an adapter's
        other layers are not kept (every stage would hold the whole adapter)."""
        self.model_config = model_config
        self.layers = range(model_config.num_hidden_layers) if layers is None else layers
        self.max_loras = lora_config.max_loras
        self.max_cpu_loras = lora_config.max_cpu_loras or lora_config.max_loras
        self.max_rank = lora_config.max_lora_rank
        self.device, self.dtype = torch.device(device), dtype
        self._cpu: OrderedDict[int, AdapterWeights] = OrderedDict()  # least recent first
        self._slots: OrderedDict[int, AdapterWeights] = OrderedDict()  # device copies

    def add_lora(self, lora: LoRARequest) -> bool:
        """Load ``lora`` into the CPU cache (evicting the least recently used one when full).
        False if it was already there (it becomes the most recently used)."""
        return self._load(lora, protect=set())

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from both caches; False if it was not loaded."""
        self._slots.pop(lora_int_id, None)
        return self._cpu.pop(lora_int_id, None) is not None

    def list_loras(self) -> set[int]:
        """Ids of the adapters in the CPU cache."""
        return set(self._cpu)

    def active_loras(self) -> set[int]:
        """Ids of the adapters holding a device slot."""
        return set(self._slots)

    def unreadable(self, loras: Iterable[LoRARequest]) -> dict[int, str]:
        """Bring the adapters one batch needs into the CPU cache (evicting none of them), and
        name those that cannot be read, by id, with the error their requests end with. An
        adapter evicted since it was first loaded is read again from its path; if its files
        were removed or damaged meanwhile (or the node never had them), only its requests
        fail -- that error stopped the whole instance. The message names the adapter, not
        its path (it goes to clients); the cause is logged."""
        wanted = {lora.lora_int_id: lora for lora in loras}
        if len(wanted) > self.max_loras:
            return {}  # a scheduler bug: ``prepare`` refuses the batch with its own error
        protect = set(wanted)
        bad: dict[int, str] = {}
        for lora_id, lora in wanted.items():
            try:
                self._load(lora, protect)
            except Exception as exc:  # missing files, a damaged header, a changed config...
                logger.error(
                    "LoRA adapter %r (id %d) could not be read from %s: %s",
                    lora.lora_name,
                    lora_id,
                    lora.lora_path,
                    exc,
                )
                bad[lora_id] = (
                    f"{ADAPTER_UNREADABLE}{lora.lora_name}` could not be loaded on this "
                    f"instance ({type(exc).__name__}; its files may have been removed or "
                    "changed since it was loaded)"
                )
        return bad

    def prepare(self, segments: Sequence[tuple[LoRARequest | None, int]]) -> LoRABatch | None:
        """``segments``: per request in batch order, (its adapter or None, its tokens this step).
        Loads and activates the batch's adapters; None when no token uses one."""
        runs: dict[int, list[list[int]]] = {}  # lora_int_id -> [start, end) token runs
        requests: dict[int, LoRARequest] = {}
        start = 0
        for lora, n in segments:
            if lora is not None and n > 0:
                spans = runs.setdefault(lora.lora_int_id, [])
                if spans and spans[-1][1] == start:
                    spans[-1][1] += n  # adjacent requests on one adapter: one run
                else:
                    spans.append([start, start + n])
                requests.setdefault(lora.lora_int_id, lora)
            start += n
        if not runs:
            return None
        if len(runs) > self.max_loras:
            raise RuntimeError(
                f"{len(runs)} distinct LoRA adapters in one batch ({sorted(runs)}) but "
                f"max_loras={self.max_loras}: the scheduler must not schedule more"
            )
        protect = set(runs)
        entries: list[tuple[AdapterWeights, Rows]] = []
        for lora_id, spans in runs.items():
            weights = self._activate(requests[lora_id], protect)
            rows: Rows
            if len(spans) == 1:
                rows = slice(spans[0][0], spans[0][1])
            else:
                rows = torch.cat([torch.arange(s, e) for s, e in spans]).to(self.device)
            entries.append((weights, rows))
        return LoRABatch(entries, start)

    # -- internals ------------------------------------------------------------------------------
    def _load(self, lora: LoRARequest, protect: set[int]) -> bool:
        lora_id = lora.lora_int_id
        if lora_id in self._cpu:
            self._cpu.move_to_end(lora_id)
            return False
        path = Path(lora.lora_path).expanduser()
        # Load before evicting: a bad adapter leaves the cache as it was.
        weights = load_adapter(path, self.model_config, self.max_rank, self.dtype)
        weights = {k: w for k, w in weights.items() if k[0] in self.layers}
        while len(self._cpu) >= self.max_cpu_loras:
            victim = self._lru_victim(self._cpu, protect, "max_cpu_loras")
            self.remove_lora(victim)
            logger.info("LoRA %d evicted from the CPU cache", victim)
        self._cpu[lora_id] = weights
        logger.info(
            "loaded LoRA %r (id %d) from %s: %d projections, %.2f MiB",
            lora.lora_name,
            lora_id,
            path,
            len(weights),
            adapter_nbytes(weights) / 2**20,
        )
        return True

    def _activate(self, lora: LoRARequest, protect: set[int]) -> AdapterWeights:
        """The adapter's device weights, loading and taking a slot as needed."""
        lora_id = lora.lora_int_id
        self._load(lora, protect)
        if lora_id in self._slots:
            self._slots.move_to_end(lora_id)
            return self._slots[lora_id]
        while len(self._slots) >= self.max_loras:
            del self._slots[self._lru_victim(self._slots, protect, "max_loras")]
        cpu = self._cpu[lora_id]
        # On a CPU device .to() returns the same tensors: the slot costs no copy.
        self._slots[lora_id] = {k: f.to(self.device) for k, f in cpu.items()}
        return self._slots[lora_id]

    @staticmethod
    def _lru_victim(cache: OrderedDict[int, AdapterWeights], protect: set[int], what: str) -> int:
        for lora_id in cache:
            if lora_id not in protect:
                return lora_id
        raise RuntimeError(f"every cached LoRA adapter is in this batch; {what} is too small")
