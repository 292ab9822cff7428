"""An engine actor's bookkeeping of its clients, without Ray (the actor's methods on a bare
instance)."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import pytest


def test_an_engine_remembers_only_its_latest_dropped_clients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Client ids are unique, and the blocking ``generate`` makes a client per call: an
    engine actor keeps the latest ``DROPPED_REMEMBERED`` dropped ones (as the central actor
    does), not every one it ever saw."""
    from collections import OrderedDict

    from cluster.control import engine_actor, engine_streams
    from cluster.control.refill import PastRequests

    monkeypatch.setattr(engine_streams, "DROPPED_REMEMBERED", 3)
    actor = engine_actor.EngineActor.__new__(engine_actor.EngineActor)  # (no engine needed)
    actor._dropped, actor._streams, actor._outboxes = OrderedDict(), {}, {}
    actor._past = PastRequests()
    for i in range(10):
        actor._drop_client(f"client-{i}")
    assert list(actor._dropped) == ["client-7", "client-8", "client-9"]
    assert actor._outbox("client-9") is None  # a dropped client gets no outbox


def test_an_engine_that_does_not_answer_a_scrape_gives_its_last_metrics() -> None:
    """The central scheduler sums the engines' metrics into /metrics: an engine missing from
    one scrape (slow, hung, dead) read as all its counters reset, and Prometheus's rate()
    then added their whole history once it answered again."""
    import asyncio

    from cluster.control.remote_engine import RemoteEngine

    engine = RemoteEngine.__new__(RemoteEngine)  # (no actor: its answers are set below)
    engine.instance_id, engine.dead, engine._last_metrics = "d-0", None, ""
    answers: list[object] = ["a_total 3.0\n", TimeoutError("no answer"), "a_total 5.0\n"]

    async def ask(method: str, *args: object, **kwargs: object) -> object:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    engine._ask = ask  # type: ignore[method-assign]
    texts = [asyncio.run(engine.metrics_text()) for _ in range(3)]
    assert texts == ["a_total 3.0\n", "a_total 3.0\n", "a_total 5.0\n"]
    engine.dead = "its process died"
    assert asyncio.run(engine.metrics_text()) == "a_total 5.0\n"


def test_a_prefilled_request_ended_before_its_hand_off_is_counted() -> None:
    """Aborted (or ended by a stop string in its first token) after its prefill and before
    the central scheduler handed it off: its engine actor ends it, and counts it -- it was
    missing from request_success and requests_finished, which no one else counts."""
    import time
    from types import SimpleNamespace

    from prometheus_client.parser import text_string_to_metric_families

    from cluster.config import default_cluster_config
    from cluster.control.engine_actor import EngineActor
    from cluster.control.engine_reports import Prefilled
    from cluster.control.engine_wire import Route
    from cluster.control.observer import RequestObserver
    from scheduler import Request, SamplingParams
    from scheduler.outputs import EngineCoreOutput
    from scheduler.request import FinishReason

    actor = EngineActor.__new__(EngineActor)  # (its engine: what ``_end`` asks of one)
    actor.instance_id = "p-0"
    actor.observe = RequestObserver(default_cluster_config(), {"p-0": "prefill"}, {})
    actor.observe.add_instance("p-0", "prefill")
    engine = SimpleNamespace(
        instance_id="p-0",
        role="prefill",
        held={},
        end=lambda *args: False,
        abort=lambda ids: None,
        release_kv=lambda internal: None,
        loop=SimpleNamespace(summary=lambda: None),
    )
    actor._engine = lambda: engine  # type: ignore[assignment,return-value,method-assign]
    finals: list[EngineCoreOutput] = []
    actor._sink = lambda route: lambda out, n: finals.append(out)  # type: ignore[method-assign]
    actor._on_report = lambda report: None  # type: ignore[method-assign]
    request = Request("r#0", [1, 2, 3], SamplingParams(max_tokens=1), eos_token_id=2)
    now = time.monotonic()
    actor._routes = {"r#0": Route("c", 1, "r", request, SamplingParams(max_tokens=50))}
    first = EngineCoreOutput("r#0", [7], None)
    actor._awaiting = {"r#0": Prefilled("r#0", first, {"handle": 1}, 0, now, now)}
    actor._end("r#0", FinishReason.ABORT, None)
    assert [f.finish_reason for f in finals] == [FinishReason.ABORT]
    counted = {
        (s.name, s.labels.get("finished_reason")): s.value
        for family in text_string_to_metric_families(actor.observe.metrics.render_registry())
        for s in family.samples
        if s.labels.get("instance") == "p-0"
    }
    assert counted[("tandem:request_success_total", "abort")] == 1
    assert counted[("tandem:requests_finished_total", None)] == 1
    assert counted[("tandem:request_params_max_tokens_sum", None)] == 50  # its client's


def test_a_report_the_central_actor_could_not_be_reached_for_is_sent_again() -> None:
    """A report whose send failed because the central actor was unreachable for a while
    (``ActorUnavailableError``) or restarting was dropped: its milestones with it -- a
    prefill done (the client had its first token and waited forever for the rest), requests
    lost, requests finished. It is sent again, in order, its instants unchanged; one the
    central actor refused (an error in it) is not."""
    import time
    from collections import deque

    from ray.exceptions import ActorUnavailableError

    from cluster.control.engine_actor import EngineActor
    from cluster.control.engine_reports import EngineReport, Prefilled
    from scheduler.outputs import EngineCoreOutput

    received: list[tuple[EngineReport, float | None]] = []
    failures = [ActorUnavailableError("connection lost", None), None, ValueError("a bug")]
    sequences: list[Any] = []

    class Call:
        def __init__(self, report: EngineReport) -> None:
            self.report = report

        def __await__(self) -> Any:
            sequences.append(self.report.sequence)
            failure = failures.pop(0) if failures else None
            if failure is not None:
                raise failure
            received.append((self.report, self.report.prefilled[0].first_token_at))
            yield from []

    class Central:
        class report:  # (a Ray actor method)
            @staticmethod
            def remote(report: EngineReport) -> Call:
                return Call(report)

    actor = EngineActor.__new__(EngineActor)
    actor.instance_id = "p-0"
    actor.central = Central()
    actor.num_report_retries = 0
    actor._unsent_traces = {}
    actor._outgoing = deque()
    actor._incarnation, actor._num_reports = "x", 0

    def report(internal: str, first_token_at: float) -> EngineReport:
        first = EngineCoreOutput(internal, [7], None)
        prefilled = Prefilled(internal, first, {"handle": 1}, 0, first_token_at, None)
        return EngineReport("p-0", None, prefilled=[prefilled])  # type: ignore[arg-type]

    async def main() -> None:
        actor._wake = asyncio.Event()
        sender = asyncio.ensure_future(actor._send_reports())
        now = time.monotonic()
        actor._outgoing.extend([report("a#0", now - 1.0), report("b#0", now - 2.0)])
        actor._wake.set()
        for _ in range(200):
            await asyncio.sleep(0.01)
            if len(received) == 1 and not actor._outgoing:
                break
        sender.cancel()

    asyncio.run(main())
    assert actor.num_report_retries == 1
    # "a" was sent again after the connection failure; "b" met the central actor's error.
    ((sent, age),) = received
    assert sent.prefilled[0].internal_id == "a#0"
    assert age is not None and -1.5 < age < -0.95  # its instant less the time it left: once
    # Sent again under its number: had the first try been applied, the central drops it.
    assert sequences == [("x", 1), ("x", 1), ("x", 2)]


def test_a_report_sent_again_is_applied_once() -> None:
    """The central actor applies each ``EngineReport.sequence`` once: a report whose answer
    was lost (applied, then sent again) would otherwise count its latencies and failures,
    and end its requests, twice."""
    from cluster.control.engine_reports import EngineReport
    from cluster.control.scheduler_actor import SchedulerActor

    actor = SchedulerActor.__new__(SchedulerActor)
    actor._report_sequences = {}
    actor.recovering = True  # (reports are held: what reaches ``_on_report``)
    actor._held_reports = []
    actor._kick_recovery = lambda: None  # type: ignore[method-assign]

    def report(instance: str, sequence: tuple[str, int]) -> EngineReport:
        return EngineReport(instance, None, sequence=sequence)  # type: ignore[arg-type]

    sent = [
        report("p-0", ("x", 1)),
        report("p-0", ("x", 1)),  # sent again: dropped
        report("p-1", ("y", 1)),  # another instance's number 1
        report("p-0", ("x", 2)),
        report("p-0", ("z", 1)),  # a restarted engine actor: numbers start again
        report("p-0", ("x", 2)),  # (the old incarnation's, late: taken, as before)
    ]
    for item in sent:
        actor.report(item)
    assert actor._held_reports == [sent[0], sent[2], sent[3], sent[4], sent[5]]


def test_an_end_that_reaches_a_stopped_engine_is_left_to_the_central_scheduler() -> None:
    """An instance leaving: its engine actor stopped (its clients' streams closed) and an
    abort's end op came after. The engine ended the request there: its final went into a
    closed stream, and the central scheduler, told it finished, forgot it -- the client
    never got a final. It stays for ``take_all``, as lost: whoever moves it ends it."""
    from types import SimpleNamespace

    from cluster.control.engine_actor import EngineActor
    from cluster.control.engine_reports import Lost
    from scheduler.request import FinishReason

    ended: list[str] = []
    held = {"r@1": SimpleNamespace(tokens=[5, 6])}

    async def stop() -> None:
        pass

    def end(internal: str, reason: FinishReason, error: str | None) -> bool:
        ended.append(internal)
        return held.pop(internal, None) is not None

    engine = SimpleNamespace(
        instance_id="d-0",
        held=held,
        end=end,
        stop=stop,
        take_all=lambda: [Lost(i, list(h.tokens), None, None, None, None) for i, h in held.items()],
        take_unread_kv=lambda: [],  # (no hand-off held unread)
        loop=SimpleNamespace(summary=lambda: None),
    )
    actor = EngineActor.__new__(EngineActor)
    actor.instance_id = "d-0"
    actor.engine = engine  # type: ignore[assignment]
    actor._stopped = False
    actor._outboxes = {}
    actor._awaiting = {}
    actor._outgoing = deque()
    actor._routes = {}
    actor._epoch, actor._next_op, actor._early_ops = 0, 0, {}
    actor._sender = None
    asyncio.run(actor.stop())
    actor.ops(0, 0, [("end", "r@1", FinishReason.ABORT.value, None)])
    assert ended == []
    _, lost = actor.take_all()
    assert [(item.internal_id, item.tokens) for item in lost] == [("r@1", [5, 6])]


@pytest.mark.parametrize("where", ["held", "prefilled"])
def test_a_traced_request_ended_by_an_abort_keeps_its_ended_trace(where: str) -> None:
    """An abort (the central actor's ``end`` op) ends a traced request on an engine actor;
    the central actor restarts before the report saying so reaches it, and the restarted one
    does not know the request. Its root span is made again and ended from the report's
    ``ended_traces`` -- which had none for it: ``_end`` dropped the request's route (its
    trace carrier) before the report was made, and the root span was never exported."""
    import time
    from types import SimpleNamespace

    from cluster.control.engine_actor import EngineActor
    from cluster.control.engine_reports import EngineReport, Prefilled
    from cluster.control.engine_wire import Route
    from scheduler import Request, SamplingParams
    from scheduler.outputs import EngineCoreOutput
    from scheduler.request import FinishReason

    carrier = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}  # sampled
    request = Request("r@3", [1, 2, 3], SamplingParams(max_tokens=8), eos_token_id=2)
    held = {"r@3": SimpleNamespace(tokens=[7])} if where == "held" else {}
    engine = SimpleNamespace(
        instance_id="d-0",
        held=held,
        end=lambda internal, *args: held.pop(internal, None) is not None,
        abort=lambda ids: None,
        release_kv=lambda internal: None,
        loop=SimpleNamespace(summary=lambda: None),
    )
    actor = EngineActor.__new__(EngineActor)
    actor.instance_id = "d-0"
    actor._engine = lambda: engine  # type: ignore[assignment,return-value,method-assign]
    actor._latencies, actor._outgoing = [], deque()
    actor._routes = {"r@3": Route("c", 1, "r", request, None, carrier, time.monotonic())}
    actor._awaiting = {}
    if where == "prefilled":
        first = EngineCoreOutput("r@3", [7], None)
        now = time.monotonic()
        actor._awaiting["r@3"] = Prefilled("r@3", first, {"handle": 1}, 0, now, now)
        actor._sink = lambda route: lambda out, n: None  # type: ignore[method-assign]
        actor.observe = SimpleNamespace(finished=lambda *args: None)  # type: ignore[assignment]

    async def main() -> None:
        actor._wake = asyncio.Event()
        actor._end("r@3", FinishReason.ABORT, None)

    asyncio.run(main())
    (report,) = actor._outgoing
    assert isinstance(report, EngineReport) and report.finished == ["r@3"]
    ended = report.ended_traces["r@3"]
    assert ended.carrier == carrier and ended.request_id == "r"
    assert ended.outcome is not None and ended.outcome[0] == "abort"
    assert "r@3" not in actor._routes  # (dropped with the report, as before)
