"""``tandem sim calibrate``: fit this machine's CPU cost model from timed steps of Tandem's own
engine -- a ``ModelWorker`` with the model, stepped by the real ``Scheduler`` -- over prefills
of several lengths, decode batches of several sizes and contexts, and batches of prompts of
two lengths (steps that mix a prefill with decodes come from chunked batches).

Each step's shape comes from the same ``ShapeTracker`` the simulated worker uses, so the fit
prices exactly what the simulator will ask it to. A step as the serving loop sees it also pays
the hop to the worker process and back (a Ray call); ``step_overhead_s`` adds that (measured by
``tandem sim calibrate --measure-overhead`` as the round trip of an empty actor call carrying a
step's metadata, or given).

Needs torch (the engine runs); the simulator that uses the result does not.
"""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path
from typing import Any

from cluster.sim.cost import LinearCostModel, StepShape
from cluster.sim.executor import ShapeTracker


class UnusableModel(ValueError):
    """The model to calibrate on could not be loaded (not a GGUF file, an architecture the
    engine does not serve): a usage error, where any other error of a calibration is a bug."""


HANDOFF_LATENCY_S = 0.5e-3
HANDOFF_BYTES_PER_S = 10e9

# Each scenario runs its requests to the end: prefills of one prompt, decode batches of
# (batch size, context), and batches of prompts of two lengths.
PREFILLS = [16, 32, 64, 128, 256, 384, 512, 768, 1024]
DECODES = [
    (1, 64),
    (1, 512),
    (2, 256),
    (4, 128),
    (4, 512),
    (8, 64),
    (8, 384),
    (16, 128),
    (16, 256),
    (32, 64),
    (32, 192),
]
MIXED = [(4, 256, 128), (8, 128, 256), (16, 64, 512)]  # (requests, their prompt, a longer one)


def _scheduler(block_size: int, num_blocks: int, max_num_batched_tokens: int) -> Any:
    from scheduler import CacheConfig, Scheduler, SchedulerConfig

    return Scheduler(
        SchedulerConfig(
            max_num_seqs=64,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=4096,
            enable_chunked_prefill=True,
        ),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=False),
    )


def measure_steps(
    model: str | None = None,
    num_threads: int = 1,
    block_size: int = 16,
    repeats: int = 2,
    max_num_batched_tokens: int = 2048,
    quantization: str = "auto",
) -> tuple[list[tuple[StepShape, float]], dict[str, Any]]:
    """Time the engine's steps over the calibration scenarios (after a warm-up); returns
    (shape, seconds) per step and what the model is (its KV bytes per token, the weights'
    form: ``quantization`` as a pool would run it)."""
    from actors.worker import ModelWorker
    from scheduler import Request, SamplingParams

    try:  # (a model it cannot find or load: the caller's, not a bug of the measurement)
        worker = ModelWorker(
            model,
            block_size=block_size,
            num_threads=num_threads,
            progress=False,
            quantization=quantization,
        )
        worker.load_model()
    except (ValueError, OSError) as exc:
        raise UnusableModel(str(exc)) from exc
    num_blocks = 2048
    worker.init_kv_cache(num_blocks)
    info = worker.info()
    vocab = min(1000, int(info["vocab_size"]))  # prompt token ids below this
    rng = random.Random(0)
    ids = itertools.count()
    samples: list[tuple[StepShape, float]] = []
    groups: list[str] = []  # each sample's scenario (the repeats of one share it)

    def run(prompts: list[int], outputs: list[int], record: bool = True) -> None:
        group = f"{sorted(prompts)}->{sorted(outputs)}"
        scheduler = _scheduler(block_size, num_blocks, max_num_batched_tokens)
        tracker = ShapeTracker()
        for prompt_len, out_len in zip(prompts, outputs, strict=True):
            params = SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0.0)
            prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
            scheduler.add_request(Request(f"cal-{next(ids)}", prompt, params))
        while scheduler.has_requests():
            out = scheduler.schedule()
            shape, _ = tracker.observe(out)
            start = time.perf_counter()
            result = worker.execute_model(out)
            seconds = time.perf_counter() - start
            scheduler.update_from_output(out, result)
            if record and shape.tokens:
                samples.append((shape, seconds))
                groups.append(group)

    run([64] * 4, [8] * 4, record=False)  # warm-up
    fits = int(info["max_context_len"])  # scenarios past it are left out
    for _ in range(repeats):
        for n in PREFILLS:
            if n <= fits:  # (its one output token is sampled, never computed)
                run([n], [1])
        for batch, context in DECODES:
            if context + 12 <= fits:
                run([context] * batch, [12] * batch)
        for decodes, context, prefill in MIXED:
            # A batch of short prompts and a longer one, then their decodes.
            if max(context + 16, prefill + 4) <= fits:
                run([context] * decodes + [prefill], [16] * decodes + [4])
    kv_bytes_token = int(info["bytes_per_block"]) // block_size
    return samples, {
        # What an instance of a pool with no KV size set gets (the worker's default).
        "capacity_tokens": worker.size_kv_cache() * block_size,
        "model": Path(info["model_path"]).name,
        "num_threads": num_threads,
        "quantization": quantization,
        "weights": weights_held(worker),
        # Steps under this many tokens multiply the quantized weights (none: dense only).
        "small_rows": 0 if weights_held(worker) == "dense" else projections_dense_min_rows(worker),
        "kv_bytes_per_token": kv_bytes_token,
        "num_layers": info["num_layers"],
        "groups": groups,  # (calibrate pops it: for the held-out errors, not the notes)
    }


def projections_dense_min_rows(worker: Any) -> int:
    """The step size from which the quantized projections run on their dense copy (the
    largest of them: each weight's own when the engine's setting is per kernel)."""
    rows = [lin.dense_min_rows for _, lin in worker.model.projections() if lin.quant is not None]
    return max(rows, default=0)


def weights_held(worker: Any) -> str:
    """The form the worker's projections are held in: ``dense``, or the methods used
    (``int4+int8``: a GGUF's Q4 projections and Q8 ones)."""
    methods = sorted(set(worker.model.quantization.values()))
    return "+".join(methods) or "dense"


def measure_overhead(calls: int = 200) -> float:
    """Seconds of a Ray actor call's round trip on this machine, the hop every served step
    takes to its worker (median of ``calls``), on a local Ray started (and stopped) here."""
    import ray

    from cluster.control.launch import init_ray

    started = not ray.is_initialized()
    if started:
        init_ray()
    try:

        @ray.remote(num_cpus=0)
        class Echo:
            def step(self, payload: Any) -> Any:
                return payload

        echo = Echo.remote()  # type: ignore[attr-defined]
        payload = {"ids": list(range(64)), "tokens": [[7]] * 64}
        ray.get(echo.step.remote(payload))
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            ray.get(echo.step.remote(payload))
            times.append(time.perf_counter() - start)
        times.sort()
        return times[len(times) // 2]
    finally:
        if started:
            ray.shutdown()


def calibrate(
    model: str | None = None,
    num_threads: int = 1,
    block_size: int = 16,
    step_overhead_s: float = 0.0,
    repeats: int = 2,
    quantization: str = "auto",
) -> LinearCostModel:
    """Fit a ``LinearCostModel`` of this machine's engine steps; named after the model, the
    threads and the form the weights were held in (a step on int4 weights costs about half
    of a dense one here, so a fit holds for one form only)."""
    samples, about = measure_steps(
        model, num_threads, block_size, repeats, quantization=quantization
    )
    fitted = LinearCostModel.fit(
        f"cpu:{about['model']}:threads={num_threads}:{about['weights']}",
        samples,
        kv_bytes_token=about["kv_bytes_per_token"],
        groups=about.pop("groups"),
        capacity_tokens=about.pop("capacity_tokens"),
        small_rows=about.pop("small_rows"),
        # A hand-off on one node with nixl (docs/kv_transport.md: 1.5 ms for 512 tokens of
        # the built-in model, 11.8 MB).
        transfer_latency_s=HANDOFF_LATENCY_S,
        transfer_bytes_per_s=HANDOFF_BYTES_PER_S,
    )
    fitted.coefficients["const"] = fitted.coefficients.get("const", 0.0) + step_overhead_s
    fitted.idle_step_s = step_overhead_s  # the loop's own work, also on a step of nothing
    fitted.notes.update(about)
    fitted.notes["step_overhead_s"] = step_overhead_s
    return fitted
