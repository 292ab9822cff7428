"""The control plane's own cost: the real ``SchedulerActor`` + ``EngineLoop`` + ``Scheduler`` of
every instance, driving a null executor (no model: it samples one token per request whose
scheduled tokens reach its end, and a step takes ``--step-ms``), so what is measured is
routing, scheduling, bookkeeping and streaming -- what caps a cluster before its GPUs do.

    python -m bench.control_plane                         # in-process and on Ray, 1 4 16 instances
    python -m bench.control_plane --modes ray --instances 8 --concurrency 128 --step-ms 25
    python -m bench.control_plane --modes client --instances 8 --concurrency 128 --step-ms 25 \
        --async-scheduling                                 # step N+1 scheduled while N runs
    python -m bench.control_plane --quick                 # smoke: 1 and 4 instances, short

Four modes:
- ``inproc``: the actor is a plain object in this process and the clients iterate its
  ``generate`` directly (the control plane alone);
- ``ray``: the actor is a Ray actor on a local one-node Ray (127.0.0.1) and every request is a
  Ray stream of its own (``SchedulerActor.generate``: a Ray message per request per step);
- ``client``: the same actor, and the requests go through one batched ``Subscription`` of this
  driver, as ``ClusterClient`` sends them (``submit`` / ``subscribe``: a Ray message per
  batch, whatever the number of requests in it);
- ``http``: the same actor behind the Serve app (``OpenAIIngress`` replicas, ``--ingress-replicas``,
  and Serve's HTTP proxy) on 127.0.0.1, clients streaming ``/v1/completions`` over HTTP with
  aiohttp from this process. The null model samples a one-character token there, so the
  characters streamed count the tokens. CPU per token is the path's (actor, ingress replicas,
  proxy), the load client's apart.

Per cell (instances x concurrency per instance, closed loop: a finished request is replaced at
once): streamed tokens/s over a measured window after a warm-up, CPU seconds of every process
on the path per streamed token and per instance-step, and the tokens/s as a share of the ideal
(instances x concurrency / step time) when the step has a cost. Admission: a burst of
``--admission-requests`` one-token requests, requests/s from the first submission to the last
completion. Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster.config import ClusterConfig
from cluster.control.heap import relax_collector
from cluster.control.placement import InstanceSpec
from cluster.control.scheduler_actor import SchedulerActor
from scheduler import ModelRunnerOutput, Request, SamplingParams, SchedulerOutput

BLOCK_SIZE = 16
TOKEN = 7  # what the null model samples (not an EOS id)


class NullWorker:
    """What the actor asks an in-process worker outside steps (health)."""

    def health(self) -> dict[str, Any]:
        return {"ok": True, "node_id": None}


ASYNC_SCHEDULING = False  # --async-scheduling
ENGINE_ACTORS = False  # --engine-actors


class NullExecutor:
    """Samples ``token`` for each scheduled request whose tokens reach its known length; a step
    takes ``step_s`` (asyncio sleep: the actor's event loop stays free, as with a GPU). Steps
    run one at a time, in order, as on one device: with async scheduling the next step is
    scheduled while one runs, never run beside it."""

    def __init__(self, step_s: float, token: int = TOKEN) -> None:
        self.step_s = step_s
        self.token = token
        self.worker = NullWorker()
        self.lengths: dict[str, int] = {}  # request id -> tokens known (prompt + sampled)
        self._device = asyncio.Lock()

    async def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        async with self._device:
            return await self._execute(out)

    async def _execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        lengths = self.lengths
        for req_id in out.finished_req_ids:
            lengths.pop(req_id, None)
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            lengths[new.req_id] = len(new.prompt_token_ids)
            computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for req_id, start in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            computed[req_id] = start
        for req_id, tokens in cached.resumed_token_ids.items():
            lengths[req_id] = len(tokens)
        req_ids, sampled = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            req_ids.append(req_id)
            if computed[req_id] + n >= lengths[req_id]:
                lengths[req_id] += 1
                sampled.append([self.token])
            else:
                sampled.append([])
        if self.step_s > 0:
            await asyncio.sleep(self.step_s)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def null_specs(
    config: ClusterConfig,
    num_blocks: int,
    step_s: float,
    model_path: str = "null",
    token: int = TOKEN,
) -> list[InstanceSpec]:
    """``model_path``: what the instances report as their model (an ingress loads its
    tokenizer from it)."""
    info = {
        "max_position_embeddings": 1 << 16,
        "max_context_len": 1 << 16,
        "num_blocks": num_blocks,
        "block_size": BLOCK_SIZE,
        "model_path": model_path,
        "vocab_size": 49152,
        "eos_token_ids": [2],
        "node_id": None,
    }
    pool = config.pools[0]
    return [
        InstanceSpec(f"{pool.name}-{i}", pool, NullExecutor(step_s, token), None, dict(info))
        for i in range(pool.replicas)
    ]


def make_config(instances: int, concurrency: int, **extra: Any) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            **extra,
            "block_size": BLOCK_SIZE,
            "pools": [
                {
                    "name": "null",
                    "role": "both",
                    "replicas": instances,
                    "scheduler": {
                        "max_num_seqs": concurrency,
                        "max_num_batched_tokens": max(2048, concurrency * 2),
                        "async_scheduling": ASYNC_SCHEDULING,
                    },
                }
            ],
            "health_check_interval_s": 0,
            "admission_window_s": 0.0,
            "engine_actors": ENGINE_ACTORS,
        }
    )


@dataclass
class Cell:
    mode: str
    instances: int
    concurrency: int  # per instance
    step_ms: float
    tokens_per_s: float
    ideal_share: float | None
    cpu_us_per_token: float  # every process on the path
    actor_cpu_us_per_token: float
    actor_cpu_us_per_instance_step: float
    engines_cpu_us_per_token: float  # the engine actors' (engine_actors), summed
    engines_cpu_us_per_instance_step: float
    driver_cpu_us_per_token: float  # this process: the ingress's part (client mode)
    num_tokens: int
    num_steps: int
    window_s: float


class Driver:
    """Runs a closed loop of requests against one actor (in-process or a Ray handle)."""

    tokens: int

    def __init__(self, mode: str, actor: Any, prompt_len: int, output_len: int) -> None:
        self.mode, self.actor = mode, actor
        self.subscription: Any = None
        self.prompt = [5] * prompt_len
        self.params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        self.tokens = 0
        self.finished = 0
        self._ids = 0

    def _request(self, params: SamplingParams | None = None) -> Request:
        self._ids += 1
        return Request(f"b{self._ids}", self.prompt, params or self.params)

    async def one(self, params: SamplingParams | None = None) -> None:
        request = self._request(params)
        if self.mode == "inproc":
            async for out in self.actor.generate(request):
                self.tokens += len(out.new_token_ids)
        elif self.mode == "client":
            if self.subscription is None:
                from cluster.control.subscription import Subscription

                self.subscription = Subscription(self.actor, f"bench-{os.getpid()}")
            async for out in self.subscription.stream(request):
                self.tokens += len(out.new_token_ids)
        else:
            async for ref in self.actor.generate.remote(request, None):
                self.tokens += len((await ref).new_token_ids)
        self.finished += 1

    async def closed_loop(self, streams: int, stop: asyncio.Event) -> None:
        async def lane() -> None:
            while not stop.is_set():
                await self.one()

        await asyncio.gather(*(lane() for _ in range(streams)))

    async def call(self, method: str) -> Any:
        if self.mode == "inproc":
            result = getattr(self.actor, method)()
            return await result if asyncio.iscoroutine(result) else result
        return await getattr(self.actor, method).remote()


def _cpu(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


async def measure(
    mode: str,
    actor: Any,
    args: argparse.Namespace,
    instances: int,
    concurrency: int,
    pid: int,
    driver: Any = None,
    path_pids: list[int] | None = None,
) -> Cell:
    """``driver``: the load (default a ``Driver`` of ``mode``); ``path_pids``: the processes
    whose CPU counts (default this one and the actor's)."""
    if driver is None:
        # This process stands for the ingress replica (and, in-process, for the central actor
        # too): its collector is set as theirs is, heap frozen after start-up.
        gc.unfreeze()  # (an earlier cell's actor is garbage now: its pools are cycles)
        gc.collect()
        gc.freeze()
        relax_collector()
    driver = driver or Driver(mode, actor, args.prompt_len, args.output_len)
    stop = asyncio.Event()
    loop_task = asyncio.ensure_future(driver.closed_loop(instances * concurrency, stop))
    await asyncio.sleep(args.warmup_s)
    pids = path_pids or ([os.getpid()] if mode == "inproc" else [os.getpid(), pid])
    stats = Driver(mode, actor, 1, 1).call
    before = await stats("stats")
    engines = sorted({i["engine_pid"] for i in before["instances"].values()} - {pid, os.getpid()})
    pids = pids + engines
    steps0 = _steps(before)
    tokens0, cpu0, actor0, t0 = driver.tokens, _cpu(pids), _cpu([pid]), time.perf_counter()
    engines0, driver0 = _cpu(engines), _cpu([os.getpid()])
    await asyncio.sleep(args.window_s)
    tokens1, cpu1, actor1, t1 = driver.tokens, _cpu(pids), _cpu([pid]), time.perf_counter()
    engines1, driver1 = _cpu(engines), _cpu([os.getpid()])
    steps1 = _steps(await stats("stats"))
    stop.set()
    loop_task.cancel()  # the requests in flight end with the actor's shutdown
    await asyncio.gather(loop_task, return_exceptions=True)
    tokens, steps, window = tokens1 - tokens0, steps1 - steps0, t1 - t0
    ideal = instances * concurrency / (args.step_ms / 1000) if args.step_ms > 0 else None
    rate = tokens / window
    return Cell(
        mode=mode,
        instances=instances,
        concurrency=concurrency,
        step_ms=args.step_ms,
        tokens_per_s=rate,
        ideal_share=None if ideal is None else rate / ideal,
        cpu_us_per_token=(cpu1 - cpu0) / max(tokens, 1) * 1e6,
        actor_cpu_us_per_token=(actor1 - actor0) / max(tokens, 1) * 1e6,
        actor_cpu_us_per_instance_step=(actor1 - actor0) / max(steps, 1) * 1e6,
        engines_cpu_us_per_token=(engines1 - engines0) / max(tokens, 1) * 1e6,
        engines_cpu_us_per_instance_step=(engines1 - engines0) / max(steps, 1) * 1e6,
        driver_cpu_us_per_token=(driver1 - driver0) / max(tokens, 1) * 1e6,
        num_tokens=tokens,
        num_steps=steps,
        window_s=window,
    )


def _steps(stats: dict[str, Any]) -> int:
    return sum(i["num_steps"] for i in stats["instances"].values())


async def admission(mode: str, actor: Any, args: argparse.Namespace) -> float:
    """Requests/s of a burst of one-token requests, submission to last completion."""
    driver = Driver(mode, actor, 16, 1)
    one_token = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    await asyncio.gather(*(driver.one(one_token) for _ in range(args.admission_requests)))
    return args.admission_requests / (time.perf_counter() - start)


async def run_inproc(args: argparse.Namespace, instances: int, concurrency: int) -> Cell:
    config = make_config(instances, concurrency)
    num_blocks = concurrency * -(-(args.prompt_len + args.output_len) // BLOCK_SIZE) + 64
    actor = SchedulerActor(config, null_specs(config, num_blocks, args.step_ms / 1000))
    await actor.start()
    try:
        return await measure("inproc", actor, args, instances, concurrency, os.getpid())
    finally:
        await actor.shutdown()


async def run_ray(args: argparse.Namespace, instances: int, concurrency: int) -> Cell:
    """``ray`` and ``client`` modes (``args.mode``)."""
    import ray

    config = make_config(instances, concurrency)
    num_blocks = concurrency * -(-(args.prompt_len + args.output_len) // BLOCK_SIZE) + 64
    specs = null_specs(config, num_blocks, args.step_ms / 1000)
    handle = ray.remote(SchedulerActor).options(max_concurrency=100_000).remote(config, specs)
    try:
        await handle.start.remote()
        pid = await handle.__ray_call__.remote(lambda self: os.getpid())
        return await measure(args.mode, handle, args, instances, concurrency, pid)
    finally:
        await handle.shutdown.remote()
        ray.kill(handle)


HTTP_APP = "bench-control-plane"


class HttpDriver:
    """A closed loop of streamed ``/v1/completions`` requests over HTTP (aiohttp)."""

    def __init__(self, url: str, model: str, prompt_len: int, output_len: int) -> None:
        self.url, self.tokens, self.finished, self.failed = url, 0, 0, 0
        self.body = {
            "model": model,
            "prompt": [5] * prompt_len,
            "max_tokens": output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }

    async def closed_loop(self, streams: int, stop: asyncio.Event) -> None:
        import aiohttp

        limits = aiohttp.TCPConnector(limit=streams)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=limits, timeout=timeout) as session:

            async def lane() -> None:
                while not stop.is_set():
                    await self._one(session)

            await asyncio.gather(*(lane() for _ in range(streams)))

    async def _one(self, session: Any) -> None:
        async with session.post(f"{self.url}/v1/completions", json=self.body) as response:
            if response.status != 200:
                self.failed += 1
                await response.read()
                return
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                # The null model's token is one character: the text counts the tokens.
                self.tokens += sum(len(c.get("text", "")) for c in chunk["choices"])
        self.finished += 1


def _serve_pids() -> list[int]:
    """The Serve processes on a request's path: the ingress replicas and the HTTP proxy."""
    import psutil

    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or ())
        if f"ServeReplica:{HTTP_APP}:OpenAIIngress" in line or "ProxyActor" in line:
            pids.append(proc.pid)
    return pids


async def run_http(args: argparse.Namespace, instances: int, concurrency: int) -> Cell:
    """The ``ray`` actor behind the Serve app, loaded over HTTP."""
    import ray
    from ray import serve

    from actors.model.loader import builtin_model_path
    from actors.model.tokenizer import Tokenizer
    from cluster.config import served_model_name
    from cluster.control.launch import DEFAULT_NAMESPACE, app_cluster_name
    from cluster.serving.app import build_app_from_config
    from cluster.tools.serve_listen import http_options

    model = builtin_model_path()
    (token,) = Tokenizer.from_path(model).encode("x", add_special_tokens=False)
    serve_section = {
        "port": args.http_port,
        "grpc_port": None,
        "ingress_replicas": args.ingress_replicas,
        "max_ongoing_requests": 100_000,
    }
    config = make_config(instances, concurrency, model=str(model), serve=serve_section)
    num_blocks = concurrency * -(-(args.prompt_len + args.output_len) // BLOCK_SIZE) + 64
    specs = null_specs(config, num_blocks, args.step_ms / 1000, str(model), token)
    handle = (
        ray.remote(SchedulerActor)
        .options(
            name=app_cluster_name(HTTP_APP),
            namespace=DEFAULT_NAMESPACE,
            max_concurrency=100_000,
        )
        .remote(config, specs)
    )
    try:
        await handle.start.remote()
        pid = await handle.__ray_call__.remote(lambda self: os.getpid())
        serve.start(proxy_location="HeadOnly", http_options=http_options(config.serve))
        # The app finds the running cluster by its name (settings equal) and reuses it.
        await asyncio.to_thread(
            serve.run, build_app_from_config(config), name=HTTP_APP, route_prefix="/"
        )
        driver = HttpDriver(
            f"http://127.0.0.1:{args.http_port}",
            served_model_name(config),
            args.prompt_len,
            args.output_len,
        )
        cell = await measure(
            "http", handle, args, instances, concurrency, pid, driver, [pid, *_serve_pids()]
        )
        if driver.failed:
            print(f"http: {driver.failed} requests failed", flush=True)
        return cell
    finally:
        await asyncio.to_thread(serve.delete, HTTP_APP)
        await handle.shutdown.remote()
        ray.kill(handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["inproc", "ray", "client"])
    parser.add_argument("--instances", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--concurrency", type=int, default=256, help="Running per instance.")
    parser.add_argument("--step-ms", type=float, default=0.0)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument("--window-s", type=float, default=5.0)
    parser.add_argument("--admission-requests", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="1 and 4 instances, short windows.")
    parser.add_argument("--ingress-replicas", type=int, default=1, help="http mode.")
    parser.add_argument("--http-port", type=int, default=8123, help="http mode.")
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="schedule step N+1 while step N runs (scheduler.async_scheduling)",
    )
    parser.add_argument(
        "--engine-actors",
        action="store_true",
        help="each instance's engine in a Ray actor of its own (engine_actors; modes client "
        "and http)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    global ASYNC_SCHEDULING, ENGINE_ACTORS
    ASYNC_SCHEDULING = args.async_scheduling
    ENGINE_ACTORS = args.engine_actors
    if args.quick:
        args.instances, args.warmup_s, args.window_s = [1, 4], 1.0, 2.0
        args.admission_requests = 500
    cells: list[Cell] = []
    admissions: dict[str, float] = {}
    ray_started = False
    for mode in args.modes:
        args.mode = mode
        if mode != "inproc" and not ray_started:
            ray_started = True
            from cluster.control.launch import init_ray

            init_ray()
        for n in args.instances:
            runner = {"inproc": run_inproc, "http": run_http}.get(mode, run_ray)
            cells.append(asyncio.run(runner(args, n, args.concurrency)))
            print(_row(cells[-1]), flush=True)
        if mode == "http":
            continue  # admission is the actor's: measured by the other modes
        admissions[mode] = asyncio.run(_admission(mode, args))
        print(f"{mode}: admission {admissions[mode]:,.0f} requests/s", flush=True)
    print(_table(cells, admissions))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "machine": platform.processor() or platform.machine(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "cells": [asdict(c) for c in cells],
            "admission_requests_per_s": admissions,
        }
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


async def _admission(mode: str, args: argparse.Namespace) -> float:
    config = make_config(4, 256)
    specs = null_specs(config, 4096, args.step_ms / 1000)
    if mode == "inproc":
        actor = SchedulerActor(config, specs)
        await actor.start()
        try:
            return await admission(mode, actor, args)
        finally:
            await actor.shutdown()
    import ray

    handle = ray.remote(SchedulerActor).options(max_concurrency=100_000).remote(config, specs)
    try:
        await handle.start.remote()
        return await admission(mode, handle, args)
    finally:
        await handle.shutdown.remote()
        ray.kill(handle)


def _row(c: Cell) -> str:
    ideal = "" if c.ideal_share is None else f"{c.ideal_share:8.2f}"
    return (
        f"{c.mode:7s}{c.instances:10d}{c.concurrency:8d}{c.step_ms:8.1f}{c.tokens_per_s:12,.0f}"
        f"{ideal:>8s}{c.cpu_us_per_token:10.1f}{c.actor_cpu_us_per_token:10.1f}"
        f"{c.actor_cpu_us_per_instance_step:12.0f}{c.engines_cpu_us_per_token:10.1f}"
        f"{c.engines_cpu_us_per_instance_step:13.0f}{c.driver_cpu_us_per_token:10.1f}"
    )


def _table(cells: list[Cell], admissions: dict[str, float]) -> str:
    head = (
        f"{'mode':7s}{'instances':>10s}{'conc':>8s}{'step ms':>8s}{'tokens/s':>12s}{'x ideal':>8s}"
        f"{'us/tok':>10s}{'actor':>10s}{'actor/step':>12s}{'engines':>10s}"
        f"{'engines/step':>13s}{'driver':>10s}"
    )
    lines = [
        "Control plane with a null executor (us/tok: CPU of every process on the path per "
        "streamed token; actor: the SchedulerActor's alone; actor/step: its CPU per instance-step; "
        "engines: the engine actors', with --engine-actors, per token and per instance-step; "
        "driver: this process's, the ingress's part in client mode)",
        head,
        "-" * len(head),
        *(_row(c) for c in cells),
    ]
    lines += [f"admission ({m}): {r:,.0f} requests/s" for m, r in admissions.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
