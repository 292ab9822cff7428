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

import secrets
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from kv_transfer.tls import TLSMaterial
from kv_transfer.tracing import TracingConfig
from scheduler import CacheConfig, LoRAConfig, SchedulerConfig

Role = Literal["prefill", "decode", "both"]


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
    num_cpus: float = Field(0.0, ge=0.0)
    max_restarts: int = Field(
        0,
        ge=0,
        le=1000,
        description="Ray restarts a dead worker this many times; the instance then rejoins "
        "routing with an empty cache.",
    )
    num_gpus: float = Field(0.0, ge=0.0)
    num_threads: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] | None = Field(
        None,
        description="torch threads per worker (Ray's default is 1); auto: the machine's cores, "
        "shared step by step with the other auto workers on it (an even share among the busy "
        "ones; steps under 64 tokens run on one thread).",
    )
    device: str = Field("cpu", description="torch device of the workers: cpu or cuda.")
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
        stages = self.stage_resources or []
        if any(v < 0 for r in [self.resources, *stages] for v in r.values()):
            raise ValueError(f"pool {self.name!r}: resources must be >= 0")
        # Validate the nested configs now, so a bad knob fails at load time with its name.
        # The cluster's max_model_len is checked against them by ``ClusterConfig`` (here, a
        # length no knob can conflict with: the model's is known only once it is loaded).
        threshold = self.scheduler.get("long_prefill_token_threshold")
        self.scheduler_config(max(2, threshold) if isinstance(threshold, int) else 2)
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


NIXL_SAFETY_MARGIN_S = 1.0  # a one-sided read ends this long before its source's lease


class KVTransferConfig(_Config):
    """The KV connector between prefill and decode instances.

    ``transport``: ``nixl`` (one-sided reads straight into the decode blocks; the
    ``tandem-serve[nixl]`` extra), ``ray`` (the object store), ``grpc`` (pulls from each
    worker's KV server), or ``auto`` (the default): ``nixl`` when it can be imported and the
    workers reach each other with it (probed when they start), else ``ray``.

    The ``grpc`` transport's knobs are ignored by ``ray``. Its cluster token, which every KV
    request carries, is ``auth_token`` or, unset, a random one made when the config is built:
    every worker started from this config shares it (copies and the pickles sent to the actors
    keep it), while two configs loaded from one file still compare equal. A ``SecretStr``:
    never in reprs, logs or dumps.
    """

    transport: Literal["auto", "nixl", "ray", "grpc"] = "auto"
    timeout_s: float = Field(5.0, gt=0.0, le=600.0, description="Deadline of one transfer.")
    failure_policy: Literal["recompute", "fail"] = "recompute"
    auth_token: SecretStr | None = Field(
        None,
        description="grpc: the cluster token KV requests carry (random per config if unset; "
        "set it when several processes build their own config for one cluster).",
    )
    lease_s: float | None = Field(
        None,
        gt=0.0,
        le=3600.0,
        description="grpc, nixl: how long a prefill worker holds a request's blocks for the pull "
        "(default: timeout_s plus a grace of max(1 s, timeout_s / 2), so that the lease "
        "outlives the decode side's deadline).",
    )
    ucx_tls: str | None = Field(
        None,
        min_length=1,
        description="nixl: the UCX transports the workers' KV reads may use (UCX_TLS), e.g. "
        "'tcp' where a same-node kernel copy (CMA) is not permitted; default: UCX's choice.",
    )
    same_node_copy: bool = Field(
        True,
        description="nixl: between two workers of one machine, copy the blocks with one "
        "kernel copy (process_vm_readv, what UCX's CMA transport does underneath) instead of a "
        "NIXL READ: the same rights, a fraction of the per-transfer cost. Used where the "
        "reader can attach to the source; never with ucx_tls set.",
    )
    bind_host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="grpc: the address each worker's KV server binds (port chosen by the "
        "system); 0.0.0.0 for a cluster of several machines.",
    )
    advertise_host: str | None = Field(
        None,
        min_length=1,
        description="grpc: the address other workers reach a KV server at (default: bind_host, "
        "or this machine's address when bind_host is a wildcard).",
    )
    chunk_size_bytes: int = Field(
        1 << 20, ge=4096, le=64 << 20, description="grpc: the largest data message of a pull."
    )
    tls: bool = Field(
        False,
        description="grpc: mutual TLS between workers (KV bytes and the token encrypted; only "
        "peers with a certificate of the cluster's CA connect). With no files below, a CA and "
        "a certificate are made for the cluster when the config is built.",
    )
    tls_ca_file: str | None = Field(None, min_length=1, description="grpc: the CA (PEM).")
    tls_cert_file: str | None = Field(
        None, min_length=1, description="grpc: every worker's certificate (PEM), signed by the CA."
    )
    tls_key_file: str | None = Field(None, min_length=1, description="grpc: its key (PEM).")
    tls_server_name: str = Field(
        "tandem-kv",
        min_length=1,
        description="grpc: the DNS name in the certificate that clients check servers against "
        "(workers are reached by address; one name stands for all of them).",
    )

    @model_validator(mode="after")
    def _check(self) -> KVTransferConfig:
        token = None if self.auth_token is None else self.auth_token.get_secret_value()
        if token is not None and len(token) < 16:
            raise ValueError("kv_transfer.auth_token must be at least 16 characters")
        if token is not None and set(token) == {"*"}:
            raise ValueError(
                "kv_transfer.auth_token is a masked secret (from a dump): set the real one"
            )
        files = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        if any(f is not None for f in files) and None in files:
            raise ValueError(
                "kv_transfer.tls_ca_file, tls_cert_file and tls_key_file go together (or none: "
                "a CA and certificate are made for the cluster)"
            )
        if any(f is not None for f in files) and not self.tls:
            raise ValueError("kv_transfer.tls_* files are set but kv_transfer.tls is false")
        if self.transport in ("nixl", "auto") and self.effective_lease_s <= NIXL_SAFETY_MARGIN_S:
            raise ValueError(
                f"kv_transfer.lease_s ({self.effective_lease_s}) must exceed the nixl "
                f"transport's safety margin of {NIXL_SAFETY_MARGIN_S} s (transport "
                f"{self.transport})"
            )
        if self.tls and self.transport != "grpc":
            raise ValueError(
                "kv_transfer.tls is for the grpc transport; the ray transport rides Ray's own "
                "channels (encrypted only with Ray's TLS: RAY_USE_TLS=1)"
            )
        return self

    def model_post_init(self, context: Any, /) -> None:
        _ = self.cluster_token  # made now, so that every copy of this config carries it
        if self.tls and self.tls_ca_file is None:
            _ = self.cluster_tls  # likewise the generated CA and certificate

    @cached_property
    def cluster_tls(self) -> TLSMaterial | None:
        """The TLS material of the grpc transport (None without ``tls``): read from the files,
        or made for this config when it was built (kept in the instance, like the token)."""
        if not self.tls:
            return None
        if self.tls_ca_file is not None and self.tls_cert_file and self.tls_key_file:
            return TLSMaterial.from_files(
                self.tls_ca_file, self.tls_cert_file, self.tls_key_file, self.tls_server_name
            )
        return TLSMaterial.generate(self.tls_server_name)

    @cached_property
    def cluster_token(self) -> SecretStr:
        """``auth_token``, or the random token made for this config when it was built. Kept
        in the instance, not in a field: not dumped, not compared."""
        return self.auth_token or SecretStr(secrets.token_urlsafe(32))

    @property
    def effective_lease_s(self) -> float:
        """``lease_s``, or its default derived from ``timeout_s``."""
        if self.lease_s is not None:
            return self.lease_s
        return self.timeout_s + max(1.0, self.timeout_s / 2)

    @property
    def auto(self) -> bool:
        return self.transport == "auto"

    def resolved(self) -> KVTransferConfig:
        """This config with ``auto`` replaced by its first choice here: ``nixl`` when NIXL can
        be imported, else ``ray`` (whether the workers reach each other is probed when they
        start: ``cluster.control.placement.connect_kv_peers``)."""
        if not self.auto:
            return self
        from kv_transfer.nixl_transport import nixl_available

        return self.with_transport("nixl" if nixl_available() else "ray")

    def with_transport(self, transport: str) -> KVTransferConfig:
        return self.model_copy(update={"transport": transport})

    def connector_options(self) -> dict[str, Any]:
        """Keyword arguments of the workers' connector for this transport."""
        if self.transport == "nixl":
            options: dict[str, Any] = {
                "lease_s": self.effective_lease_s,
                "safety_margin_s": NIXL_SAFETY_MARGIN_S,
            }
            if self.ucx_tls is not None:
                options["ucx_tls"] = self.ucx_tls
            if not self.same_node_copy:
                options["same_node_copy"] = False
            return options
        if self.transport != "grpc":
            return {}
        return {
            "auth_token": self.cluster_token,  # unwrapped by the connector only
            "lease_s": self.effective_lease_s,
            "bind_host": self.bind_host,
            "advertise_host": self.advertise_host,
            "chunk_size_bytes": self.chunk_size_bytes,
            "tls": self.cluster_tls,
        }


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


class ServeConfig(_Config):
    """The Ray Serve application in front of the cluster (``cluster.serving.app:build_app``)."""

    served_model_name: str | None = Field(
        None,
        min_length=1,
        description="The model's name in the API (default: the model "
        "file or directory name; SmolLM2-135M-Instruct for the built-in one).",
    )
    api_key: SecretStr | None = Field(
        None, description="When set, every /v1 request must carry it as a Bearer token."
    )
    admin_api_key: SecretStr | None = Field(
        None,
        description="When set, the admin routes (runtime LoRA loading, pool scaling) take "
        "this Bearer token and no other; it must differ from api_key. Unset: they take api_key.",
    )
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters served as model names from the start: name -> path "
        "(needs the lora section). More can be loaded at run time (/v1/load_lora_adapter) "
        "where allow_runtime_lora_updates is on.",
    )
    allow_runtime_lora_updates: bool = Field(
        False,
        description="Serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING): they make the workers open a path a client "
        "names, so they are off by default, need lora_adapter_root, and take admin_api_key.",
    )
    lora_adapter_root: str | None = Field(
        None,
        min_length=1,
        description="The folder runtime-loaded adapters must lie under (relative lora_path "
        "values are taken from it); a path that resolves outside it (.., symlinks) is refused.",
    )
    allow_runtime_scaling: bool = Field(
        False,
        description="Serve /admin/scale_pool (resize a pool while serving; it takes "
        "admin_api_key). tandem scale works without it.",
    )
    max_waiting_requests: int | None = Field(
        None,
        ge=0,
        description="Requests waiting to be scheduled, cluster-wide, above which "
        "new ones are refused with 429 (unset: no bound).",
    )
    retry_after_s: int = Field(1, ge=1, le=3600, description="Retry-After of a 429.")
    host: str = Field("127.0.0.1", min_length=1, description="HTTP bind address (tandem serve).")
    ssl_keyfile: str | None = Field(
        None,
        min_length=1,
        description="HTTPS: the server's private key (PEM), with ssl_certfile (tandem serve; a "
        "Serve config file sets http_options.ssl_keyfile itself).",
    )
    ssl_certfile: str | None = Field(
        None, min_length=1, description="HTTPS: the server's certificate chain (PEM)."
    )
    port: int = Field(8000, ge=1, le=65535, description="HTTP port (tandem serve).")
    grpc_port: int | None = Field(
        9000, ge=1, le=65535, description="gRPC port of tandem.v1.Generate (null: no gRPC)."
    )
    ingress_replicas: int = Field(
        1, ge=1, le=256, description="Ingress replicas (tokenization, detokenization, HTTP)."
    )
    ingress_num_cpus: float = Field(0.0, ge=0.0, description="CPUs each ingress replica takes.")
    max_ongoing_requests: int = Field(
        1024, ge=1, description="Concurrent requests one ingress replica accepts."
    )
    max_request_body_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        description="Largest HTTP request body accepted; a larger one is answered 413 "
        "before it is parsed (Serve's proxy still reads it: bound it in front too).",
    )
    preprocess_threads: int = Field(
        2,
        ge=1,
        le=64,
        description="Threads of each ingress replica that tokenize prompts and render chat "
        "templates, off its event loop.",
    )
    tool_call_parser: Literal["hermes", "llama3_json"] | None = Field(
        None,
        description="The format tool_choice auto parses calls in (vLLM's --tool-call-parser): "
        "hermes (<tool_call> blocks) or llama3_json (a bare JSON object); unset: chosen from "
        "the chat template (hermes where it has no tool format of its own).",
    )
    generation_config: str = Field(
        "auto",
        min_length=1,
        description="Where the API's sampling defaults come from (vLLM's --generation-config): "
        "auto, the model's generation_config.json (temperature, top_p, top_k, min_p, "
        "repetition_penalty, and max_new_tokens as the default max_tokens) for the fields a "
        "request leaves unset; vllm, the usual defaults (temperature 1, ...); or a folder "
        "holding a generation_config.json.",
    )

    @model_validator(mode="after")
    def _check(self) -> ServeConfig:
        for name in self.lora_modules:
            if not name or name == self.served_model_name:
                raise ValueError(f"serve.lora_modules: {name!r} is not a valid adapter name")
        if self.allow_runtime_lora_updates and self.lora_adapter_root is None:
            raise ValueError(
                "serve.allow_runtime_lora_updates needs serve.lora_adapter_root: the folder "
                "adapters may be loaded from"
            )
        if self.lora_adapter_root is not None and not Path(self.lora_adapter_root).is_absolute():
            raise ValueError("serve.lora_adapter_root must be an absolute path")
        admin_routes = self.allow_runtime_lora_updates or self.allow_runtime_scaling
        if admin_routes and self.admin_api_key is None and self.api_key is None:
            raise ValueError(
                "serve.allow_runtime_lora_updates / allow_runtime_scaling need a key: set "
                "serve.admin_api_key (or at least serve.api_key)"
            )
        for name in ("api_key", "admin_api_key"):
            secret = getattr(self, name)
            if secret is not None and not secret.get_secret_value().strip():
                raise ValueError(f"serve.{name} is empty")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("serve.ssl_keyfile and serve.ssl_certfile go together")
        admin, key = self.admin_api_key, self.api_key
        if (
            admin is not None
            and key is not None
            and admin.get_secret_value() == key.get_secret_value()
        ):
            raise ValueError("serve.admin_api_key must differ from serve.api_key")
        return self


# ServeConfig fields that only the ingress reads: a new value needs new ingress replicas, not a
# new cluster (the others -- served_model_name, lora_modules, the waiting bound -- are the
# SchedulerActor's).
INGRESS_ONLY = (
    "api_key",
    "admin_api_key",
    "allow_runtime_lora_updates",
    "lora_adapter_root",
    "allow_runtime_scaling",
    "host",
    "ssl_keyfile",
    "ssl_certfile",
    "port",
    "grpc_port",
    "ingress_replicas",
    "ingress_num_cpus",
    "max_ongoing_requests",
    "max_request_body_bytes",
    "preprocess_threads",
)


class ClusterConfig(_Config):
    """A whole deployment: the model, the instance pools and how they cooperate."""

    model: str | None = Field(None, description="Path, or null for the built-in SmolLM2.")
    dtype: str = "auto"
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

    def cluster_settings(self) -> dict[str, Any]:
        """What a running cluster is built from: every field but the ingress-only part of
        ``serve`` (``INGRESS_ONLY``: key, ports, replicas), which a redeploy of the API may
        change under a running cluster. JSON; secrets masked."""
        return self.model_dump(mode="json", exclude={"serve": set(INGRESS_ONLY)})

    def with_kv_transport(self, transport: str) -> ClusterConfig:
        """This config with another KV transport (``auto`` resolved, or its fallback)."""
        return self.model_copy(update={"kv_transfer": self.kv_transfer.with_transport(transport)})

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
        """Load from a YAML file path or a YAML string (an empty document = all defaults)."""
        import yaml

        text = Path(source).read_text() if _is_path(source) else str(source)
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ValueError("a cluster config must be a YAML mapping")
        return cls.model_validate(data)


def _is_path(source: str | Path) -> bool:
    if isinstance(source, Path):
        return True
    return "\n" not in source and source.endswith((".yaml", ".yml"))


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
