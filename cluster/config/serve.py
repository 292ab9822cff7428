"""``serve:`` of a ``ClusterConfig``: the Ray Serve application in front of the cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator

from cluster.config.base import _Config


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
    grpc_server: Literal["proxy", "ingress"] | None = Field(
        None,
        description="Who serves plaintext gRPC: Serve's gRPC proxy (grpc_options; it binds "
        "every interface) or the ingress replicas themselves on host:grpc_port, as they do "
        "over TLS. Unset: the proxy, but tandem serve picks ingress for a loopback host on a "
        "Ray of its own.",
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
    "grpc_server",
    "ingress_replicas",
    "ingress_num_cpus",
    "max_ongoing_requests",
    "max_request_body_bytes",
    "preprocess_threads",
    "generation_config",  # the API's sampling defaults
    "tool_call_parser",
)
