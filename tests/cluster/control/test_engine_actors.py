"""Engines in processes of their own (``engine_actors``): each instance's scheduler and step
loop run in an ``EngineActor`` beside its workers, and stream tokens straight to the clients;
the central SchedulerActor sees only per-step reports. On a real multi-node
``ray.cluster_utils.Cluster``: P/D output equal to the in-process engine's, aborts at every
stage, metrics merged across processes, pools resized, a worker killed (its requests move), an
engine process killed (its requests move on after the tokens their clients have; with nowhere
to go, they end with an error, never hang)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import RayCluster, assert_clean, wait_until
from tests.cluster.control.helpers import (
    BLOCK_SIZE,
    DECODE,
    NUM_BLOCKS,
    PREFILL,
    cluster_config,
    generate_in_process,
    token_ids,
)
from tests.cluster.control.helpers import random_prompts as _prompts
from tests.cluster.control.helpers import until as _until

ray = pytest.importorskip("ray")

from cluster.control.client import ClusterClient  # noqa: E402
from cluster.control.launch import build_cluster, shutdown_cluster  # noqa: E402
from scheduler import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
TIMEOUT_S = 1.0
# A hung engine: stats and /metrics go on without it after ASK_S, it is killed after PING_S
# (the defaults, 5 s and 10 s, would be most of the hung-engine test's time).
ASK_S, PING_S = 4.0, 8.0


@pytest.fixture(scope="module")
def engines(ray_cluster: RayCluster, tiny_model: Path) -> Iterator[Any]:
    """1 prefill + 2 decode instances, every request disaggregated, each engine an actor."""
    config = cluster_config(
        tiny_model,
        [PREFILL, {**DECODE, "replicas": 2}],
        router={"disaggregation": "always"},
        kv_transfer={"timeout_s": TIMEOUT_S},
        engine_actors=True,
        engine_ask_timeout_s=ASK_S,
        engine_ping_timeout_s=PING_S,
    )
    handle = build_cluster(config, name="engine-actors", namespace="tandem-tests")
    yield handle
    shutdown_cluster(handle)


@pytest.fixture(scope="module")
def client(engines: Any) -> ClusterClient:
    return ClusterClient(engines)


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest, engines: Any) -> Iterator[None]:
    yield
    if request.node.name.startswith("test_a_killed_engine"):
        return  # its own checks: the dead engine's scheduler cannot be asked
    for iid, stats in _instances(engines).items():
        if stats["alive"]:
            ray.get(engines.set_fault_injection.remote(iid, 0.0, 0.0))
    assert_clean(engines)


def _instances(handle: Any) -> dict[str, Any]:
    result: dict[str, Any] = ray.get(handle.stats.remote())["instances"]
    return result


def _live_ids(handle: Any) -> list[str]:
    ids: list[str] = ray.get(handle.live_request_ids.remote())
    return ids


def test_each_engine_runs_in_a_process_of_its_own_beside_its_workers(engines: Any) -> None:
    stats = ray.get(engines.stats.remote())
    health = ray.get(engines.worker_health.remote())
    pids = {iid: s["engine_pid"] for iid, s in stats["instances"].items()}
    assert set(pids) == {"p-0", "d-0", "d-1"}
    assert len(set(pids.values())) == 3 and stats["pid"] not in pids.values()
    for iid, pid in pids.items():
        assert pid != health[iid]["pid"]  # not in the worker either: beside it
    described = ray.get(engines.describe.remote())["instances"]
    assert described["p-0"]["node_id"] != described["d-0"]["node_id"]


def test_disaggregated_output_equals_the_in_process_engine(
    client: ClusterClient, tiny_model: Path
) -> None:
    from cluster.engine.llm import LLM

    prompts = _prompts(16)
    before = _instances(client.handle)
    got = token_ids(client.generate(prompts, GREEDY))
    assert got == generate_in_process(tiny_model, prompts, GREEDY)
    after = _instances(client.handle)
    loads = sum(
        after[i]["num_kv_loads_started"] - before[i]["num_kv_loads_started"] for i in ("d-0", "d-1")
    )
    assert loads == sum(len(t) > 1 for t in got) >= 12  # the KV crossed for each
    assert (
        min(
            after[i]["num_requests_added"] - before[i]["num_requests_added"] for i in ("d-0", "d-1")
        )
        > 0
    )

    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, seed=7, n=3)
    llm = LLM(str(tiny_model), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, progress=False)
    expected = [[s.token_ids for s in o.outputs] for o in llm.generate(prompts[:3], params)]
    sampled = [[s.token_ids for s in o.outputs] for o in client.generate(prompts[:3], params)]
    assert sampled == expected


def test_the_openai_api_streams_from_the_engines(client: ClusterClient, tiny_model: Path) -> None:
    """What the ingress replica runs (``OpenAIServing`` over a ``ClusterClient``; the Kubernetes
    manifests turn engine actors on): a streamed completion's text, sample by sample, equals
    the whole response's and the in-process engine's greedy text."""
    import json

    from cluster.engine.llm import LLM
    from cluster.serving.openai_protocol import CompletionRequest
    from cluster.serving.openai_serving import OpenAIServing

    prompt = _prompts(3, seed=5)[2]
    base = {"model": "tiny", "prompt": prompt, "max_tokens": 9, "temperature": 0, "n": 2}
    serving = OpenAIServing(client, "tiny")

    async def run() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        whole = await serving.completion(CompletionRequest.model_validate(base))
        chunks = await serving.completion(
            CompletionRequest.model_validate({**base, "stream": True})
        )
        lines = [line async for line in chunks]
        assert lines[-1] == "data: [DONE]\n\n"
        return whole, [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]

    whole, chunks = asyncio.run(asyncio.wait_for(run(), 120))
    streamed = ["", ""]
    for chunk in chunks:
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["text"]
    llm = LLM(str(tiny_model), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, progress=False)
    expected = llm.generate([prompt], SamplingParams(max_tokens=9, temperature=0))[0]
    assert [c["text"] for c in whole["choices"]] == [expected.outputs[0].text] * 2
    assert streamed == [expected.outputs[0].text] * 2
    assert whole["usage"]["completion_tokens"] == 2 * len(expected.outputs[0].token_ids)


def test_first_token_from_the_prefill_engine_then_the_decode_engines(
    client: ClusterClient,
) -> None:
    prompt = _prompts(1, seed=3)[0] + [9] * 20
    params = GREEDY.model_copy(update={"ignore_eos": True})

    async def run() -> list[list[int]]:
        return [
            list(out.outputs[0].new_token_ids)
            async for out in client.generate_async(prompt, params)
            if out.outputs[0].new_token_ids
        ]

    deltas = asyncio.run(run())
    assert len(deltas[0]) == 1  # the prefill engine's token, in its own batch
    assert sum(map(len, deltas)) == GREEDY.max_tokens and len(deltas) > 2


async def _collect(client: ClusterClient, prompt: list[int], params: SamplingParams) -> Any:
    final = None
    async for out in client.generate_async(prompt, params):
        final = out
    return final


def test_abort_while_queued_prefilling_transferring_and_decoding(
    engines: Any, client: ClusterClient
) -> None:
    ray.get(engines.set_fault_injection.remote("p-0", 0.0, 0.5))  # each prefill step +0.5 s
    steps = _instances(engines)["p-0"]["num_steps"]

    async def prefilling() -> list[Any]:
        first = asyncio.ensure_future(_collect(client, _prompts(1, 1)[0] + [5] * 8, GREEDY))
        await _until(lambda: _instances(engines)["p-0"]["num_steps"] > steps)
        second = asyncio.ensure_future(_collect(client, [7, 8, 9, 10], GREEDY))
        await _until(lambda: len(_live_ids(engines)) == 2)
        for rid in _live_ids(engines):
            assert ray.get(engines.abort.remote(rid))
        return [await first, await second]

    for out in asyncio.run(prefilling()):
        assert out.outputs[0].finish_reason == "abort"
    ray.get(engines.set_fault_injection.remote("p-0", 0.0, 0.0))
    assert_clean(engines)

    for iid in ("d-0", "d-1"):  # loads slowed, within the deadline
        ray.get(engines.set_fault_injection.remote(iid, TIMEOUT_S / 2, 0.0))

    async def transferring() -> Any:
        task = asyncio.ensure_future(_collect(client, _prompts(1, 2)[0] + [4] * 30, GREEDY))
        await _until(
            lambda: sum(s["num_waiting_for_remote_kvs"] for s in _instances(engines).values()) == 1
        )
        (rid,) = _live_ids(engines)
        assert ray.get(engines.abort.remote(rid))
        return await task

    out = asyncio.run(transferring())
    assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) == 1
    for iid in ("d-0", "d-1"):
        ray.get(engines.set_fault_injection.remote(iid, 0.0, 0.0))
    assert_clean(engines)

    async def decoding() -> Any:
        got = 0
        async for out in client.generate_async(_prompts(1, 4)[0], LONG, request_id="dec"):
            got += len(out.outputs[0].new_token_ids)
            if got >= 5 and not out.finished:
                client.abort("dec")
            if out.finished:
                return out
        raise AssertionError("the stream ended without a final output")

    out = asyncio.run(decoding())
    assert out.outputs[0].finish_reason == "abort"
    assert 5 <= len(out.outputs[0].token_ids) < 400


def test_an_abort_right_after_generate_and_a_client_that_leaves(client: ClusterClient) -> None:
    async def run() -> tuple[Any, int]:
        stream = client.generate_async(_prompts(1, 5)[0], LONG, request_id="now")
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # submitted with this turn of the loop
        client.abort("now")
        out = await first
        while not out.finished:
            out = await stream.__anext__()
        seen = 0
        async for part in client.generate_async(_prompts(1, 6)[0], LONG):
            seen = len(part.outputs[0].token_ids)
            if seen >= 3:
                break  # leaves: the request is aborted on the cluster
        return out, seen

    out, seen = asyncio.run(run())
    assert out.outputs[0].finish_reason == "abort" and seen >= 3


def test_a_stream_read_to_its_end_sends_no_abort(client: ClusterClient) -> None:
    """Regression: a consumer that stops at the final output closed the request's stream at
    its last ``yield``, which took it for a consumer leaving early and sent an abort (one
    Ray call per finished request)."""

    async def run() -> list[str]:
        sub = client._subscription()
        aborts: list[str] = []
        original = sub.abort

        def spy(request_id: str) -> None:
            aborts.append(request_id)
            original(request_id)

        sub.abort = spy  # type: ignore[method-assign]
        async for _ in client.generate_async(_prompts(1, 15)[0], GREEDY):
            pass
        return aborts

    assert asyncio.run(run()) == []


def test_metrics_of_every_engine_in_one_exposition(client: ClusterClient) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    client.generate(_prompts(4, seed=9), GREEDY)
    text = asyncio.run(client.metrics_text())
    helps = [line.split()[2] for line in text.splitlines() if line.startswith("# HELP")]
    assert len(helps) == len(set(helps))  # each family once
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ttft = families["tandem:time_to_first_token_seconds"]
    counts = {s.labels["instance"]: s.value for s in ttft.samples if s.name.endswith("_count")}
    assert counts["p-0"] >= 4  # the prefill engine sampled the first tokens (its registry)
    finished = families["tandem:request_success"]
    by_instance: dict[str, float] = {}
    for s in finished.samples:
        if s.name.endswith("_total"):
            iid = s.labels["instance"]
            by_instance[iid] = by_instance.get(iid, 0.0) + s.value
    assert by_instance["d-0"] + by_instance["d-1"] >= 4  # ended on the decode engines
    gauges = families["tandem:kv_cache_usage_perc"]
    assert {s.labels["instance"] for s in gauges.samples} == {"p-0", "d-0", "d-1"}


def test_operators_see_where_requests_are(client: ClusterClient) -> None:
    async def run() -> dict[str, Any]:
        live: dict[str, Any] = {}
        async for out in client.generate_async(_prompts(1, 10)[0], LONG, request_id="ops"):
            if not live and len(out.outputs[0].token_ids) >= 3:
                live = await client.live_requests()
                client.abort("ops")
        return live

    live = asyncio.run(run())
    assert live["ops"]["instance"] in ("d-0", "d-1") and live["ops"]["phase"] == "decode"
    assert live["ops"]["num_tokens_sent"] >= 3


def test_a_pool_grows_and_shrinks_under_load(
    engines: Any, client: ClusterClient, tiny_model: Path
) -> None:
    prompts = _prompts(6, seed=12)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = generate_in_process(tiny_model, prompts, params)

    async def grow_while_subscribed() -> tuple[list[Any], dict[str, Any]]:
        # This loop's client is subscribed before the pool grows: it learns of the new
        # engine from the central actor's notice (not from subscribing after it).
        first = await _collect(client, prompts[0], params)
        resized = await client.scale_pool("d", 3)
        rest = [_collect(client, p, params) for p in prompts[1:]]
        return [first, *await asyncio.gather(*rest)], resized

    outs, resized = asyncio.run(asyncio.wait_for(grow_while_subscribed(), 120))
    assert resized["instances"] == ["d-0", "d-1", "d-2"]
    assert token_ids(outs) == expected
    assert _instances(engines)["d-2"]["num_requests_added"] > 0  # a new engine streamed too
    ray.get(engines.set_fault_injection.remote("d-2", 0.0, 0.02))

    async def shrink_under_load() -> tuple[list[Any], dict[str, Any]]:
        tasks = [asyncio.ensure_future(_collect(client, p, params)) for p in prompts]
        await _until(lambda: _instances(engines)["d-2"]["num_running"] > 0)
        resized = await client.scale_pool("d", 2)
        return list(await asyncio.gather(*tasks)), resized

    outs, resized = asyncio.run(shrink_under_load())
    assert resized["instances"] == ["d-0", "d-1"]
    assert token_ids(outs) == expected  # the drained engine's requests finished
    assert set(_instances(engines)) == {"p-0", "d-0", "d-1"}

    # No time to drain: what the leaving engine holds moves (its last reports applied
    # first), and every request still ends with the undisturbed output.
    # (A new instance never takes a removed one's name: d-3, not d-2 again.)
    assert asyncio.run(client.scale_pool("d", 3))["instances"] == ["d-0", "d-1", "d-3"]
    ray.get(engines.set_fault_injection.remote("d-3", 0.0, 0.02))

    async def shrink_at_once() -> list[Any]:
        tasks = [asyncio.ensure_future(_collect(client, p, params)) for p in prompts]
        await _until(lambda: _instances(engines)["d-3"]["num_running"] > 0)
        await engines.scale_pool.remote("d", 2, 0.0)
        return list(await asyncio.gather(*tasks))

    outs = asyncio.run(asyncio.wait_for(shrink_at_once(), 120))
    assert token_ids(outs) == expected
    assert ray.get(engines.stats.remote())["num_moves"] > 0
    assert set(_instances(engines)) == {"p-0", "d-0", "d-1"}
    from kv_transfer.nixl_transport import nixl_available

    if nixl_available():  # (transport auto) the removed workers' agents are forgotten
        assert ray.get(engines.worker_health.remote())["p-0"]["kv_transport"] == "nixl"
        wait_until(
            lambda: all(
                h["kv_peers"] == 2 for h in ray.get(engines.worker_health.remote()).values()
            ),
            10,
            "every worker to know only the other two",
        )


def test_the_central_scheduler_killed_mid_stream_comes_back(
    engines: Any, client: ClusterClient, tiny_model: Path
) -> None:
    """Ray restarts the killed SchedulerActor; meanwhile the engines go on streaming, and the
    new one rebuilds its state from them: requests queued, prefilling, transferring and
    decoding at the kill all complete with the undisturbed output, and new requests are
    served again."""
    prompts = _prompts(8, seed=16)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = generate_in_process(tiny_model, prompts, params)
    ray.get(engines.set_fault_injection.remote("p-0", 0.0, 0.2))
    for iid in ("d-0", "d-1"):
        ray.get(engines.set_fault_injection.remote(iid, TIMEOUT_S / 4, 0.03))
    first_pid = ray.get(engines.stats.remote())["pid"]

    async def run() -> tuple[list[Any], dict[str, Any], float, Any]:
        tasks = []
        for prompt in prompts:  # staggered: some decode, some wait behind the slow prefill
            tasks.append(asyncio.ensure_future(_collect(client, prompt, params)))
            await asyncio.sleep(0.1)
        await _until(
            lambda: sum(s["num_running"] for i, s in _instances(engines).items() if i != "p-0") > 0
        )
        live = await client.live_requests()
        ray.kill(engines, no_restart=False)
        killed = time.monotonic()
        new = await _collect(client, [5, 6, 7, 8], GREEDY)
        served_s = time.monotonic() - killed
        done = await asyncio.gather(*tasks)
        return list(done), live, served_s, new

    outs, live, served_s, new = asyncio.run(asyncio.wait_for(run(), 120))
    phases = {r["phase"] for r in live.values()}
    assert "decode" in phases and phases & {"queued", "prefill", "transfer"}, phases
    assert token_ids(outs) == expected  # nothing lost, repeated or reordered
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert new.outputs[0].finish_reason in ("length", "stop")
    assert served_s < 30  # bounded (the target, 5 s, is measured in bench/recovery.py)
    stats = ray.get(engines.stats.remote())
    assert stats["pid"] != first_pid  # a new process
    assert set(stats["instances"]) == {"p-0", "d-0", "d-1"}


def test_a_central_scheduler_killed_before_the_decode_engine_confirmed_a_hand_off(
    engines: Any, client: ClusterClient, tiny_model: Path
) -> None:
    """The prefill engine keeps its prefilled copy until a report of the decode engine shows
    the request received (``HandOffs``): a central scheduler killed in between finds the
    request on both after its restart, keeps the decoding one, and the stream completes with
    the undisturbed output, nothing left behind. A worker the dead process had started for
    an instance it never finished (no engine yet) is killed by the restarted one."""
    from cluster.control.placement import worker_actor_prefix

    orphan_name = f"{worker_actor_prefix(engines._actor_id.hex())}d-99/0"
    orphan = _Idle.options(name=orphan_name, namespace="tandem-tests", lifetime="detached")
    ray.get(orphan.remote().ping.remote())
    prompt = _prompts(3, seed=17)[2]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (expected,) = generate_in_process(tiny_model, [prompt], params)
    for iid in ("d-0", "d-1"):
        ray.get(engines.set_fault_injection.remote(iid, 0.0, 1.5))  # reports 1.5 s apart
    first_pid = ray.get(engines.stats.remote())["pid"]

    def copy_kept_while_decoding() -> bool:
        stats = _instances(engines)
        decoding = any(stats[i]["num_requests"] for i in ("d-0", "d-1"))
        return decoding and stats["p-0"]["num_awaiting_hand_off"] == 1

    def rebuilt() -> bool:  # a new process that answers stats: its rebuild is done
        with contextlib.suppress(ray.exceptions.RayError):
            return bool(ray.get(engines.stats.remote())["pid"] != first_pid)
        return False

    async def run() -> Any:
        task = asyncio.ensure_future(_collect(client, prompt, params))
        await _until(copy_kept_while_decoding)
        ray.kill(engines, no_restart=False)
        # The slow steps kept the request decoding until the rebuild (stats waits for it)
        # found it on both engines: what is left of it may decode at full speed.
        await _until(rebuilt, 60)
        for iid in ("d-0", "d-1"):
            await asyncio.to_thread(ray.get, engines.set_fault_injection.remote(iid, 0.0, 0.0))
        return await asyncio.wait_for(task, 60)

    out = asyncio.run(run())
    assert out.outputs[0].token_ids == expected and out.outputs[0].finish_reason == "length"

    def orphan_gone() -> bool:
        names = ray.util.list_named_actors(all_namespaces=True)
        return not any(a["name"] == orphan_name for a in names)

    wait_until(orphan_gone, 10, "the orphan worker killed")


def test_a_drain_begun_before_a_central_restart_goes_on_after_it(
    engines: Any, client: ClusterClient, tiny_model: Path
) -> None:
    """A pool shrinking when the central scheduler dies: the engine it was draining says so
    in its snapshot, and the restarted scheduler finishes the drain -- the engine's requests
    complete, then it leaves the pool (else it would stay, out of routing, for ever)."""
    prompts = _prompts(6, seed=19)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    expected = generate_in_process(tiny_model, prompts, params)
    grown = asyncio.run(client.scale_pool("d", 3))["instances"]
    (new,) = set(grown) - {"d-0", "d-1"}
    ray.get(engines.set_fault_injection.remote(new, 0.0, 0.05))

    async def run() -> list[Any]:
        tasks = [asyncio.ensure_future(_collect(client, p, params)) for p in prompts]
        await _until(lambda: _instances(engines)[new]["num_running"] > 0)
        await engines.scale_pool.remote("d", 2, None, False)  # the drain begins, no wait
        await _until(lambda: _instances(engines)[new]["draining"])
        assert _instances(engines)[new]["num_running"] > 0  # the kill falls in the drain
        ray.kill(engines, no_restart=False)
        return list(await asyncio.gather(*tasks))

    outs = asyncio.run(asyncio.wait_for(run(), 120))
    assert token_ids(outs) == expected  # (streamed from the engines: it may still restart)

    def left() -> bool:
        try:
            return set(_instances(engines)) == {"p-0", "d-0", "d-1"}
        except ray.exceptions.RayActorError:  # still restarting (ActorUnavailableError)
            return False

    wait_until(left, 60, f"{new}, drained, to leave after the restart")


@ray.remote(num_cpus=0)
class _Idle:
    """Stands for a worker whose instance's start was cut short."""

    def ping(self) -> bool:
        return True


def test_lora_adapters_loaded_at_run_time_survive_a_central_restart(
    ray_cluster: RayCluster, tiny_model: Path, tmp_path: Path
) -> None:
    """The engines keep the central actor's LoRA registry: after a restart, an adapter loaded
    at run time is still served by name, with its output unchanged, and the next one loaded
    gets a new id (regression: the ids began again at 1, so a new adapter took the id of one
    the workers still held, and its requests ran with the other adapter's weights)."""
    from tests.cluster.conftest import make_adapter

    first = make_adapter(tiny_model, tmp_path / "first", seed=3)
    second = make_adapter(tiny_model, tmp_path / "second", seed=4)
    config = cluster_config(
        tiny_model,
        [{"name": "c", "role": "both", "num_blocks": NUM_BLOCKS}],
        engine_actors=True,
        lora={"max_loras": 2, "max_lora_rank": 16},
    )
    handle = build_cluster(config, name="engine-actors-lora", namespace="tandem-tests")
    try:
        client = ClusterClient(handle)
        prompt = [5, 9, 13, 17, 21, 25]

        async def run(lora: Any) -> list[int]:
            final = None
            async for out in client.generate_async(prompt, GREEDY, lora_request=lora):
                final = out
            assert final is not None
            tokens: list[int] = final.outputs[0].token_ids
            return tokens

        async def scenario() -> None:
            loaded = await client.load_lora_adapter("first", first)
            before = await run(loaded)
            assert before != await run(None)  # the adapter changes the output
            pid = (await handle.stats.remote())["pid"]
            ray.kill(handle, no_restart=False)

            def restarted() -> bool:
                try:
                    return bool(ray.get(handle.stats.remote())["pid"] != pid)
                except ray.exceptions.ActorUnavailableError:
                    return False  # restarting

            await _until(restarted, 60)
            adapters = await client.lora_adapters()
            assert adapters["first"].lora_int_id == loaded.lora_int_id
            assert await run(adapters["first"]) == before
            new = await client.load_lora_adapter("second", second)
            assert new.lora_int_id != loaded.lora_int_id
            assert await run(new) != before  # its own weights, not the first adapter's

        asyncio.run(asyncio.wait_for(scenario(), 180))
        assert_clean(handle)
    finally:
        shutdown_cluster(handle)


def test_a_killed_worker_moves_its_requests_to_another_engine(
    engines: Any, client: ClusterClient, tiny_model: Path
) -> None:
    prompts = _prompts(4, seed=13)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    expected = generate_in_process(tiny_model, prompts, params)
    for iid in ("d-0", "d-1"):
        ray.get(engines.set_fault_injection.remote(iid, 0.0, 0.03))

    async def run() -> list[Any]:
        tasks = [asyncio.ensure_future(_collect(client, p, params)) for p in prompts]
        await _until(lambda: _instances(engines)["d-0"]["num_running"] > 0)
        pid = ray.get(engines.worker_health.remote())["d-0"]["pid"]
        os.kill(pid, signal.SIGKILL)
        return list(await asyncio.gather(*tasks))

    outs = asyncio.run(asyncio.wait_for(run(), 120))
    assert token_ids(outs) == expected  # nothing lost or repeated across the move
    stats = ray.get(engines.stats.remote())
    assert stats["num_moves"] >= 1 and not stats["instances"]["d-0"]["alive"]


def _refilled(handle: Any) -> int:
    return sum(i.get("num_refilled", 0) for i in _instances(handle).values())


def test_a_stream_that_breaks_while_its_engine_lives_goes_on_without_a_move(
    engines: Any, client: ClusterClient, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each decode engine's stream to the client breaks mid-stream, losing a batch of
    tokens, while the engines live: the client streams from them again, carrying the
    positions it has, and they send the lost tokens again -- output equal to the
    undisturbed one, no request moved or recomputed. The engines do not answer the
    client's ping at first: only Ray saying an engine died, or the central scheduler
    declaring it dead, ends a client's stream from it (it stopped following for good)."""
    from cluster.control import delivery

    decodes = [i for i, s in _instances(engines).items() if s["alive"] and i.startswith("d")]
    for iid in decodes:
        ray.get(engines.set_fault_injection.remote(iid, 0.0, 0.03))
    prompts = _prompts(6, seed=17)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = generate_in_process(tiny_model, prompts, params)
    moves = ray.get(engines.stats.remote())["num_moves"]
    refilled = _refilled(engines)
    handles = ray.get(engines.engine_handles.remote())
    seen: dict[int, int] = {}

    async def collect(i: int) -> Any:
        final = None
        async for out in client.generate_async(prompts[i], params, request_id=f"br{i}"):
            seen[i] = len(out.outputs[0].token_ids)
            final = out
        return final

    async def run() -> list[Any]:
        tasks = [asyncio.ensure_future(collect(i)) for i in range(len(prompts))]
        await _until(lambda: len(seen) == len(prompts) and min(seen.values()) >= 3)
        for iid in decodes:  # the next batch each sends this client is lost, and for a
            # moment the engine does not answer the client's ping (not known dead either)
            await handles[iid].break_streams.remote(None, 2 * delivery.RESUME_WAIT_S)
        return list(await asyncio.gather(*tasks))

    monkeypatch.setattr(delivery, "RESUME_WAIT_S", 0.5)
    outs = asyncio.run(asyncio.wait_for(run(), 120))
    assert token_ids(outs) == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    stats = ray.get(engines.stats.remote())
    assert stats["num_moves"] == moves  # nothing moved: the engines went on
    assert all(stats["instances"][iid]["alive"] for iid in decodes)
    assert _refilled(engines) > refilled  # the lost tokens came again


def test_a_first_token_lost_with_the_prefill_engines_stream_comes_again(
    engines: Any, client: ClusterClient, tiny_model: Path
) -> None:
    """The prefill engine's stream breaks with the request's first token in the lost
    batch, while the request moves on to a decode engine: the client asks the engines
    again for what comes before the outputs it holds back, and the stream is whole."""
    prompts = _prompts(3, seed=18)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = generate_in_process(tiny_model, prompts, params)
    refilled = _refilled(engines)
    handles = ray.get(engines.engine_handles.remote())
    for prompt, want in zip(prompts, expected, strict=True):
        ray.get(handles["p-0"].break_streams.remote())  # its next batch: the first token
        assert token_ids(client.generate([prompt], params)) == [want]
    assert _refilled(engines) >= refilled + len(prompts)


def _two_slow_decode_engines(engines: Any, client: ClusterClient) -> str:
    """Two live decode instances (a dead one replaced), each step slowed so streams last;
    returns the newer one (the one a test takes down)."""
    live = asyncio.run(client.scale_pool("d", 2))["instances"]
    for iid in live:
        ray.get(engines.set_fault_injection.remote(iid, 0.0, 0.03))
    return str(live[-1])


def test_the_requests_of_a_killed_engine_process_move_on(
    engines: Any, client: ClusterClient, tiny_model: Path
) -> None:
    """An engine process dies mid-stream, with tokens of its requests already at the
    client: the client says which tokens each has, and they move to the other engine after
    them -- output equal to the undisturbed one, nothing lost or repeated. A resize then
    replaces the dead instance, and nothing is left anywhere."""
    victim = _two_slow_decode_engines(engines, client)
    prompts = _prompts(6, seed=15)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    expected = generate_in_process(tiny_model, prompts, params)
    moves = ray.get(engines.stats.remote())["num_moves"]
    seen: dict[str, int] = {}

    async def collect(i: int) -> Any:
        final = None
        async for out in client.generate_async(prompts[i], params, request_id=f"mv{i}"):
            seen[f"mv{i}"] = len(out.outputs[0].token_ids)
            final = out
        return final

    def streaming_on_victim() -> bool:  # a request there whose client has tokens from it
        where = ray.get(engines.requests.remote())
        return any(r["instance"] == victim and seen.get(rid, 0) >= 5 for rid, r in where.items())

    async def run() -> list[Any]:
        tasks = [asyncio.ensure_future(collect(i)) for i in range(len(prompts))]
        await _until(streaming_on_victim)
        os.kill(_instances(engines)[victim]["engine_pid"], signal.SIGKILL)
        return list(await asyncio.gather(*tasks))

    central = engines._actor_id.hex()
    workers = [
        e["name"]
        for e in ray.util.list_named_actors(all_namespaces=True)
        if e["name"].startswith(f"tandem-worker/{central}/{victim}/")
    ]
    assert workers  # (the check of their end below can fail)
    outs = asyncio.run(asyncio.wait_for(run(), 120))
    assert token_ids(outs) == expected  # resumed after the tokens the client had
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    stats = ray.get(engines.stats.remote())
    assert stats["num_moves"] > moves and not stats["instances"][victim]["alive"]
    assert "died" in stats["failures"][-1]["reason"]

    # Its workers stop once the reads of their KV had their lease (they held their node's
    # resources for as long as Ray ran: nothing serves with them again).
    def workers_gone() -> bool:
        names = {e["name"] for e in ray.util.list_named_actors(all_namespaces=True)}
        return not names & set(workers)

    wait_until(workers_gone, 30, "the dead engine's workers to stop")
    resized = asyncio.run(client.scale_pool("d", 2))["instances"]
    assert victim not in resized and len(resized) == 2
    assert token_ids(client.generate(prompts[:2], params)) == expected[:2]


def test_a_hung_engine_holds_up_neither_operators_nor_its_requests(
    engines: Any, client: ClusterClient, tiny_model: Path
) -> None:
    """An engine process that stops without dying (SIGSTOP): stats and ``/metrics`` answer
    without it within seconds; its ping goes unanswered, so it is killed and its requests
    move on with the tokens their clients have -- output equal to the undisturbed one."""
    victim = _two_slow_decode_engines(engines, client)
    prompts = _prompts(4, seed=17)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    expected = generate_in_process(tiny_model, prompts, params)
    pid = _instances(engines)[victim]["engine_pid"]

    def on_victim() -> bool:
        return any(r["instance"] == victim for r in ray.get(engines.requests.remote()).values())

    stopped: list[float] = []

    async def run() -> tuple[list[Any], dict[str, Any], float, str]:
        tasks = [asyncio.ensure_future(_collect(client, p, params)) for p in prompts]
        await _until(on_victim)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(time.time())
        try:
            await asyncio.sleep(0.5)
            start = time.monotonic()
            stats = await asyncio.to_thread(client.stats)
            text = await client.metrics_text()
            asked_s = time.monotonic() - start
            return list(await asyncio.gather(*tasks)), stats, asked_s, text
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    outs, stats, asked_s, text = asyncio.run(asyncio.wait_for(run(), 120))
    assert asked_s < 2 * ASK_S + 3  # stats, then /metrics: each without it
    assert "unresponsive" in stats["instances"][victim] or "dead" in stats["instances"][victim]
    assert "tandem:kv_cache_usage_perc" in text
    assert token_ids(outs) == expected
    after = ray.get(engines.stats.remote())
    assert "died" in after["instances"][victim]["dead"]
    (failed,) = [f for f in after["failures"] if f["instance_id"] == victim]
    assert failed["time"] - stopped[0] < PING_S + 3  # its ping's timeout: not the default 10 s
    assert victim not in asyncio.run(client.scale_pool("d", 2))["instances"]


def test_a_stop_sent_to_an_engine_that_dies_before_it_answers_ends_as_stop(
    engines: Any, client: ClusterClient
) -> None:
    """A client's stop (a stop string it found) goes to an engine that hangs and then dies
    before it answers: the central actor ends the request for it -- as ``stop``, as the
    client asked (it was ended as ``abort``, so metrics and goodput counted it aborted)."""
    from scheduler.request import FinishReason

    _two_slow_decode_engines(engines, client)
    seen: list[int] = []

    async def collect() -> Any:
        final = None
        async for out in client.generate_async(_prompts(1, 21)[0], LONG, request_id="st0"):
            seen.append(len(out.outputs[0].token_ids))
            final = out
        return final

    def decoding() -> str | None:  # the decode instance st0 streams from
        where = ray.get(engines.requests.remote()).get("st0")
        on_d = where is not None and where["instance"].startswith("d-")
        return where["instance"] if on_d and seen else None

    async def run() -> tuple[Any, str]:
        task = asyncio.ensure_future(collect())
        await _until(decoding)
        victim = decoding()
        assert victim is not None
        pid = _instances(engines)[victim]["engine_pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.to_thread(ray.get, engines.abort.remote("st0", FinishReason.STOP))
            # then the plain abort its client's stream sends as it closes: still a stop
            await asyncio.to_thread(ray.get, engines.abort.remote("st0"))
            await asyncio.sleep(0.3)  # the stop is on its way to the hung engine
        finally:
            os.kill(pid, signal.SIGKILL)
        return await asyncio.wait_for(task, 60), victim

    out, victim = asyncio.run(asyncio.wait_for(run(), 120))
    assert out.outputs[0].finish_reason == "stop"
    assert "died" in ray.get(engines.stats.remote())["instances"][victim]["dead"]
    assert victim not in asyncio.run(client.scale_pool("d", 2))["instances"]


def test_a_killed_engine_process_with_no_engine_left_ends_its_requests_with_an_error(
    engines: Any, client: ClusterClient
) -> None:
    """The last decode instance's engine process dies mid-stream: with nowhere to move,
    its requests end with an error naming it (no hang), the instance leaves routing, a new
    request is refused clearly, and the prefill side is left clean. A request prefilling
    meanwhile ends with an error at its hand-off, and its KV, kept for a read that will not
    come, is released at once, not left to its lease's expiry."""
    (last,) = asyncio.run(client.scale_pool("d", 1))["instances"]
    ray.get(engines.set_fault_injection.remote(last, 0.0, 0.03))
    health = ray.get(engines.worker_health.remote())["p-0"]
    leased = health["kv_transport"] in ("nixl", "grpc")  # (ray copies the KV out: no lease)
    expired = health["kv_leases_expired"]

    async def run() -> tuple[Any, Any, Any]:
        task = asyncio.ensure_future(_collect(client, _prompts(1, 14)[0], LONG))
        await _until(lambda: _instances(engines)[last]["num_running"] > 0)
        await asyncio.to_thread(ray.get, engines.set_fault_injection.remote("p-0", 0.0, 1.5))
        prefilling = asyncio.ensure_future(_collect(client, _prompts(1, 15)[0], GREEDY))
        await _until(lambda: _instances(engines)["p-0"]["num_running"] > 0)
        os.kill(_instances(engines)[last]["engine_pid"], signal.SIGKILL)
        await _until(lambda: not _instances(engines)[last]["alive"])  # (0.02 s here)
        assert not prefilling.done()  # its hand-off comes after: no decode instance left
        # The steps after this one (the release's) at full speed: well within the lease.
        await asyncio.to_thread(ray.get, engines.set_fault_injection.remote("p-0", 0.0, 0.0))
        out = await asyncio.wait_for(task, 30)
        handed = await asyncio.wait_for(prefilling, 30)
        try:
            after = await _collect(client, [5, 6, 7], GREEDY)
        except Exception as exc:
            after = exc
        return out, handed, after

    out, handed, after = asyncio.run(run())
    assert out.outputs[0].finish_reason == "error"
    assert f"engine process of instance {last} died" in (out.outputs[0].error or "")
    assert handed.outputs[0].finish_reason == "error"
    assert len(handed.outputs[0].token_ids) == 1  # the prefill instance's token, then the error
    assert "no live decode instance to continue" in (handed.outputs[0].error or "")
    assert isinstance(after, Exception) or after.outputs[0].finish_reason == "error"
    assert "no live decode" in str(
        after if isinstance(after, Exception) else after.outputs[0].error
    )
    wait_until(lambda: not ray.get(engines.live_request_ids.remote()), 10, "no flight left")

    def prefill_clean() -> bool:  # (its engine kept the prefilled copy for ever: drains
        prefill = _instances(engines)["p-0"]  # of p-0 then waited out their timeout)
        return (
            prefill["kv_cache_usage"] == 0.0
            and prefill["num_requests"] == 0
            and prefill["num_awaiting_hand_off"] == 0
        )

    wait_until(prefill_clean, 10, "p-0's requests gone and blocks free")
    if leased:
        health = ray.get(engines.worker_health.remote())["p-0"]
        assert health["kv_leases_expired"] == expired  # released, not run out
    # A report of the dead engine still on its way (a rejoin after a worker recovery) does
    # not bring it back into routing, where its ops would be dropped and requests hang.
    from cluster.control.engine_reports import EngineReport
    from cluster.control.summaries import EngineSummary

    late = EngineReport(last, EngineSummary(last, 0, 0, 0, 0, 0.0), rejoined=True)
    ray.get(engines.report.remote(late))
    time.sleep(3.0)  # (a rejoin connects the KV peers first: about a second here)

    async def again() -> Any:
        try:
            return await asyncio.wait_for(_collect(client, [5, 6, 7], GREEDY), 10)
        except Exception as exc:
            return exc

    refused = asyncio.run(again())
    assert "no live decode" in str(
        refused if isinstance(refused, Exception) else refused.outputs[0].error
    )
