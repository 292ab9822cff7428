"""Tracing with engine actors (``engine_actors`` + ``tracing``): one trace across the central
actor and both engines, each engine's spans made in its own process as the root's children;
and a central actor killed while traced requests decode makes their root spans again, with
their first ids. One traced P/D cluster with engine actors for the module (its own file: it
is built after test_engine_actors' cluster is gone, and does not idle beside that module's
timing-sensitive kill tests); each test reads only its own traces at the receiver."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import (
    PD_SPAN_NAMES,
    RayCluster,
    assert_clean,
    span_attributes,
    wait_until,
)
from tests.cluster.control.helpers import (
    DECODE,
    PREFILL,
    cluster_config,
    generate_in_process,
)
from tests.cluster.control.helpers import random_prompts as _prompts
from tests.cluster.control.helpers import until as _until

ray = pytest.importorskip("ray")

from cluster.control.client import ClusterClient  # noqa: E402
from cluster.control.launch import build_cluster, shutdown_cluster  # noqa: E402
from scheduler import SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def traced(ray_cluster: RayCluster, tiny_model: Path) -> Iterator[tuple[Any, Any]]:
    """An OTLP receiver and a traced P/D cluster with engine actors exporting to it."""
    from tests.cluster.conftest import OTLPReceiver

    receiver = OTLPReceiver()
    config = cluster_config(
        tiny_model,
        [PREFILL, DECODE],
        router={"disaggregation": "always"},
        engine_actors=True,
        tracing={"enabled": True, "otlp_endpoint": receiver.endpoint, "export_delay_ms": 100},
    )
    try:
        handle = build_cluster(config, name="engine-actors-traced", namespace="tandem-tests")
        try:
            yield receiver, handle
        finally:
            shutdown_cluster(handle)
    finally:
        receiver.stop()


@pytest.fixture(autouse=True)
def _no_leaks(traced: tuple[Any, Any]) -> Iterator[None]:
    yield
    _, handle = traced
    ray.get(handle.set_fault_injection.remote("d-0", 0.0, 0.0))
    assert_clean(handle)


def _caller_spans(*names: str) -> list[tuple[Any, dict[str, str]]]:
    """A caller's span per name (each its own trace), with the carrier naming it."""
    from opentelemetry.sdk.trace import TracerProvider

    from kv_transfer.tracing import inject

    tracer = TracerProvider().get_tracer("test")
    spans = []
    for name in names:
        with tracer.start_as_current_span(name) as span:
            spans.append((span, inject(span)))
    return spans


async def _collect_traced(
    client: ClusterClient, prompt: list[int], params: SamplingParams, carrier: dict[str, str]
) -> Any:
    final = None
    async for out in client.generate_async(prompt, params, trace_context=carrier):
        final = out
    return final


def test_one_trace_across_the_central_actor_and_both_engines(traced: tuple[Any, Any]) -> None:
    """Tracing with engine actors: the central actor's root span, and each engine's spans
    made in its own process as the root's children (queue and prefill on the prefill engine,
    KV transfer and decode on the decode engine), the workers' save and load under them."""
    receiver, handle = traced
    ((caller, carrier),) = _caller_spans("caller")
    trace_id = caller.get_span_context().trace_id.to_bytes(16, "big")
    client = ClusterClient(handle)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def run() -> Any:
        return await _collect_traced(client, _prompts(1, 17)[0] + [3] * 10, params, carrier)

    out = asyncio.run(run())
    assert len(out.outputs[0].token_ids) == 6
    wanted = set(PD_SPAN_NAMES)
    wait_until(
        lambda: wanted <= {s.name for _, s in receiver.trace(trace_id)},
        30,
        "the request's spans at the OTLP receiver",
    )
    spans = {s.name: s for _, s in receiver.trace(trace_id)}
    root = spans["tandem.request"]
    assert root.parent_span_id == caller.get_span_context().span_id.to_bytes(8, "big")
    assert span_attributes(root)["gen_ai.usage.output_tokens"] == 6
    assert span_attributes(root)["gen_ai.response.finish_reasons"] == ["length"]
    for name in ("tandem.queue", "tandem.prefill", "tandem.kv_transfer", "tandem.decode"):
        assert spans[name].parent_span_id == root.span_id, name
    assert span_attributes(spans["tandem.prefill"])["tandem.instance"] == "p-0"
    assert span_attributes(spans["tandem.decode"])["tandem.instance"] == "d-0"
    assert span_attributes(spans["tandem.decode"])["gen_ai.usage.output_tokens"] == 6
    assert "first_token" in [e.name for e in spans["tandem.prefill"].events]
    transfer = span_attributes(spans["tandem.kv_transfer"])
    assert transfer["tandem.kv.outcome"] == "ok" and transfer["tandem.kv.bytes"] > 0
    assert spans["tandem.kv_load"].parent_span_id == spans["tandem.kv_transfer"].span_id
    assert spans["tandem.kv_save"].parent_span_id == root.span_id


def test_a_restarted_central_scheduler_makes_the_root_spans_again(
    traced: tuple[Any, Any], tiny_model: Path
) -> None:
    """The central actor is killed while two traced requests decode: their root spans die
    unexported with it. One request ends while the actor is away, the other is still
    running when the restarted actor rebuilds its state. Both roots are made again with
    their first ids, so the engines' spans keep their parent, under the caller's span,
    from the request's arrival to its end, with its usage."""
    receiver, handle = traced
    callers = _caller_spans("short", "long")
    ray.get(handle.set_fault_injection.remote("d-0", 0.0, 0.1))
    client = ClusterClient(handle)
    short = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    prompts = _prompts(2, 19)
    expected = [
        generate_in_process(tiny_model, [prompts[0]], short)[0],
        generate_in_process(tiny_model, [prompts[1]], long)[0],
    ]
    first_pid = ray.get(handle.stats.remote())["pid"]
    seen = [0, 0]

    async def collect(i: int, params: SamplingParams) -> list[int]:
        tokens: list[int] = []
        async for out in client.generate_async(prompts[i], params, trace_context=callers[i][1]):
            tokens = list(out.outputs[0].token_ids)
            seen[i] = len(tokens)
        return tokens

    def restarted() -> bool:  # a new process, rebuilt (stats waits for the rebuild)
        with contextlib.suppress(ray.exceptions.RayError):
            return bool(ray.get(handle.stats.remote())["pid"] != first_pid)
        return False

    async def run() -> list[list[int]]:
        tasks = [
            asyncio.ensure_future(collect(0, short)),
            asyncio.ensure_future(collect(1, long)),
        ]
        await _until(lambda: seen[0] >= 9 and seen[1] >= 5)  # both decoding on d-0
        ray.kill(handle, no_restart=False)  # the short one ends before it is back
        # The long one was still decoding (slowly) when the rebuild took it on: the rest of
        # it may run at full speed.
        await _until(restarted, 60)
        await asyncio.to_thread(ray.get, handle.set_fault_injection.remote("d-0", 0.0, 0.0))
        return list(await asyncio.gather(*tasks))

    assert asyncio.run(asyncio.wait_for(run(), 120)) == expected
    wanted = {"tandem.request", "tandem.queue", "tandem.prefill", "tandem.decode"}
    wanted.add("tandem.kv_transfer")
    trace_ids = [c.get_span_context().trace_id.to_bytes(16, "big") for c, _ in callers]
    for trace_id in trace_ids:
        wait_until(
            lambda trace_id=trace_id: wanted <= {s.name for _, s in receiver.trace(trace_id)},
            30,
            "the request's spans, its remade root included, at the OTLP receiver",
        )
    time.sleep(1.0)  # (10 export delays: a duplicate root would be here by now)
    for (caller, _), trace_id, want in zip(callers, trace_ids, expected, strict=True):
        names = [s.name for _, s in receiver.trace(trace_id)]
        assert names.count("tandem.request") == 1, names
        spans = {s.name: s for _, s in receiver.trace(trace_id)}
        root = spans["tandem.request"]
        assert root.parent_span_id == caller.get_span_context().span_id.to_bytes(8, "big")
        for name in ("tandem.prefill", "tandem.kv_transfer", "tandem.decode"):
            assert spans[name].parent_span_id == root.span_id, name
        attributes = span_attributes(root)
        assert attributes["tandem.remade"] is True
        assert attributes["gen_ai.usage.output_tokens"] == len(want)
        assert attributes["gen_ai.response.finish_reasons"] == ["length"]
        assert "central_restart" in [e.name for e in root.events]
        # From the request's arrival (as its queue span, within the instants' trips
        # between processes; not the restart, seconds later) to its end on the engine.
        queue, decode = spans["tandem.queue"], spans["tandem.decode"]
        assert abs(root.start_time_unix_nano - queue.start_time_unix_nano) < 0.25e9
        assert abs(root.end_time_unix_nano - decode.end_time_unix_nano) < 0.25e9
