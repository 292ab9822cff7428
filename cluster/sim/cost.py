"""Cost models: how long a simulated step and a simulated KV transfer take.

A step is summarized by its ``StepShape`` (what the scheduler put in it); a cost model turns
it into seconds. Two kinds ship:

- ``LinearCostModel``: seconds as a linear function of the shape's terms, fitted by least
  squares from timed steps of Tandem's own engine on this machine (``tandem sim calibrate``,
  ``cluster/sim/calibrate.py``). The fitted CPU model of the built-in model ships as
  ``cluster/sim/models/cpu-smollm2.json``.
- ``RooflineCostModel``: a GPU from first principles -- a step takes the longer of its FLOPs
  at the chip's dense bf16 rate and its bytes (weights once per step, the KV read by
  attention, the KV written) at its HBM bandwidth, each at an achievable fraction, plus the
  tensor-parallel all-reduces and a fixed per-step overhead. Model shapes
  (``LLAMA_3_8B``, ``LLAMA_3_70B``) and chips (``H100_SXM``, ``A100_80GB``) from their public
  specs.

Both price a KV transfer as a latency plus bytes over a bandwidth.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class StepShape:
    """What one step computes."""

    prefill_tokens: int = 0  # prompt positions computed (chunks of prefills)
    prefill_pairs: float = 0.0  # their attention query-key pairs (each attends to all before)
    num_decodes: int = 0  # requests computing one position (decodes)
    decode_context: int = 0  # the decodes' context lengths, summed
    num_sampled: int = 0  # requests sampling a token (the LM head runs for these)
    lora_tokens: int = 0  # positions of requests with a LoRA adapter
    prefill_context: int = 0  # positions before the prefill chunks (cached or computed), summed

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.num_decodes


class CostModel(Protocol):
    name: str

    def step_time(self, shape: StepShape) -> float: ...

    def transfer_time(self, num_bytes: int) -> float: ...

    def kv_bytes_per_token(self) -> int: ...

    def kv_capacity_tokens(self) -> int | None:
        """How many tokens of KV fit in one instance (None: take the pool's ``num_blocks``)."""
        ...


TERMS = (
    "const",
    "prefill_tokens",
    "prefill_pairs",
    "num_decodes",
    "decode_context",
    "lora_tokens",
    "small_step_tokens",
    "large_step",
)


def _features(shape: StepShape, small_rows: int = 0) -> list[float]:
    """The terms' values for a step. ``small_rows`` (quantized weights): steps of fewer
    tokens multiply the quantized weights, whose cost grows steeply per row
    (``small_step_tokens``); larger ones a dense copy, whose weights cost more to read once
    (``large_step``) and little per row -- the rows from which the engine's projections run
    dense (``calibrate.projections_dense_min_rows``: 16 for int4 on Tandem's kernel, 8
    otherwise, unless ``quantized_dense_min_rows`` says), applied to the step's rows. (The
    output head switches on the rows it samples instead, so a long prefill runs its head
    quantized; that part is not told apart.)"""
    tokens = shape.tokens
    small = 0 < tokens < small_rows
    return [
        1.0,
        float(shape.prefill_tokens),
        float(shape.prefill_pairs),
        float(shape.num_decodes),
        float(shape.decode_context),
        float(shape.lora_tokens),
        float(tokens) if small else 0.0,
        1.0 if small_rows and tokens >= small_rows else 0.0,
    ]


def _least_squares(x: Any, y: Any) -> tuple[list[int], Any]:
    """``LinearCostModel.fit``'s solve: least squares of the relative error over the terms
    that are not all zero; a term (not ``const``) that fits negative is dropped and the rest
    refitted. Returns the terms used and their coefficients."""
    import numpy as np

    weight = 1.0 / np.maximum(y, 1e-9)
    used = [i for i in range(len(TERMS)) if x[:, i].any()]
    while True:
        coef, *_ = np.linalg.lstsq(x[:, used] * weight[:, None], y * weight, rcond=None)
        negative = [i for i, c in zip(used, coef, strict=True) if c < 0 and i != 0]
        if not negative:
            return used, coef
        used.remove(negative[0])


def _held_out_errors(x: Any, y: Any, groups: list[Any]) -> Any:
    """Relative errors of each group's samples under a fit of all the other groups (leave one
    group out; a group alone is not scored: nothing would be left to fit on)."""
    import numpy as np

    labels = np.array([str(g) for g in groups])
    errors: list[float] = []
    for label in dict.fromkeys(labels.tolist()):
        test = labels == label
        if test.all():
            continue
        used, coef = _least_squares(x[~test], y[~test])
        predicted = x[test][:, used] @ coef
        errors += (np.abs(predicted - y[test]) / np.maximum(y[test], 1e-9)).tolist()
    return np.array(errors)


@dataclass
class LinearCostModel:
    """seconds = Σ coefficient x term (``TERMS``); a KV transfer = ``transfer_latency_s`` +
    bytes / ``transfer_bytes_per_s``. A step that computes nothing (an instance going idle
    tells its workers which requests finished) costs ``idle_step_s``: the worker returns at
    once, so only the serving hop (``serving``) counts, not ``const``'s compute."""

    name: str
    coefficients: dict[str, float]
    kv_bytes_token: int
    transfer_latency_s: float = 0.001
    transfer_bytes_per_s: float = 1e9
    capacity_tokens: int | None = None
    # Instances sharing a machine's cores (a CPU model): how many cores a machine has, how
    # many instances run on one (as the model was measured: ``tandem serve``'s default puts
    # both of its instances on one machine), and how many cores the serving processes keep
    # busy there (``executor.Machine``). None: each instance has a device of its own.
    machine_cores: float | None = None
    instances_per_machine: int = 1
    background_cores: float = 0.0
    # A worker of ``num_threads: auto`` with a second core to itself steps this much faster
    # than the one-thread steps fitted (``executor.Machine.speed``).
    spare_core_speedup: float = 1.0
    # Quantized weights: steps under this many tokens run the weight-only kernels, the
    # others a dense copy (``_features``); 0 for dense weights.
    small_rows: int = 0
    idle_step_s: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)  # how it was fitted, and how well

    def step_time(self, shape: StepShape) -> float:
        if shape.tokens == 0:
            return self.idle_step_s
        c = self.coefficients
        features = _features(shape, self.small_rows)
        return sum(c.get(t, 0.0) * x for t, x in zip(TERMS, features, strict=True))

    def transfer_time(self, num_bytes: int) -> float:
        return self.transfer_latency_s + num_bytes / self.transfer_bytes_per_s

    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_token

    def kv_capacity_tokens(self) -> int | None:
        return self.capacity_tokens

    @classmethod
    def fit(
        cls,
        name: str,
        samples: list[tuple[StepShape, float]],
        kv_bytes_token: int,
        groups: list[Any] | None = None,
        **kw: Any,
    ) -> LinearCostModel:
        """Least squares of the relative error over ``samples`` (shape, measured seconds):
        a 10 ms decode step weighs as much as a 1 s prefill. No coefficient is negative: a
        term that would fit negative is dropped and the rest refitted. The notes' errors are
        in sample (the fit's own steps); ``groups`` (each sample's scenario) adds each
        scenario's error when it is left out of the fit (``held_out_*``): what the model does
        on steps it was not fitted to."""
        import numpy as np

        small_rows = int(kw.get("small_rows", 0))
        x = np.array([_features(s, small_rows) for s, _ in samples], dtype=np.float64)
        y = np.array([t for _, t in samples], dtype=np.float64)
        used, coef = _least_squares(x, y)
        coefficients = {TERMS[i]: float(c) for i, c in zip(used, coef, strict=True)}
        predicted = x[:, used] @ coef
        errors = np.abs(predicted - y) / np.maximum(y, 1e-9)
        notes = {
            "samples": len(samples),
            "median_relative_error": float(np.median(errors)),
            "p90_relative_error": float(np.quantile(errors, 0.9)),
        }
        held = _held_out_errors(x, y, groups) if groups is not None else []
        if len(held):
            notes["groups"] = len({str(g) for g in groups or ()})
            notes["held_out_median_relative_error"] = float(np.median(held))
            notes["held_out_p90_relative_error"] = float(np.quantile(held, 0.9))
        return cls(name, coefficients, kv_bytes_token, notes=notes, **kw)

    def serving(
        self,
        factor: float,
        overhead_s: float,
        prefill_factor: float | None = None,
        **notes: Any,
    ) -> LinearCostModel:
        """This model as a served instance's steps take: every term ``factor`` times slower
        -- the prefill terms ``prefill_factor`` times (default ``factor``) -- plus
        ``overhead_s`` per step (the hop to the worker and back, the loop's own work). The
        quantized weights' step terms (``small_step_tokens``, ``large_step``) count as decode
        terms, though prefills take ``large_step`` too."""
        prefill = factor if prefill_factor is None else prefill_factor
        coefficients = {
            k: v * (prefill if k.startswith("prefill") else factor)
            for k, v in self.coefficients.items()
        }
        coefficients["const"] = coefficients.get("const", 0.0) + overhead_s
        fitted = {
            "serving_factor": factor,
            "serving_prefill_factor": prefill,
            "serving_overhead_s": overhead_s,
            **notes,
        }
        return replace(
            self,
            name=f"{self.name}:served",
            coefficients=coefficients,
            idle_step_s=self.idle_step_s + overhead_s,
            notes={**self.notes, **fitted},
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"kind": "linear", **asdict(self)}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> LinearCostModel:
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.get("kind", "linear") != "linear":
            raise ValueError(f"{path}: not a fitted cost model (tandem sim calibrate --out)")
        data.pop("kind", None)
        try:
            return cls(**data)
        except TypeError as exc:  # a key it does not know, or one it needs missing
            raise ValueError(f"{path}: not a fitted cost model: {exc}") from None


# -- GPUs from first principles --------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """A Llama-architecture decoder (grouped-query attention, SwiGLU MLP), bf16."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    bytes_per_param: int = 2

    @property
    def layer_params(self) -> int:
        attention = self.hidden * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        attention += self.num_heads * self.head_dim * self.hidden  # the output projection
        return attention + 3 * self.hidden * self.intermediate

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_params + 2 * self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param


# Shapes from the models' published configs.
LLAMA_3_8B = ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256)
LLAMA_3_70B = ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256)


@dataclass(frozen=True)
class GPUSpec:
    """Public datasheet figures (dense bf16, no sparsity)."""

    name: str
    bf16_flops: float
    hbm_bytes_per_s: float
    hbm_bytes: float
    nvlink_bytes_per_s: float  # per direction, per GPU


H100_SXM = GPUSpec("h100-sxm", 989e12, 3.35e12, 80e9, 450e9)
A100_80GB = GPUSpec("a100-80gb", 312e12, 2.039e12, 80e9, 300e9)

MODELS = {m.name: m for m in (LLAMA_3_8B, LLAMA_3_70B)}
GPUS = {g.name: g for g in (H100_SXM, A100_80GB)}


@dataclass
class RooflineCostModel:
    """One instance of ``model`` on ``tp`` GPUs of ``gpu`` (tensor parallel).
    ``compute_efficiency`` and ``memory_efficiency``: the fractions of peak FLOPs and HBM
    bandwidth a serving engine reaches (about 0.5-0.6 and 0.7-0.85 are commonly reported for
    large GEMMs and decode on these chips); ``step_overhead_s``: the per-step host work
    (scheduling, launches) that CUDA graphs leave. KV transfers between instances go over
    ``transfer_bytes_per_s`` (default: one 400 Gb/s RDMA NIC per GPU at 80%)."""

    model: ModelShape
    gpu: GPUSpec
    tp: int = 1
    compute_efficiency: float = 0.55
    memory_efficiency: float = 0.8
    step_overhead_s: float = 0.002
    allreduce_latency_s: float = 10e-6
    memory_utilization: float = 0.9  # of HBM for weights + KV (vLLM's gpu_memory_utilization)
    transfer_latency_s: float = 200e-6
    transfer_bytes_per_s: float | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            self.name = f"{self.model.name}@{self.gpu.name}x{self.tp}"
        if self.transfer_bytes_per_s is None:
            self.transfer_bytes_per_s = 0.8 * 50e9 * self.tp

    def step_time(self, shape: StepShape) -> float:
        m, tp = self.model, self.tp
        tokens = shape.tokens
        if tokens == 0:
            return self.step_overhead_s
        pairs = shape.prefill_pairs + shape.decode_context
        flops = 2.0 * m.num_layers * m.layer_params * tokens
        flops += 4.0 * m.num_layers * m.num_heads * m.head_dim * pairs  # QK^T and PV
        flops += 2.0 * m.hidden * m.vocab * shape.num_sampled  # the LM head
        # The layers' weights, the LM head's when a row samples, and only the embedding rows
        # the step's tokens look up (not the whole table: 1 GB of Llama-3-8B's 16).
        read = m.num_layers * m.layer_params + (m.vocab if shape.num_sampled else 0) * m.hidden
        weights = (read + tokens * m.hidden) * m.bytes_per_param
        # Read (the decodes' context, and each prefill chunk's context before it: once per
        # chunk, not per query), and written (the step's tokens).
        kv = m.kv_bytes_per_token * (shape.decode_context + shape.prefill_context + tokens)
        compute_s = flops / (tp * self.gpu.bf16_flops * self.compute_efficiency)
        memory_s = (weights + kv) / (tp * self.gpu.hbm_bytes_per_s * self.memory_efficiency)
        comm_s = 0.0
        if tp > 1:  # two ring all-reduces of the activations per layer
            size = tokens * m.hidden * m.bytes_per_param
            ring = 2 * (tp - 1) / tp * size / self.gpu.nvlink_bytes_per_s
            comm_s = 2 * m.num_layers * (ring + 2 * (tp - 1) * self.allreduce_latency_s)
        return max(compute_s, memory_s) + comm_s + self.step_overhead_s

    def transfer_time(self, num_bytes: int) -> float:
        assert self.transfer_bytes_per_s is not None
        return self.transfer_latency_s + num_bytes / self.transfer_bytes_per_s

    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    def kv_capacity_tokens(self) -> int | None:
        m = self.model
        free = self.tp * self.gpu.hbm_bytes * self.memory_utilization
        free -= m.num_params * m.bytes_per_param
        if free <= 0:
            raise ValueError(f"{m.name} does not fit on {self.tp} x {self.gpu.name}")
        return int(free // m.kv_bytes_per_token)


def gpu_model(spec: str) -> RooflineCostModel:
    """``MODEL@GPU[xTP]``, e.g. ``llama-3-8b@h100-sxm`` or ``llama-3-70b@h100-sxmx4``."""
    found = re.fullmatch(r"(?P<model>[^@]+)@(?P<gpu>.+?)(?:x(?P<tp>[1-9]\d*))?", spec)
    if found is None or found["model"] not in MODELS or found["gpu"] not in GPUS:
        raise ValueError(
            f"unknown GPU cost model {spec!r}: MODEL@GPU[xTP] with MODEL in "
            f"{', '.join(MODELS)} and GPU in {', '.join(GPUS)}"
        )
    return RooflineCostModel(MODELS[found["model"]], GPUS[found["gpu"]], int(found["tp"] or 1))


def load_cost_model(spec: str) -> CostModel:
    """A cost model by name: a GPU spec (``gpu_model``); ``cpu``, the shipped model of the
    built-in model served on this machine (``tandem serve``'s instances: one torch thread, the
    serving path's cost included), or ``cpu-engine``, the engine's steps alone (``tandem sim
    calibrate``); or the path of a fitted model's JSON."""
    if spec in ("cpu", "cpu-engine"):
        name = "cpu-smollm2.json" if spec == "cpu" else "cpu-smollm2-engine.json"
        return LinearCostModel.load(Path(__file__).parent / "models" / name)
    if "@" in spec:
        return gpu_model(spec)
    return LinearCostModel.load(spec)
