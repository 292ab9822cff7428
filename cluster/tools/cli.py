"""The ``tandem`` command line.

tandem generate "What is the capital of France?"          # built-in SmolLM2, in-process
tandem generate --model ./my-llama --raw --max-tokens 64 "Once upon a time"
tandem up [cluster.yaml] [--address ADDR]                 # a prefill + a decode instance on Ray
tandem generate --cluster "What is the capital of France?"   # through the running cluster
tandem scale decode=2                                     # resize a pool while it serves
tandem down                                               # stop the running cluster
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from cluster.tools.generate_cli import add_generate_parser, ray_arguments, run_generate
from cluster.tools.signals import interrupted_while_starting, stop_on_signals, wait_for_stop


def _up_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "up",
        help="start a cluster (SchedulerActor + workers) on Ray and keep it running",
        description="Start the cluster described by CONFIG (default: the built-in SmolLM2 "
        "with one prefill and one decode instance) on a local Ray bound to 127.0.0.1, or on "
        "the Ray cluster at --address. Runs until Ctrl-C, then shuts everything down.",
    )
    p.add_argument("config", nargs="?", default=None, help="a ClusterConfig YAML file")
    ray_arguments(p, default_address=None)
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray")
    p.add_argument(
        "--object-store-mb", type=int, default=512, help="object store of a local Ray (MiB)"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log cluster details")


def _run_up(args: argparse.Namespace) -> int:
    from cluster.config import ClusterConfig, default_cluster_config
    from cluster.control.launch import (
        DEFAULT_NAME,
        build_cluster,
        init_ray,
        local_node_resources,
        shutdown_cluster,
    )

    try:
        config = ClusterConfig.from_yaml(args.config) if args.config else default_cluster_config()
    except (OSError, ValueError) as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 2
    import ray

    stop_on_signals()
    try:
        init_ray(
            args.address,
            num_cpus=args.num_cpus,
            resources=local_node_resources(config) if args.address is None else None,
            object_store_memory=args.object_store_mb << 20 if args.address is None else None,
        )
        stop_on_signals()  # (ray.init set a SIGTERM handler of its own)
        name = args.name or DEFAULT_NAME
        print(
            f"starting cluster {name!r}: "
            + ", ".join(f"{p.name} ({p.role} x{p.replicas})" for p in config.pools),
            flush=True,
        )
        handle = build_cluster(config, name=name)  # (it kills what it began if cut short)
    except (KeyboardInterrupt, SystemExit) as exc:  # (SystemExit: Ray's SIGTERM handler)
        status = interrupted_while_starting("tandem up", exc)
        ray.shutdown()
        return status
    except Exception as exc:  # placement or model loading failed: say why and stop
        print(f"tandem up: {exc}", file=sys.stderr)
        ray.shutdown()
        return 1

    try:
        described = ray.get(handle.describe.remote())
        for iid, inst in described["instances"].items():
            print(
                f"  {iid}: {inst['role']}, {inst['num_blocks']} KV blocks, node {inst['node_id']}"
            )
        if described.get("kv_transport"):
            print(f"  KV transport: {described['kv_transport']}")
        address = ray.get_runtime_context().gcs_address
        print(
            f"ready (max_model_len {described['max_model_len']}, Ray at {address}). "
            "From another shell:\n"
            f'  tandem generate --cluster --address {address} "What is the capital of France?"\n'
            "Ctrl-C stops the cluster.",
            flush=True,
        )
        wait_for_stop()
    except KeyboardInterrupt:  # (before the wait began)
        print("\nshutting down", flush=True)
    finally:
        try:
            shutdown_cluster(handle)
        finally:
            ray.shutdown()
    return 0


def _scale_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "scale",
        help="resize a pool of a running cluster (tandem up / tandem serve): POOL=N",
        description="Add or remove instances of a pool while the cluster serves. Removed "
        "instances drain first: they take no new request and finish theirs.",
    )
    p.add_argument("target", metavar="POOL=N", help="the pool's name and its new size")
    ray_arguments(p, default_address="auto")
    p.add_argument(
        "--drain-timeout", type=float, default=None, help="seconds a leaving instance may take"
    )


def _down_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "down",
        help="stop a running cluster (requests in flight or arriving meanwhile get a 503; "
        "workers stop)",
        description="Stop the named cluster: one started by tandem up, or the one a Serve app "
        "runs on (it outlives the app's redeploys and deletes).",
    )
    ray_arguments(p, default_address="auto")


def _running_cluster(args: argparse.Namespace, command: str) -> Any:
    """The handle of the cluster --name at --address, or None (said on stderr)."""
    from cluster.control.launch import DEFAULT_NAME, get_cluster, init_ray

    name = args.name or DEFAULT_NAME
    try:
        init_ray(args.address)
        return get_cluster(name)
    except (ConnectionError, ValueError) as exc:
        print(f"tandem {command}: no running cluster {name!r} ({exc})", file=sys.stderr)
        return None


def _run_down(args: argparse.Namespace) -> int:
    from cluster.control.launch import DEFAULT_NAME, shutdown_cluster

    name = args.name or DEFAULT_NAME
    handle = _running_cluster(args, "down")
    if handle is None:
        return 1
    shutdown_cluster(handle)
    print(f"cluster {name!r} stopped")
    return 0


def _run_scale(args: argparse.Namespace) -> int:
    import ray

    pool, sep, count = args.target.partition("=")
    if not sep or not pool or not count.isdigit():
        print(f"tandem scale: expected POOL=N, got {args.target!r}", file=sys.stderr)
        return 2
    handle = _running_cluster(args, "scale")
    if handle is None:
        return 1
    try:
        result = ray.get(handle.scale_pool.remote(pool, int(count), args.drain_timeout))
    except ray.exceptions.RayTaskError as exc:
        print(f"tandem scale: {getattr(exc, 'cause', None) or exc}", file=sys.stderr)
        return 1
    except ray.exceptions.RayActorError as exc:
        # Whether the resize happened is not known; POOL=N again is safe (it sets a count).
        what = (
            "could not be reached (it may be restarting)"
            if isinstance(exc, ray.exceptions.ActorUnavailableError)
            else "died during the call"
        )
        print(
            f"tandem scale: the cluster's scheduler {what}: whether {pool} was resized is not "
            f"known; run `tandem scale {args.target}` again once it answers, or see its logs",
            file=sys.stderr,
        )
        return 1
    print(f"pool {result['pool']}: {', '.join(result['instances'])}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    _up_parser(sub)
    _scale_parser(sub)
    _down_parser(sub)
    from cluster.tools.serve_args import add_serve_arguments

    add_serve_arguments(
        sub.add_parser(
            "serve",
            help="serve the OpenAI-compatible API (Ray Serve) on 127.0.0.1:8000",
            description="Start a local Ray, a cluster serving MODEL (default: the built-in "
            "SmolLM2, one prefill and one decode instance; --config for a ClusterConfig file) "
            "and the Serve app: HTTP on :8000, gRPC on :9000. vLLM's engine flags keep their "
            "names (tandem serve MODEL --max-model-len 4096). Runs until Ctrl-C, then shuts "
            "everything down.",
        )
    )
    from cluster.tools.bench_args import add_bench_arguments

    add_bench_arguments(
        sub.add_parser(
            "bench",
            help="load-test an OpenAI-compatible endpoint (TTFT, TPOT, throughput, goodput)",
        )
    )
    from cluster.tools.sim_cli import add_plan_arguments, add_sim_arguments

    add_sim_arguments(sub)
    add_plan_arguments(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.command in ("sim", "plan", "bench", "generate"):
        # Their files (--trace, --out, --plot-dir, a cost model, a model path): missing or not
        # writable is the caller's error, said in a line -- not a traceback (-v: with it, for
        # an OSError that is not about the caller's files).
        try:
            code = _dispatch(args)
            sys.stdout.flush()  # (here: a reader gone shows now, not as Python exits)
            return code
        except BrokenPipeError:  # its output piped to a reader that left (`| head`): done
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
        except OSError as exc:
            if getattr(args, "verbose", False):
                raise
            print(f"tandem {args.command}: {exc}", file=sys.stderr)
            return 2
    return _dispatch(args)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "up":
        return _run_up(args)
    if args.command == "scale":
        return _run_scale(args)
    if args.command == "down":
        return _run_down(args)
    if args.command == "serve":
        from cluster.tools.serve_cli import run_serve

        return run_serve(args)
    if args.command == "sim":
        from cluster.tools.sim_cli import run_sim

        return run_sim(args)
    if args.command == "plan":
        from cluster.tools.sim_cli import run_plan

        return run_plan(args)
    if args.command == "bench":
        from cluster.tools.loadgen import run_bench

        return run_bench(args)
    return run_generate(args)


if __name__ == "__main__":
    sys.exit(main())
