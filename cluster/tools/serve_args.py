"""The flags of ``tandem serve``: vLLM's names for the engine, ours for the cluster, Ray and
the Serve app. ``serve_cli.serve_config`` turns them into a ``ServeConfig``."""

from __future__ import annotations

import argparse

# As ClusterConfig.dtype (the loader's names): tandem generate accepted bf16, fp16 and fp32.
DTYPES = ("auto", "float32", "fp32", "float", "bfloat16", "bf16", "float16", "fp16", "half")


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to serve: a checkpoint folder, a .gguf file or a built-in name "
        "(default: the built-in SmolLM2); a .yaml/.yml file here is read as --config",
    )
    p.add_argument("--config", default=None, metavar="FILE", help="a ClusterConfig YAML file")

    engine = p.add_argument_group("engine (vLLM's flags; they override the config file)")
    engine.add_argument("--dtype", choices=DTYPES, default=None, help="weights' dtype")
    engine.add_argument(
        "--quantization",
        "-q",
        choices=("auto", "none", "int8", "int4"),
        default=None,
        help="weights held quantized (auto: as a GGUF file stores them)",
    )
    engine.add_argument("--max-model-len", type=int, default=None, help="context length")
    engine.add_argument(
        "--max-num-seqs", type=int, default=None, help="running requests per instance"
    )
    engine.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="token budget of a step"
    )
    engine.add_argument("--block-size", type=int, default=None, help="tokens per KV block")
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs",
    )
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the KV blocks of shared prefixes (default on)",
    )
    engine.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=None,
        help="pipeline stages per instance",
    )
    engine.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule a step while the previous one runs (default config: on; pp_size 1 only)",
    )
    engine.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model's name in the API (default: MODEL as given; one name: no aliases yet)",
    )
    engine.add_argument(
        "--tool-call-parser",
        choices=("hermes", "llama3_json"),
        default=None,
        help="the format tool_choice auto parses calls in (default: from the chat template)",
    )
    engine.add_argument(
        "--generation-config",
        default=None,
        help="the API's sampling defaults: auto (the model's generation_config.json, the "
        "default), vllm (none), or a folder holding one",
    )
    engine.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command lines: tool_choice auto is always on",
    )
    lora = p.add_argument_group("LoRA (vLLM's flags)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters")
    lora.add_argument("--max-loras", type=int, default=None, help="adapters in one batch")
    lora.add_argument("--max-lora-rank", type=int, default=None, help="highest adapter rank")
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help="serve adapters as model names from the start (enables LoRA)",
    )
    lora.add_argument(
        "--lora-module",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="one adapter (repeatable; the same as --lora-modules)",
    )
    lora.add_argument(
        "--lora-adapter-root",
        default=None,
        metavar="DIR",
        help="allow runtime LoRA loading (/v1/load_lora_adapter) from below DIR",
    )

    cluster = p.add_argument_group("cluster (Tandem's)")
    cluster.add_argument(
        "--prefill-instances",
        type=int,
        default=None,
        metavar="N",
        help="prefill instances (0: colocated -- every instance serves whole requests)",
    )
    cluster.add_argument(
        "--decode-instances", type=int, default=None, metavar="M", help="decode instances"
    )
    cluster.add_argument(
        "--kv-transport",
        choices=("auto", "nixl", "ray", "grpc"),
        default=None,
        help="how KV moves P to D (default auto: nixl where installed, else ray)",
    )
    cluster.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="refuse new requests with 429 while more than this many wait",
    )
    cluster.add_argument(
        "--allow-runtime-scaling", action="store_true", help="serve /admin/scale_pool"
    )

    server = p.add_argument_group("server")
    server.add_argument("--host", default=None, help="HTTP bind address (default 127.0.0.1)")
    server.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    server.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the key (PEM)")
    server.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate (PEM)")
    server.add_argument("--grpc-port", type=int, default=None, help="gRPC port (default 9000)")
    server.add_argument("--no-grpc", action="store_true", help="serve HTTP only")
    server.add_argument(
        "--api-key",
        default=None,
        help="require this Bearer token on /v1 routes, /tokenize and /detokenize",
    )
    server.add_argument(
        "--admin-api-key",
        default=None,
        help="the admin routes (runtime LoRA loading, pool scaling) take this key, not --api-key",
    )

    ray = p.add_argument_group("Ray")
    ray.add_argument("--address", default=None, help="join this Ray cluster instead")
    ray.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray")
    ray.add_argument(
        "--object-store-mb", type=int, default=512, help="object store of a local Ray (MiB)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log cluster details")
