"""The pools of a ``ClusterConfig``: ``InstancePool`` (identical instances with one role) and
its ``AutoscalingConfig``."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, model_validator

from cluster.config.base import _Config
from scheduler import CacheConfig, SchedulerConfig

DEVICE_PATTERN = r"^(cpu|cuda(:[0-9]+)?)$"  # a worker's torch device

Role = Literal["prefill", "decode", "both"]


class AutoscalingConfig(_Config):
    """A pool that follows the load (``control/autoscaler.py``). Ray Serve's names where they
    fit: the pool keeps between ``min_replicas`` and ``max_replicas`` instances, aiming at
    ``target_ongoing_requests`` per instance; a need to grow must last ``upscale_delay_s``
    and one to shrink ``downscale_delay_s``. With SLO targets set, the pool also grows when
    they break -- a prefill (or colocated) pool on TTFT, a decode pool on TPOT or KV usage --
    and shrinks only when they hold with room to spare (hysteresis)."""

    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(1, ge=1, le=1024)
    target_ongoing_requests: float = Field(
        32.0, gt=0, description="Requests held per instance (queued and running) to aim at."
    )
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    slo_ttft_ms: float | None = Field(
        None,
        gt=0,
        description="TTFT target (p90) of the first tokens a pool samples: it grows past it.",
    )
    slo_tpot_ms: float | None = Field(
        None, gt=0, description="TPOT target (p90): a decode or colocated pool grows past it."
    )
    max_kv_usage: float = Field(
        0.9, gt=0, le=1, description="KV cache usage at which a decode-capable pool grows."
    )
    window_s: float = Field(15.0, gt=0, description="How far back latencies are counted.")
    interval_s: float = Field(1.0, gt=0, description="How often the autoscaler decides.")

    @model_validator(mode="after")
    def _check(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"autoscaling: min_replicas ({self.min_replicas}) > max_replicas "
                f"({self.max_replicas})"
            )
        return self


class InstancePool(_Config):
    """``replicas`` identical instances with one role, placed by node resources."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    role: Role = "both"
    replicas: int = Field(1, ge=1, le=1024)
    pp_size: int = Field(
        1, ge=1, le=64, description="Pipeline stages per instance (one worker actor each)."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources each worker (each stage) needs, e.g. {'prefill': 0.01}.",
    )
    stage_resources: list[dict[str, float]] | None = Field(
        None,
        description="Per pipeline stage, resources added to `resources` (e.g. to put the "
        "stages of one instance on different nodes); one entry per stage.",
    )
    num_cpus: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    max_restarts: int = Field(
        0,
        ge=0,
        le=1000,
        description="Ray restarts a dead worker this many times; the instance then rejoins "
        "routing with an empty cache.",
    )
    num_gpus: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    num_threads: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] | None = Field(
        None,
        description="torch threads per worker (Ray's default is 1); auto: the machine's cores, "
        "shared step by step with the other auto workers on it (an even share among the busy "
        "ones; steps under 64 tokens run on one thread).",
    )
    device: str = Field(
        "cpu",
        pattern=DEVICE_PATTERN,
        description="torch device of the workers: cpu or cuda (cuda:N for one GPU).",
    )
    num_blocks: int | None = Field(None, ge=1, description="KV blocks; else sized by memory.")
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    memory_budget_bytes: int | None = Field(
        None, ge=1, description="Weights + activations + KV cache; the worker profiles."
    )
    scheduler: dict[str, Any] = Field(
        default_factory=dict, description="SchedulerConfig fields for this pool."
    )
    cache: dict[str, Any] = Field(
        default_factory=dict, description="CacheConfig fields (num_blocks comes from above)."
    )
    autoscaling: AutoscalingConfig | None = Field(
        None, description="Follow the load between min and max replicas (off by default)."
    )

    @model_validator(mode="after")
    def _check(self) -> InstancePool:
        sizes = [self.num_blocks, self.kv_cache_memory_bytes, self.memory_budget_bytes]
        if sum(s is not None for s in sizes) > 1:
            raise ValueError(
                f"pool {self.name!r}: set at most one of num_blocks, kv_cache_memory_bytes, "
                "memory_budget_bytes"
            )
        if "num_blocks" in self.cache:
            raise ValueError(f"pool {self.name!r}: set num_blocks on the pool, not in cache")
        if self.stage_resources is not None and len(self.stage_resources) != self.pp_size:
            raise ValueError(
                f"pool {self.name!r}: stage_resources has {len(self.stage_resources)} entries; "
                f"it needs one per pipeline stage (pp_size {self.pp_size})"
            )
        if self.pp_size > 1 and self.scheduler.get("async_scheduling"):
            raise ValueError(
                f"pool {self.name!r}: async_scheduling needs pp_size 1 (the first stage would "
                "need samples the last stage has not returned); pipeline stages already keep "
                "pp_size batches in flight"
            )
        if "max_model_len" in self.scheduler:
            raise ValueError(
                f"pool {self.name!r}: max_model_len is cluster-wide (a request may move between "
                "pools); set it at the top level"
            )
        if "block_size" in self.cache:
            raise ValueError(
                f"pool {self.name!r}: block_size is cluster-wide (KV moves between pools); "
                "set it at the top level"
            )
        if "kv_load_failure_policy" in self.scheduler:
            raise ValueError(
                f"pool {self.name!r}: kv_load_failure_policy is cluster-wide; set "
                "kv_transfer.failure_policy"
            )
        for name in ("gpu_memory_utilization", "cache_dtype"):
            if name in self.cache:
                raise ValueError(
                    f"pool {self.name!r}: cache.{name} (vLLM's) is not supported: the KV cache "
                    "takes the model's dtype, and its size is set on the pool with num_blocks, "
                    "kv_cache_memory_bytes or memory_budget_bytes"
                )
        scaling = self.autoscaling
        if (
            scaling is not None
            and not scaling.min_replicas <= self.replicas <= scaling.max_replicas
        ):
            raise ValueError(
                f"pool {self.name!r}: replicas ({self.replicas}) must be within autoscaling's "
                f"min_replicas ({scaling.min_replicas}) and max_replicas ({scaling.max_replicas})"
            )
        # What Ray refuses only when the first worker is placed (a start that fails late).
        named = [("resources", self.resources)]
        named += [(f"stage_resources[{i}]", r) for i, r in enumerate(self.stage_resources or [])]
        named += [("", {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus})]
        for where, resources in named:
            for key, value in resources.items():
                field = f"{where}.{key}" if where else key
                if where and key in ("CPU", "GPU"):
                    raise ValueError(
                        f"pool {self.name!r}: {field}: set num_{key.lower()}s on the pool "
                        "(Ray takes CPUs and GPUs from there, not as custom resources)"
                    )
                if not (value == 0 or 1e-4 <= value < math.inf):  # (NaN too)
                    raise ValueError(
                        f"pool {self.name!r}: {field} is {value}: give 0, or 0.0001 or more "
                        "(Ray's finest fraction)"
                    )
        # Validate the nested configs now, so a bad knob fails at load time with its name.
        # The cluster's max_model_len is checked against them by ``ClusterConfig`` (here, a
        # length no knob can conflict with: the model's is known only once it is loaded).
        try:  # (as the scheduler's config reads it: "512" and 512.0 are 512)
            threshold = TypeAdapter(int).validate_python(
                self.scheduler.get("long_prefill_token_threshold", 0)
            )
        except ValidationError:
            threshold = 0  # refused just below, by name
        self.scheduler_config(max(2, threshold))
        CacheConfig(**self.cache)
        return self

    def resources_of_stage(self, pp_rank: int) -> dict[str, float]:
        """The resources stage ``pp_rank`` of an instance asks for."""
        extra = self.stage_resources[pp_rank] if self.stage_resources else {}
        merged = dict(self.resources)
        for key, value in extra.items():
            merged[key] = merged.get(key, 0.0) + value
        return merged

    def scheduler_config(self, max_model_len: int | None) -> SchedulerConfig:
        args = dict(self.scheduler)
        if max_model_len is not None:
            args.setdefault("max_model_len", max_model_len)
        try:
            return SchedulerConfig(**args)
        except ValueError as exc:
            raise ValueError(f"pool {self.name!r} scheduler: {exc}") from exc
