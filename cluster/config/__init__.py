"""``ClusterConfig``: one file configures a whole deployment (DESIGN.md §5).

    model: null                       # the built-in SmolLM2; or a path
    pools:
      - {name: prefill, role: prefill, replicas: 1, resources: {prefill: 0.01}}
      - {name: decode,  role: decode,  replicas: 1, resources: {decode: 0.01},
         scheduler: {max_num_seqs: 64}}
    router: {disaggregation: 256}     # uncached prompt tokens below this stay on a decode
    kv_transfer: {transport: auto, timeout_s: 5, failure_policy: recompute}

Pydantic models with ``extra="forbid"``: a misspelt key is an error naming it. The cluster
layer (SchedulerActor, Router, workers) reads these; this module only validates.
"""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from cluster.config.base import _Config
from cluster.config.kv import NIXL_SAFETY_MARGIN_S, KVTransferConfig
from cluster.config.pools import AutoscalingConfig, InstancePool, Role
from cluster.config.serve import INGRESS_ONLY, ServeConfig
from kv_transfer.tracing import TracingConfig
from scheduler import LoRAConfig

__all__ = [
    "INGRESS_ONLY",
    "NIXL_SAFETY_MARGIN_S",
    "AutoscalingConfig",
    "ClusterConfig",
    "InstancePool",
    "KVTransferConfig",
    "MetricsConfig",
    "RouterConfig",
    "ServeConfig",
    "TracingConfig",
    "default_cluster_config",
    "served_model_name",
]


class RouterConfig(_Config):
    """How the Router picks instances and when a request is disaggregated."""

    policy: Literal["least_loaded"] = "least_loaded"
    prefix_affinity: bool = Field(True, description="Prefer the instance caching the prefix.")
    disaggregation: Literal["always", "never"] | int = Field(
        256,
        description="'always', 'never', or the uncached prompt length (tokens) from which a "
        "request goes through a prefill instance; shorter ones run on a decode instance.",
    )

    @field_validator("disaggregation", mode="before")
    @classmethod
    def _no_boolean(cls, value: Any) -> Any:
        # YAML reads off/on/no/yes/false/true as booleans, and a boolean would pass as the
        # threshold 0 or 1: "off" would disaggregate every request.
        if isinstance(value, bool):
            raise ValueError(
                f"router.disaggregation must be 'always', 'never' or a token count, not the "
                f"boolean {value} (YAML reads off/on/no/yes as booleans: write 'never' or "
                "'always', quoted)"
            )
        return value

    @model_validator(mode="after")
    def _check(self) -> RouterConfig:
        if isinstance(self.disaggregation, int) and self.disaggregation < 0:
            raise ValueError(f"router.disaggregation ({self.disaggregation}) must be >= 0")
        return self


class MetricsConfig(_Config):
    """Prometheus metrics (``/metrics``) and the SLOs that define goodput."""

    slo_ttft_ms: float | None = Field(
        2000.0, gt=0.0, description="Goodput: a request's time to first token at most this."
    )
    slo_tpot_ms: float | None = Field(
        200.0, gt=0.0, description="Goodput: a request's mean time per output token at most this."
    )
    vllm_names: bool = Field(
        False,
        description="Also export every series under vLLM's names (vllm: instead of tandem:), "
        "for gateways and dashboards that scrape vLLM.",
    )


class ClusterConfig(_Config):
    """A whole deployment: the model, the instance pools and how they cooperate."""

    model: str | None = Field(None, description="Path, or null for the built-in SmolLM2.")
    dtype: Literal[
        "auto", "float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half"
    ] = "auto"
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto",
        description="Weights held quantized and multiplied by weight-only kernels (CPU): auto "
        "runs a GGUF file's Q4_0/Q4_1 weights as int4 and Q8_0 as int8, float checkpoints "
        "dense; int8/int4 quantize every projection; none dequantizes.",
    )
    quantized_dense_min_rows: int | None = Field(
        None,
        ge=0,
        description="Steps of this many tokens or more multiply a dense copy of quantized "
        "weights (the weight-only kernels lose to the dense GEMM on large batches); 0 keeps "
        "no dense copy (least memory); null: each weight where its kernel stops winning "
        "(16 rows for int4 on Tandem's kernel, 8 otherwise).",
    )
    enforce_eager: bool = Field(
        False,
        description="CUDA: run every step eagerly (vLLM's name); by default decode steps "
        "replay captured CUDA graphs. No effect on CPU.",
    )
    max_model_len: int | None = Field(None, ge=2)
    block_size: int = Field(16, ge=1, le=1024, description="KV block size of every instance.")
    pools: list[InstancePool] = Field(
        default_factory=lambda: [InstancePool(name="default", role="both")], min_length=1
    )
    router: RouterConfig = Field(default_factory=RouterConfig)
    kv_transfer: KVTransferConfig = Field(default_factory=KVTransferConfig)
    lora: LoRAConfig | None = None
    serve: ServeConfig = Field(default_factory=ServeConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    admission_window_s: float = Field(
        0.002,
        ge=0.0,
        le=1.0,
        description="How long an idle instance waits after a first arrival so that requests "
        "sent together are admitted in one step.",
    )
    startup_timeout_s: float = Field(
        600.0, gt=0.0, description="Time allowed for placing workers and loading the model."
    )
    engine_actors: bool = Field(
        False,
        description="Run each instance's engine (its scheduler and step loop) in a Ray actor "
        "of its own on the instance's node, streaming tokens straight to the clients, instead "
        "of in the central SchedulerActor's process: scheduling then scales with the "
        "instances instead of sharing one core.",
    )
    health_check_interval_s: float = Field(
        1.0,
        ge=0.0,
        le=60.0,
        description="How often every worker is asked whether it is alive (0: never; a step "
        "still finds a dead worker). A dead worker's instance leaves routing and its requests "
        "move to live instances.",
    )
    client_timeout_s: float = Field(
        10.0,
        ge=2.0,
        le=3600.0,
        description="A client (an ingress replica, a driver's ClusterClient) sends a "
        "keep-alive every second; one silent this long is taken for dead: its requests are "
        "aborted and their blocks freed (Ray does not end a dead caller's stream).",
    )
    drain_timeout_s: float = Field(
        600.0,
        ge=0.0,
        description="When a pool shrinks (scale_pool), how long a leaving instance may take "
        "to finish its requests; what is left then moves to live instances.",
    )
    step_timeout_s: float | None = Field(
        300.0,
        gt=0.0,
        description="A step that has not returned after this long means a hung worker: its "
        "instance fails like a dead one (requests move, the worker is killed and, with "
        "max_restarts, restarted). None: wait forever. vLLM's executor waits 300 s too.",
    )
    engine_ping_timeout_s: float = Field(
        10.0,
        gt=0.0,
        le=600.0,
        description="engine_actors: an engine process that does not answer its ping (sent "
        "every health_check_interval_s, or every second when that is 0) within this long is "
        "taken for hung: it is killed and its requests move on, as a dead one's.",
    )
    engine_ask_timeout_s: float = Field(
        5.0,
        gt=0.0,
        le=600.0,
        description="engine_actors: how long what operators ask of an engine (stats, "
        "/metrics, where requests are) waits for its answer before going on without it.",
    )

    def cluster_settings(self) -> dict[str, Any]:
        """What a running cluster is built from: every field but the ingress-only part of
        ``serve`` (``INGRESS_ONLY``: key, ports, replicas), which a redeploy of the API may
        change under a running cluster. JSON; secrets masked."""
        return self.model_dump(mode="json", exclude={"serve": set(INGRESS_ONLY)})

    def with_kv_transport(self, transport: str) -> ClusterConfig:
        """This config with another KV transport (``auto`` resolved, or its fallback)."""
        return self.model_copy(update={"kv_transfer": self.kv_transfer.with_transport(transport)})

    @property
    def priority_scheduling(self) -> bool:
        """Some pool orders its queue by priority (``scheduler.policy: priority``)."""
        return any(p.scheduler.get("policy") == "priority" for p in self.pools)

    @property
    def disaggregated(self) -> bool:
        """True when some pool prefills for others (workers then need a KV transport)."""
        return any(p.role == "prefill" for p in self.pools)

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        names = [p.name for p in self.pools]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"pool names must be unique; repeated: {', '.join(duplicates)}")
        roles = {p.role for p in self.pools}
        if "prefill" in roles and not roles & {"decode", "both"}:
            raise ValueError("a prefill pool needs a decode (or both) pool to hand KV to")
        if self.router.disaggregation == "always" and "prefill" not in roles:
            raise ValueError("router.disaggregation 'always' needs a pool with role 'prefill'")
        if self.router.disaggregation == "never" and "prefill" in roles:
            idle = ", ".join(p.name for p in self.pools if p.role == "prefill")
            raise ValueError(
                f"router.disaggregation 'never' routes no request to a prefill pool: {idle} "
                "would load the model and serve nothing (remove it, or set 'always' or a "
                "token threshold)"
            )
        if self.serve.lora_modules and self.lora is None:
            raise ValueError("serve.lora_modules needs LoRA enabled: add a lora section")
        if self.max_model_len is not None:  # (else checked at start, with the model's)
            for pool in self.pools:
                pool.scheduler_config(self.max_model_len)
        return self

    def pools_with_role(self, *roles: Role) -> list[InstancePool]:
        return [p for p in self.pools if p.role in roles]

    @classmethod
    def from_yaml(cls, source: str | Path) -> ClusterConfig:
        """Load from a YAML file path or a YAML string (an empty document = all defaults). A
        path: a ``Path``, a name ending .yaml/.yml, or a file that is there (``--config
        cluster.json`` or ``cluster.conf``: its text is read, not the name as YAML)."""
        import yaml

        text = Path(source).read_text() if _is_path(source) else str(source)
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:  # a ValueError, as every bad config is to its callers
            where = f"{source}: " if _is_path(source) else ""
            raise ValueError(f"{where}not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            if isinstance(data, str) and data == source:  # a name: of a file that is not there
                raise FileNotFoundError(f"{source}: no such file (nor a YAML mapping)")
            raise ValueError("a cluster config must be a YAML mapping")
        return cls.model_validate(data)


def _is_path(source: str | Path) -> bool:
    if isinstance(source, Path):
        return True
    if "\n" in source:
        return False
    try:
        return source.endswith((".yaml", ".yml")) or Path(source).is_file()
    except OSError as exc:  # (a long one-line YAML string: a name too long)
        # Any other error (EACCES: a folder it may not look in) is the file's: reading it says
        # so, where taking the name for YAML said "no such file".
        return exc.errno != errno.ENAMETOOLONG


def served_model_name(config: ClusterConfig) -> str:
    """The model's name in the API and in metrics: ``serve.served_model_name``, else the model
    file's or directory's name (the built-in one: SmolLM2-135M-Instruct)."""
    if config.serve.served_model_name:
        return config.serve.served_model_name
    if config.model is None:
        return "SmolLM2-135M-Instruct"  # actors.model.loader.BUILTIN_MODEL
    path = Path(config.model)
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def default_cluster_config(model: str | None = None) -> ClusterConfig:
    """The laptop default: the built-in SmolLM2 (or ``model``), one prefill and one decode
    instance, anywhere in the Ray cluster, sharing the machine's cores (``num_threads: auto``:
    a step of 64 tokens or more takes an even share of the cores among the busy workers), with
    async scheduling (the next step is scheduled while one runs, as vLLM does by default: the
    worker round trip leaves the inter-token latency; docs/serve.md has the measurements)."""
    return ClusterConfig(
        model=model,
        pools=[
            InstancePool(
                name=name, role=name, num_threads="auto", scheduler={"async_scheduling": True}
            )
            for name in ("prefill", "decode")
        ],
    )
