"""``tandem serve [config.yaml]``: a local Ray on 127.0.0.1, the Serve app on :8000 (HTTP) and
:9000 (gRPC) with the built-in SmolLM2, one prefill and one decode instance. Ctrl-C (or
SIGTERM) shuts Serve, the cluster and Ray down.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from pydantic import SecretStr

APP_NAME = "tandem"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", default=None, help="a ClusterConfig YAML file")
    p.add_argument("--host", default=None, help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="HTTP port (default 8000)")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the key (PEM)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the certificate (PEM)")
    p.add_argument("--grpc-port", type=int, default=None, help="gRPC port (default 9000)")
    p.add_argument("--no-grpc", action="store_true", help="serve HTTP only")
    p.add_argument("--api-key", default=None, help="require this Bearer token on /v1 routes")
    p.add_argument(
        "--admin-api-key",
        default=None,
        help="the admin routes (runtime LoRA loading, pool scaling) take this key, not --api-key",
    )
    p.add_argument(
        "--lora-adapter-root",
        default=None,
        metavar="DIR",
        help="allow runtime LoRA loading (/v1/load_lora_adapter) from below DIR",
    )
    p.add_argument("--allow-runtime-scaling", action="store_true", help="serve /admin/scale_pool")
    p.add_argument("--served-model-name", default=None, help="the model's name in the API")
    p.add_argument(
        "--lora-module",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve a LoRA adapter as model NAME (repeatable; enables LoRA)",
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="refuse new requests with 429 while more than this many wait",
    )
    p.add_argument("--address", default=None, help="join this Ray cluster instead")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray")
    p.add_argument(
        "--object-store-mb", type=int, default=512, help="object store of a local Ray (MiB)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log cluster details")


def serve_config(args: argparse.Namespace) -> Any:
    """The ClusterConfig: the file (or the laptop default) with the flags on top."""
    from cluster.config import ClusterConfig, default_cluster_config

    config = ClusterConfig.from_yaml(args.config) if args.config else default_cluster_config()
    data = config.model_dump(exclude_unset=False)
    serve = data["serve"]
    for key in (
        "host",
        "port",
        "grpc_port",
        "served_model_name",
        "max_waiting_requests",
        "ssl_keyfile",
        "ssl_certfile",
    ):
        value = getattr(args, key)
        if value is not None:
            serve[key] = value
    if args.no_grpc:
        serve["grpc_port"] = None
    if args.api_key is not None:
        serve["api_key"] = SecretStr(args.api_key)
    if args.admin_api_key is not None:
        serve["admin_api_key"] = SecretStr(args.admin_api_key)
    if args.lora_adapter_root is not None:
        serve["lora_adapter_root"] = args.lora_adapter_root
        serve["allow_runtime_lora_updates"] = True
    if args.allow_runtime_scaling:
        serve["allow_runtime_scaling"] = True
    for item in args.lora_module:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-module {item!r}: expected NAME=PATH")
        serve["lora_modules"][name] = path
    if (serve["lora_modules"] or serve["allow_runtime_lora_updates"]) and data.get("lora") is None:
        data["lora"] = {"max_loras": max(1, len(serve["lora_modules"]))}
    return ClusterConfig.model_validate(data)  # (a python-mode dump keeps the secrets)


def start_serve(config: Any, *, address: str | None = None, **ray_options: Any) -> str:
    """Start Ray (local unless ``address``), Serve's proxies and the app; returns the base URL
    once the cluster is ready."""
    from ray import serve
    from ray.serve.config import gRPCOptions

    from cluster.control.launch import init_ray, local_node_resources
    from cluster.serving.app import GRPC_SERVICER, build_app_from_config

    s = config.serve
    # Serve's gRPC proxy takes messages up to 2 GiB unless told otherwise: hold it to the
    # body limit of the HTTP API (read by the proxy, a process of the Ray this starts).
    os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(s.max_request_body_bytes))
    if address is None:
        init_ray(None, resources=local_node_resources(config), **ray_options)
    else:
        init_ray(address)
    grpc = None
    # With a certificate, the ingress replicas serve gRPC over TLS themselves: no plaintext
    # proxy on that port.
    if s.grpc_port is not None and s.ssl_certfile is None:
        grpc = gRPCOptions(port=s.grpc_port, grpc_servicer_functions=[GRPC_SERVICER])
    serve.start(proxy_location="HeadOnly", http_options=http_options(s), grpc_options=grpc)
    serve.run(build_app_from_config(config), name=APP_NAME, route_prefix="/")
    scheme = "http" if s.ssl_certfile is None else "https"
    return f"{scheme}://{s.host}:{s.port}"


def http_options(serve: Any) -> Any:
    """Serve's HTTP options for a ``ServeConfig``: host, port and, with a key and a
    certificate, HTTPS (the proxy's uvicorn terminates TLS)."""
    from ray.serve.config import HTTPOptions

    tls = {}
    if serve.ssl_certfile is not None:
        tls = {"ssl_keyfile": serve.ssl_keyfile, "ssl_certfile": serve.ssl_certfile}
    return HTTPOptions(host=serve.host, port=serve.port, **tls)


def run_serve(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from cluster.config import served_model_name

    try:
        config = serve_config(args)
    except (OSError, ValueError) as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return 2
    print(
        "starting Tandem: "
        + ", ".join(f"{p.name} ({p.role} x{p.replicas})" for p in config.pools)
        + " (loading the model takes a moment)",
        flush=True,
    )
    try:
        options = (
            {}
            if args.address
            else {
                "num_cpus": args.num_cpus,
                "object_store_memory": args.object_store_mb << 20,
            }
        )
        url = start_serve(config, address=args.address, **options)
    except Exception as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        ray.shutdown()
        return 1
    model = served_model_name(config)
    auth = ' -H "Authorization: Bearer $TANDEM_API_KEY"' if config.serve.api_key else ""
    grpc = (
        f"gRPC tandem.v1.Generate on {config.serve.host}:{config.serve.grpc_port}"
        f"{' (TLS)' if config.serve.ssl_certfile else ''}\n"
        if config.serve.grpc_port
        else ""
    )
    print(
        f"ready: {url}/v1 serves {model!r}\n{grpc}"
        f"  curl {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{model}", "messages": [{{"role": "user", '
        f'"content": "What is the capital of France?"}}], "max_tokens": 32}}\'\n'
        "Ctrl-C stops everything.",
        flush=True,
    )

    from cluster.tools.signals import wait_for_stop

    try:
        wait_for_stop()
    finally:
        try:
            serve.shutdown()  # type: ignore[no-untyped-call]
            # The cluster outlives the app (detached): tandem serve brought it up, and takes
            # it down, also when it joined a Ray cluster that stays.
            from cluster.control.launch import app_cluster_name, get_cluster, shutdown_cluster

            shutdown_cluster(get_cluster(app_cluster_name(APP_NAME)))
        except ValueError:
            pass  # it was not started (or is gone already)
        finally:
            ray.shutdown()
    return 0
