"""``tandem serve [MODEL] [--config FILE] [vLLM's flags]``: a local Ray on 127.0.0.1, the Serve
app on :8000 (HTTP) and :9000 (gRPC) with the model (default: the built-in SmolLM2), one
prefill and one decode instance unless told otherwise. ``vllm serve MODEL --max-model-len
4096`` becomes ``tandem serve MODEL --max-model-len 4096``. Ctrl-C (or SIGTERM) shuts Serve,
the cluster and Ray down.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
from typing import Any

from pydantic import SecretStr

from cluster.tools.serve_listen import (
    check_ports_free,
    grpc_banner,
    grpc_where_it_binds,
    http_options,
)

APP_NAME = "tandem"


def _take_down(joined: bool) -> None:
    """Remove what ``tandem serve`` brought up: its Serve app -- only that one on a Ray
    cluster it joined (``serve.shutdown`` there deleted every team's apps), all of Serve on
    its own Ray -- and the Tandem cluster, which outlives the app (detached)."""
    import ray
    from ray import serve

    from cluster.control.launch import app_cluster_name, get_cluster, shutdown_cluster

    if not ray.is_initialized():  # (it never connected: Serve's calls would start a Ray)
        return
    try:
        if joined:
            serve.delete(APP_NAME)
        # Serve goes too unless other apps run on it (a later run's HTTP, TLS and gRPC
        # options would not apply to a Serve left running with these).
        if not joined or not serve.status().applications:
            serve.shutdown()  # type: ignore[no-untyped-call]
    except Exception as exc:  # (Serve never started, or is gone)
        print(f"tandem serve: stopping Serve: {exc}", file=sys.stderr)
    with contextlib.suppress(ValueError):  # it was not started (or is gone already)
        shutdown_cluster(get_cluster(app_cluster_name(APP_NAME)))


def serve_config(args: argparse.Namespace) -> Any:
    """The ClusterConfig: the file (or the laptop default) with the flags on top."""
    from cluster.config import ClusterConfig, default_cluster_config

    model, config_file = args.model, args.config
    if model is not None and model.endswith((".yaml", ".yml")):
        if config_file is not None:
            raise ValueError(f"two config files: {model} and --config {config_file}")
        model, config_file = None, model
    config = ClusterConfig.from_yaml(config_file) if config_file else default_cluster_config()
    data = config.model_dump(exclude_unset=False)
    if model is not None:
        data["model"] = model
        if not (config_file and config.serve.served_model_name):
            # vLLM's default: the name as given -- a config file's own name stays, as vLLM
            # takes its --config file's keys as flags given
            data["serve"]["served_model_name"] = model
    names = args.served_model_name or []
    if len(names) > 1:
        raise ValueError(
            f"--served-model-name {' '.join(names)}: one name (aliases are not supported yet)"
        )
    _engine_flags(args, data)
    serve = data["serve"]
    if names:
        serve["served_model_name"] = names[0]
    if args.tool_call_parser is not None:
        serve["tool_call_parser"] = args.tool_call_parser
    if args.generation_config is not None:
        serve["generation_config"] = args.generation_config
    for key in (
        "host",
        "port",
        "grpc_port",
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
    for item in [*args.lora_modules, *args.lora_module]:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {item!r}: expected NAME=PATH")
        serve["lora_modules"][name] = path
    lora_wanted = args.enable_lora or args.max_loras is not None or args.max_lora_rank is not None
    if lora_wanted or serve["lora_modules"] or serve["allow_runtime_lora_updates"]:
        lora = data.get("lora") or {"max_loras": max(1, len(serve["lora_modules"]))}
        if args.max_loras is not None:
            lora["max_loras"] = args.max_loras
            if (lora.get("max_cpu_loras") or 0) < args.max_loras:
                lora.pop("max_cpu_loras", None)  # (derived from the old max_loras)
        if args.max_lora_rank is not None:
            lora["max_lora_rank"] = args.max_lora_rank
        data["lora"] = lora
    return ClusterConfig.model_validate(data)  # (a python-mode dump keeps the secrets)


def _engine_flags(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """vLLM's engine flags and Tandem's pool sizes, onto a ClusterConfig dump: the top-level
    fields, and every pool's scheduler and cache sections."""
    for key in ("dtype", "quantization", "max_model_len", "block_size", "enforce_eager"):
        value = getattr(args, key)
        if value is not None:
            data[key] = value
    if args.kv_transport is not None:
        data["kv_transfer"]["transport"] = args.kv_transport
    if args.prefill_instances is not None or args.decode_instances is not None:
        data["pools"] = _pools(data["pools"], args.prefill_instances, args.decode_instances)
    for pool in data["pools"]:
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(args, key)
            if value is not None:
                pool["scheduler"][key] = value
        if args.enable_prefix_caching is not None:
            pool["cache"]["enable_prefix_caching"] = args.enable_prefix_caching
        if args.pipeline_parallel_size is not None:
            pool["pp_size"] = args.pipeline_parallel_size
            if args.pipeline_parallel_size > 1 and args.async_scheduling is None:
                # The stages keep pp_size batches in flight already; async scheduling (on in
                # the default config) does not combine with them, so it goes, as in vLLM.
                pool["scheduler"].pop("async_scheduling", None)
        if args.async_scheduling is not None:
            pool["scheduler"]["async_scheduling"] = args.async_scheduling


def _pools(
    pools: list[dict[str, Any]], prefill: int | None, decode: int | None
) -> list[dict[str, Any]]:
    """The pools for ``--prefill-instances`` / ``--decode-instances``, each from the config's
    pool of that role (its threads, resources, cache) when it has one. Prefill 0: one
    colocated pool (role both) of ``decode`` instances (default: the decode pool's count)."""
    by_role = {pool["role"]: pool for pool in reversed(pools)}
    decode_pool = by_role.get("decode") or by_role.get("both") or pools[0]
    prefill_pool = by_role.get("prefill")
    if any(pool is not decode_pool and pool is not prefill_pool for pool in pools):
        raise ValueError(  # the others would be dropped
            "--prefill-instances / --decode-instances make one prefill and one decode pool "
            f"from the config's; it has {len(pools)} ({', '.join(p['name'] for p in pools)}): "
            "set their replicas in the config instead"
        )
    if prefill is None:
        prefill = prefill_pool["replicas"] if prefill_pool is not None else 0
    if decode is None:
        decode = decode_pool["replicas"]
    if prefill < 0 or decode < 1:
        raise ValueError(
            f"--prefill-instances {prefill} --decode-instances {decode}: decode instances must "
            "be at least 1 and prefill instances at least 0"
        )
    decode_pool = copy.deepcopy(decode_pool)  # (the new pools share no section)
    if prefill == 0:
        return [{**decode_pool, "name": "colocated", "role": "both", "replicas": decode}]
    template = copy.deepcopy(prefill_pool) if prefill_pool else {**decode_pool, "resources": {}}
    return [
        {**copy.deepcopy(template), "name": "prefill", "role": "prefill", "replicas": prefill},
        {**decode_pool, "name": "decode", "role": "decode", "replicas": decode},
    ]


def start_serve(config: Any, *, address: str | None = None, **ray_options: Any) -> str:
    """Start Ray (local unless ``address``), Serve's proxies and the app; returns the base URL
    once the cluster is ready."""
    from ray import serve
    from ray.serve.config import gRPCOptions

    from cluster.control.launch import init_ray, local_node_resources
    from cluster.serving.app import GRPC_SERVICER, build_app_from_config

    config = grpc_where_it_binds(config, address)
    s = config.serve
    if address is None:  # (a joined Ray may run Serve on these ports already: its own)
        check_ports_free(s)
    # Serve's gRPC proxy takes messages up to 2 GiB unless told otherwise: hold it to the
    # body limit of the HTTP API (read by the proxy, a process of the Ray this starts).
    os.environ.setdefault("RAY_SERVE_GRPC_MAX_MESSAGE_SIZE", str(s.max_request_body_bytes))
    if address is None:
        init_ray(None, resources=local_node_resources(config), **ray_options)
    else:
        init_ray(address)
    grpc = None
    # With a certificate, or on a loopback host, the ingress replicas serve gRPC themselves:
    # no proxy on that port.
    if s.grpc_port is not None and s.ssl_certfile is None and s.grpc_server != "ingress":
        grpc = gRPCOptions(port=s.grpc_port, grpc_servicer_functions=[GRPC_SERVICER])
    serve.start(proxy_location="HeadOnly", http_options=http_options(s), grpc_options=grpc)
    serve.run(build_app_from_config(config), name=APP_NAME, route_prefix="/")
    scheme = "http" if s.ssl_certfile is None else "https"
    return f"{scheme}://{s.host}:{s.port}"


def run_serve(args: argparse.Namespace) -> int:
    from cluster.tools.signals import interrupted_while_starting, stop_on_signals, wait_for_stop

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
    stop_on_signals()
    joined = bool(args.address)
    try:
        options = (
            {}
            if args.address
            else {
                "num_cpus": args.num_cpus,
                "object_store_memory": args.object_store_mb << 20,
            }
        )
        config = grpc_where_it_binds(config, args.address)  # (as start_serve does)
        url = start_serve(config, address=args.address, **options)
        stop_on_signals()  # (ray.init set a SIGTERM handler of its own)
    except (KeyboardInterrupt, SystemExit) as exc:  # (SystemExit: Ray's SIGTERM handler,
        status = interrupted_while_starting("tandem serve", exc)  # set by ray.init within)
        _stop(joined)
        return status
    except Exception as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        _stop(joined)
        return 1
    try:
        _print_ready(config, url)
        wait_for_stop()
    except KeyboardInterrupt:  # (before the wait began)
        print("\nshutting down", flush=True)
    finally:
        _stop(joined)
    return 0


def _stop(joined: bool) -> None:
    """Take down what this run brought up (on a Ray it joined, only its own), then leave
    Ray (which stops the Ray it started)."""
    import ray

    try:
        _take_down(joined)
    finally:
        ray.shutdown()


def _print_ready(config: Any, url: str) -> None:
    import ray

    from cluster.config import served_model_name
    from cluster.control.launch import app_cluster_name, get_cluster

    model = served_model_name(config)
    described = ray.get(get_cluster(app_cluster_name(APP_NAME)).describe.remote())
    if described.get("kv_transport"):
        print(f"KV transport: {described['kv_transport']}", flush=True)
    auth = ' -H "Authorization: Bearer $TANDEM_API_KEY"' if config.serve.api_key else ""
    grpc = grpc_banner(config.serve)
    print(
        f"ready: {url}/v1 serves {model!r}\n{grpc}"
        f"  curl {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\\n"
        f'    -d \'{{"model": "{model}", "messages": [{{"role": "user", '
        f'"content": "What is the capital of France?"}}], "max_tokens": 32}}\'\n'
        "Ctrl-C stops everything.",
        flush=True,
    )
