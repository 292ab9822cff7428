"""The span tree of a disaggregated request, built in process with an in-memory exporter
(the multi-node, over-the-wire version is tests/cluster/serving/test_serve_tracing.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sdk = pytest.importorskip("opentelemetry.sdk.trace")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

from actors.worker import ModelWorker  # noqa: E402
from cluster.config import ClusterConfig, InstancePool  # noqa: E402
from cluster.control.executors import LocalExecutor  # noqa: E402
from cluster.control.placement import InstanceSpec  # noqa: E402
from cluster.control.scheduler_actor import SchedulerActor  # noqa: E402
from cluster.observability.api_span import APISpan  # noqa: E402
from cluster.observability.request_trace import RequestTrace  # noqa: E402
from cluster.serving.openai_protocol import ChatCompletionRequest  # noqa: E402
from kv_transfer.tracing import extract  # noqa: E402
from scheduler import FinishReason, Request, SamplingParams  # noqa: E402


@pytest.fixture
def traced() -> Any:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_disaggregated_request_span_tree(traced: Any) -> None:
    tracer, exporter = traced
    caller = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    )
    api = APISpan(tracer, "chat", req, {"TraceParent": caller})
    trace = RequestTrace(tracer, extract(api.context), "r1", 10, time.monotonic())
    trace.scheduled("p-0", "prefill", "node-p")
    trace.handed_off("d-0", "node-d", "grpc", 3)
    trace.tokens(1, 4, "p-0", "node-p")  # the first token, from the prefill instance
    trace.kv_loaded(0.02, 4096, True)
    trace.tokens(2, 4, "d-0", "node-d")
    trace.finish("length", None)
    usage = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    with api:  # the handler's outcome, then the span ends as the handler leaves
        api.record("chatcmpl-1", usage, ["length"])

    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {
        "chat m",
        "tandem.request",
        "tandem.queue",
        "tandem.prefill",
        "tandem.kv_transfer",
        "tandem.decode",
    }
    root = spans["chat m"]
    assert root.context.trace_id == int("ab" * 16, 16) and root.parent.span_id == int("cd" * 8, 16)
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["gen_ai.usage.output_tokens"] == 3
    assert tuple(root.attributes["gen_ai.response.finish_reasons"]) == ("length",)
    request = spans["tandem.request"]
    assert request.parent.span_id == root.context.span_id
    for name in ("tandem.queue", "tandem.prefill", "tandem.kv_transfer", "tandem.decode"):
        assert spans[name].parent.span_id == request.context.span_id
        assert spans[name].context.trace_id == root.context.trace_id
    assert spans["tandem.prefill"].attributes["tandem.node_id"] == "node-p"
    assert spans["tandem.prefill"].attributes["tandem.cached_tokens"] == 4
    assert spans["tandem.prefill"].attributes["tandem.prompt_tokens"] == 10
    assert spans["tandem.decode"].attributes["tandem.node_id"] == "node-d"
    assert spans["tandem.decode"].attributes["gen_ai.usage.output_tokens"] == 3
    kv = spans["tandem.kv_transfer"].attributes
    assert kv["tandem.kv.transport"] == "grpc" and kv["tandem.kv.bytes"] == 4096
    assert kv["tandem.kv.blocks"] == 3 and kv["tandem.kv.outcome"] == "ok"
    assert [e.name for e in request.events] == ["first_token"]


def test_failed_load_and_abort_are_events(traced: Any) -> None:
    tracer, exporter = traced
    trace = RequestTrace(tracer, None, "r2", 5, time.monotonic())
    trace.scheduled("p-0", "prefill", None)
    trace.handed_off("d-0", None, "ray", 2)
    trace.tokens(1, 0, "p-0", None)
    trace.kv_loaded(2.0, 0, False)
    trace.moved("instance d-0: a worker died")
    trace.finish("abort", None)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    events = [e.name for e in spans["tandem.request"].events]
    assert events == ["first_token", "recompute_fallback", "moved", "abort"]
    assert spans["tandem.kv_transfer"].status.is_ok is False
    assert not spans["tandem.request"].parent  # no caller: a root span


def test_preemptions_are_events_counted_on_the_phase_span(traced: Any) -> None:
    tracer, exporter = traced
    trace = RequestTrace(tracer, None, "r3", 5, time.monotonic())
    trace.scheduled("c-0", "both", None)
    trace.preempted("c-0")  # before the first token: prefill
    trace.tokens(1, 0, "c-0", None)
    trace.preempted("c-0")
    trace.preempted("c-0")
    trace.tokens(3, 0, "c-0", None)
    trace.finish("length", None)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    events = [e.name for e in spans["tandem.request"].events]
    assert events == ["preemption", "first_token", "preemption", "preemption"]
    assert spans["tandem.prefill"].attributes["tandem.preemptions"] == 1
    assert spans["tandem.decode"].attributes["tandem.preemptions"] == 2


def test_real_preemptions_reach_the_requests_traces(traced: Any, tiny_model: Path) -> None:
    """A SchedulerActor in process (no Ray) on a cache too small for its requests: every
    preemption the scheduler makes is an event on that request's trace."""
    tracer, exporter = traced
    num_blocks = 24  # 6 requests x 7 blocks (4 prompt + 24 output tokens, blocks of 4)
    config = ClusterConfig(
        model=str(tiny_model), block_size=4, pools=[InstancePool(name="c", num_blocks=num_blocks)]
    )
    worker = ModelWorker(str(tiny_model), block_size=4, progress=False)
    worker.load_model()
    worker.init_kv_cache(num_blocks)
    spec = InstanceSpec("c-0", config.pools[0], LocalExecutor(worker), None, worker.info())
    actor = SchedulerActor(config, [spec])
    actor.observe.tracer = tracer  # the in-memory exporter instead of OTLP
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    async def run() -> dict[str, Any]:
        await actor.start()

        async def one(i: int) -> None:
            async for _ in actor.generate(Request(f"r{i}", [3 + i, 4, 5, 6], params)):
                pass

        await asyncio.gather(*(one(i) for i in range(6)))
        for _ in range(500):  # the loop frees the last finished requests' blocks
            stats: dict[str, Any] = (await actor.stats())["instances"]["c-0"]
            if stats["num_free_blocks"] == num_blocks:
                break
            await asyncio.sleep(0.01)
        await actor.check_integrity()
        await actor.shutdown()
        return stats

    stats = asyncio.run(asyncio.wait_for(run(), 60))
    assert stats["num_preemptions"] > 0
    assert stats["num_requests"] == 0 and stats["num_free_blocks"] == num_blocks
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "tandem.request"]
    assert len(roots) == 6
    events = [e for s in roots for e in s.events if e.name == "preemption"]
    assert len(events) == stats["num_preemptions"]
    assert all(e.attributes["tandem.instance"] == "c-0" for e in events)
    phases = [s for s in spans if s.name in ("tandem.prefill", "tandem.decode")]
    assert sum(s.attributes["tandem.preemptions"] for s in phases) == len(events)


def test_tracing_off_makes_no_spans() -> None:
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    )
    with APISpan(None, "chat", req, {}) as span:
        assert span.span is None and span.context is None
        span.record("chatcmpl-1", {"prompt_tokens": 1, "completion_tokens": 1}, ["stop"])


def test_a_moved_part_decodes_in_a_span_of_its_own(traced: Any) -> None:
    """Engine actors: a request moved off a failed instance after 5 tokens is a part on its
    new instance, recomputed there with no hand-off. It gets a decode span with its
    instance, preemptions and tokens (it got no span at all: its events were dropped)."""
    from opentelemetry.trace import set_span_in_context

    tracer, exporter = traced
    root = tracer.start_span("tandem.request")
    trace = RequestTrace(
        tracer, set_span_in_context(root), "r4", 5, time.monotonic(), part=True, output_tokens=5
    )
    trace.scheduled("d-1", "decode", "node-d")
    trace.preempted("d-1")
    trace.tokens(3, 0, "d-1", "node-d")
    trace.finish("length", None)
    root.end()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    decode = spans["tandem.decode"]
    assert decode.parent is not None and decode.parent.span_id == root.get_span_context().span_id
    assert decode.attributes["tandem.instance"] == "d-1"
    assert decode.attributes["tandem.moved"] is True
    assert decode.attributes["gen_ai.usage.output_tokens"] == 8
    assert decode.attributes["tandem.preemptions"] == 1
    assert [e.name for e in decode.events] == ["preemption"]


def test_a_prefill_part_opens_no_decode_span_on_its_prefill_instance(traced: Any) -> None:
    """In one process the central scheduler places a prefill part: its first token (on the
    prefill instance) opens no decode span there -- the decode instance's opens at the
    hand-off. One was opened and left unended (or, when no decode instance was left for the
    hand-off, exported as a decode span of the prefill instance)."""
    from types import SimpleNamespace

    from cluster.control.flights import Flight, Outbox

    tracer, _exporter = traced
    actor = SchedulerActor.__new__(SchedulerActor)
    placed: list[Any] = []
    actor.engines = {"p-0": SimpleNamespace(add=placed.extend)}  # type: ignore[dict-item]
    view = SimpleNamespace(instance_id="p-0", sent=lambda n: None)
    decodes = {}
    for hand_off in (True, False):
        request = Request("r", [1, 2, 3], SamplingParams(max_tokens=4))
        flight = Flight(request, None, Outbox(), "", "decode")
        flight.trace = trace = RequestTrace(tracer, None, "r", 3, time.monotonic())
        actor._send(view, flight, request, hand_off=hand_off)  # type: ignore[arg-type]
        trace.scheduled("p-0", "prefill", None)
        trace.tokens(1, 0, "p-0", None)
        decodes[hand_off] = trace.decode
    assert decodes[True] is None and decodes[False] is not None  # (colocated: it decodes)
    assert [p.hand_off for p in placed] == [True, False]


def test_a_request_ended_before_it_was_placed_counts_on_no_instance(tiny_model: Path) -> None:
    """A request whose abort came before it (it never reached an instance) is counted, but on
    no instance's series -- not on whichever instance happens to be first."""
    config = ClusterConfig(
        model=str(tiny_model), block_size=4, pools=[InstancePool(name="c", num_blocks=16)]
    )
    worker = ModelWorker(str(tiny_model), block_size=4, progress=False)
    worker.load_model()
    worker.init_kv_cache(16)
    spec = InstanceSpec("c-0", config.pools[0], LocalExecutor(worker), None, worker.info())
    actor = SchedulerActor(config, [spec])

    async def run() -> str:
        await actor.start()
        assert actor.abort("early") is False  # not there yet: remembered
        outs = [o async for o in actor.generate(Request("early", [3, 4, 5], SamplingParams()))]
        assert outs[-1].finish_reason == FinishReason.ABORT
        text = await actor.metrics_text()
        await actor.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):  # not started again on its
            await actor.start()  # killed workers (a replica adopting it meanwhile)
        return text

    text = asyncio.run(asyncio.wait_for(run(), 60))
    aborted = {
        line.split('instance="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tandem:request_success_total{") and 'finished_reason="abort"' in line
    }
    assert aborted.get("") == 1.0 and aborted.get("c-0", 0.0) == 0.0, aborted


def test_a_part_its_instance_lost_ends_its_open_spans(traced: Any) -> None:
    """Engine actors: an instance that fails (or leaves its pool) gives its requests up to
    be moved (``take_all``). The engine's part of a traced request ends its open spans
    there, as errors -- they were dropped unended and never exported, so the trace lost the
    decode span of the instance that made most of the tokens. A whole trace (one process,
    with its root) goes on with the request: nothing of it ends."""
    from opentelemetry.trace import set_span_in_context

    from cluster.control.engine import InstanceEngine
    from cluster.control.held import Held, Placement

    tracer, exporter = traced
    root = tracer.start_span("tandem.request")
    part = RequestTrace(
        tracer, set_span_in_context(root), "r6", 5, time.monotonic(), part=True, output_tokens=1
    )
    part.handed_off("d-0", "node-d", "ray", 2)
    part.tokens(3, 0, "d-0", "node-d")  # (the KV is in: the transfer span ends)
    whole = RequestTrace(tracer, None, "r7", 5, time.monotonic())
    whole.scheduled("d-0", "both", None)

    engine = InstanceEngine.__new__(InstanceEngine)
    engine.instance_id = "d-0"
    engine.held = {}
    for internal, trace in (("r6@1", part), ("r7@2", whole)):
        request = Request(internal, [1, 2, 3, 4, 5], SamplingParams(max_tokens=16))
        placement = Placement(request, internal.split("@")[0], lambda out, index: None)
        placement.trace = trace
        engine.held[internal] = Held(placement, [], None)
    lost = engine.take_all("instance d-0 failed: its worker died")
    assert sorted(item.internal_id for item in lost) == ["r6@1", "r7@2"]

    spans = {s.name: s for s in exporter.get_finished_spans()}
    decode = spans["tandem.decode"]
    assert decode.status.is_ok is False
    assert decode.status.description == "instance d-0 failed: its worker died"
    assert decode.attributes["gen_ai.usage.output_tokens"] == 4
    assert [e.name for e in decode.events] == ["moved"]
    assert "tandem.prefill" not in spans  # (r7's trace goes on with its request)
    # A part lost while its KV loaded: its transfer span ends as abandoned.
    loading = RequestTrace(
        tracer, set_span_in_context(root), "r9", 5, time.monotonic(), part=True, output_tokens=1
    )
    loading.handed_off("d-0", "node-d", "ray", 2)
    loading.left("instance d-0 failed: its worker died")
    transfers = [s for s in exporter.get_finished_spans() if s.name == "tandem.kv_transfer"]
    # (r6's ended at its token from the decode instance: the KV was in)
    assert [s.attributes.get("tandem.kv.outcome") for s in transfers] == [None, "abandoned"]
    # A copy a restarted central scheduler drops (``abort``): its open spans end too.
    dropped = RequestTrace(tracer, set_span_in_context(root), "r10", 5, time.monotonic(), part=True)
    dropped.scheduled("d-0", "both", None)  # (its prefill span opens)
    request = Request("r10@3", [1, 2, 3, 4, 5], SamplingParams(max_tokens=16))
    placement = Placement(request, "r10", lambda out, index: None)
    placement.trace = dropped
    engine.held["r10@3"] = Held(placement, [], None)
    engine.loop = SimpleNamespace(abort=lambda ids: None)
    engine.abort(["r10@3"])
    assert dropped.prefill is not None and not dropped.prefill.is_recording()
    assert whole.prefill is not None and whole.prefill.is_recording()
    whole.finish("abort", None)
    root.end()


def test_a_request_moved_while_its_kv_loads_ends_the_transfer_span_as_abandoned(
    traced: Any,
) -> None:
    """One process: a decode instance that fails while loading a request's KV moves the
    request; its transfer span ends there as an error ("abandoned"), not at the next token
    from another instance, as a long clean load."""
    tracer, exporter = traced
    trace = RequestTrace(tracer, None, "r8", 5, time.monotonic())
    trace.scheduled("p-0", "prefill", None)
    trace.tokens(1, 0, "p-0", None)
    trace.handed_off("d-0", None, "ray", 2)
    trace.moved("instance d-0 failed")
    trace.tokens(1, None, "d-1", None)
    (transfer,) = [s for s in exporter.get_finished_spans() if s.name == "tandem.kv_transfer"]
    assert transfer.status.is_ok is False
    assert transfer.attributes["tandem.kv.outcome"] == "abandoned"
    assert "instance d-0 failed" in (transfer.status.description or "")
    trace.finish("length", None)
