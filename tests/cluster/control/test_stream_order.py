"""A request's outputs reach its client in order when several processes send them (its
prefill engine, its decode engine, the engine it moved to, the central actor), and a gap left
by an engine that stopped before its last outputs were delivered is filled by the central
actor's replay of the tokens it learned at the move (regression: a request moved off a
removed instance hung when the removed engine's last batch never reached the client)."""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.control.flights import Flight, Outbox, pack_batch
from cluster.control.migration import _replay
from cluster.control.subscription import Subscription
from scheduler import Request, SamplingParams
from scheduler.outputs import EngineCoreOutput
from scheduler.request import FinishReason


class _Watching:
    """A gap watch that runs (none is started)."""

    def done(self) -> bool:
        return False


def _subscription() -> tuple[Subscription, asyncio.Queue[Any]]:
    """The delivery half of a Subscription (no actor: outputs are fed in by hand)."""
    sub = Subscription.__new__(Subscription)
    sub._next_index, sub._early, sub._tokens, sub._ended = {}, {}, {}, {}
    sub._gap_watch = _Watching()  # (no loop here: the gap watch has its own test)
    sub._generation, sub._central_away = 0, False  # (no restart of the central actor)
    queue: asyncio.Queue[Any] = asyncio.Queue()
    sub.queues = {7: queue}
    return sub, queue


def _out(tokens: list[int], finished: bool = False) -> EngineCoreOutput:
    return EngineCoreOutput("r", list(tokens), FinishReason.LENGTH if finished else None)


def _feed(sub: Subscription, out: EngineCoreOutput, index: int | None) -> None:
    sub._deliver_batch(pack_batch([(7, out, index)]))


def _drain(queue: asyncio.Queue[Any]) -> tuple[list[int], bool]:
    tokens: list[int] = []
    finished = False
    while not queue.empty():
        out = queue.get_nowait()
        assert not finished, "an output after the final one"
        tokens += out.new_token_ids
        finished = out.finished
    return tokens, finished


def _flight(tokens: list[int]) -> Flight:
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=9))
    flight = Flight(request, None, Outbox(), "d-2", "decode", submission=7, client_id="c")
    flight.sent = list(tokens)
    return flight


def _taken(flight: Flight) -> list[tuple[Any, EngineCoreOutput, int | None]]:
    assert flight.outbox is not None
    return asyncio.run(flight.outbox.take())


def test_a_move_replays_the_tokens_so_a_lost_batch_leaves_no_gap() -> None:
    sub, queue = _subscription()
    _feed(sub, _out([10]), 0)  # the prefill engine's first token
    _feed(sub, _out([11, 12]), 1)  # the decode engine's first batch
    # Its next batch, [13, 14] at 3, is lost with its process; the request moved with the
    # five tokens the engine had made, and the next engine continues at position 5:
    _feed(sub, _out([15, 16]), 5)
    assert _drain(queue) == ([10, 11, 12], False)  # held: position 3 never came
    flight = _flight([10, 11, 12, 13, 14])
    _replay(flight, EngineCoreOutput("r", []), flight.sent)
    for _tag, out, index in _taken(flight):
        _feed(sub, out, index)
    _feed(sub, _out([17], finished=True), 7)
    assert _drain(queue) == ([13, 14, 15, 16, 17], True)  # no gap, nothing twice


def test_a_replay_of_what_the_client_has_delivers_nothing() -> None:
    sub, queue = _subscription()
    _feed(sub, _out([10, 11, 12]), 0)
    assert _drain(queue) == ([10, 11, 12], False)
    flight = _flight([10, 11, 12])
    _replay(flight, EngineCoreOutput("r", []), flight.sent)
    for _tag, out, index in _taken(flight):
        _feed(sub, out, index)
    assert queue.empty()
    _feed(sub, _out([13], finished=True), 3)
    assert _drain(queue) == ([13], True)


def test_an_end_from_the_central_actor_fills_the_gap_before_it() -> None:
    """A request ended by the actor (no engine holds it: an abort between instances, no
    instance left to move to) after an engine's last batch was lost: the final output
    carries the tokens, so the stream ends instead of waiting for position 2."""
    sub, queue = _subscription()
    _feed(sub, _out([10, 11]), 0)
    flight = _flight([10, 11, 12, 13])
    _replay(flight, EngineCoreOutput("r", [], FinishReason.ABORT), flight.sent)
    for _tag, out, index in _taken(flight):
        _feed(sub, out, index)
    tokens, finished = _drain(queue)
    assert (tokens, finished) == ([10, 11, 12, 13], True)


def test_nothing_to_replay_sends_nothing_and_an_in_process_stream_gets_the_final_alone() -> None:
    flight = _flight([])
    _replay(flight, EngineCoreOutput("r", []), flight.sent)
    assert flight.outbox is not None and not flight.outbox.pending
    queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
    local = Flight(flight.request, queue, None, "c-0", "decode")
    _replay(local, EngineCoreOutput("r", [], FinishReason.ABORT), [10, 11])
    final = queue.get_nowait()
    assert final.new_token_ids == [] and final.finished and queue.empty()


def test_a_replay_behind_a_pending_output_is_not_merged_into_it() -> None:
    """The request's outbox still holds its old engine's last output (positions 3-4) when
    the replay from position 0 comes: merging them would put the replayed tokens at 5; they
    stay apart, and the client gets each token once, in place (regression: a request moved
    by a drain timeout repeated its first tokens)."""
    sub, queue = _subscription()
    _feed(sub, _out([10, 11, 12]), 0)
    flight = _flight([10, 11, 12, 13, 14])
    assert flight.outbox is not None
    flight.outbox.put(7, _out([13, 14]), 3)
    _replay(flight, EngineCoreOutput("r", []), flight.sent)
    flight.outbox.put(7, _out([15]), 5)  # the next engine's, after the replay: merged
    batch = _taken(flight)
    assert [index for _, _, index in batch] == [3, 0]
    for _tag, out, index in batch:
        _feed(sub, out, index)
    _feed(sub, _out([16], finished=True), 6)
    assert _drain(queue) == ([10, 11, 12, 13, 14, 15, 16], True)


def test_refilled_tokens_keep_every_logprob_in_place() -> None:
    """A request with logprobs: the refill (no logprobs) is not merged with an engine's
    output (with logprobs); the client trims what it has from the left of the tokens and
    keeps the logprobs of the tokens it keeps."""

    def lp(tokens: list[int]) -> list[dict[int, float]]:
        return [{t: -float(t)} for t in tokens]

    sub, queue = _subscription()
    first = _out([10, 11])
    first.new_logprobs = lp([10, 11])
    _feed(sub, first, 0)
    flight = _flight([10, 11, 12, 13])  # 12 and 13 were lost with their engine
    assert flight.outbox is not None
    _replay(flight, EngineCoreOutput("r", []), flight.sent)
    nxt = _out([14, 15])
    nxt.new_logprobs = lp([14, 15])
    flight.outbox.put(7, nxt, 4)  # the next engine's: not merged into the refill
    batch = _taken(flight)
    assert [index for _, _, index in batch] == [0, 4]
    for _tag, out, index in batch:
        _feed(sub, out, index)
    outs = [queue.get_nowait() for _ in range(3)]
    assert [o.new_token_ids for o in outs] == [[10, 11], [12, 13], [14, 15]]
    assert outs[1].new_logprobs is None and outs[2].new_logprobs == lp([14, 15])


def test_what_users_read_has_a_logprob_per_token_the_refilled_ones_unknown(
    tiny_model: Path,
) -> None:
    from actors.model.tokenizer import Tokenizer
    from cluster.engine.outputs import OutputProcessor

    processor = OutputProcessor(Tokenizer.from_path(tiny_model))
    processor.add("r", "", [1, 2, 3], SamplingParams(max_tokens=9, logprobs=1))
    with_lp = _out([10, 11])
    with_lp.new_logprobs = [{10: -1.0}, {11: -2.0}]
    refill = _out([12, 13])  # no logprobs: they died with their engine
    last = _out([14], finished=True)
    last.new_logprobs = [{14: -3.0}]
    for out in (with_lp, refill, last):
        (output,), _ = processor.process([out])
    sample = output.outputs[0]
    assert sample.token_ids == [10, 11, 12, 13, 14]
    assert sample.logprobs is not None and len(sample.logprobs) == 5
    assert sample.logprobs[4] == {14: -3.0} and sample.logprobs[1] == {11: -2.0}
    assert all(math.isnan(sample.logprobs[i][t]) for i, t in ((2, 12), (3, 13)))


def test_a_request_whose_final_reached_its_client_before_its_engine_died_ends_its_trace(
    tmp_path: Path,
) -> None:
    """Regression: a request forgotten at a resume (its client had its final output; the
    engine's report of it died with the engine) left its root span open, so its trace was
    never exported. The client answers with how it ended; the central actor ends the span."""
    import pytest

    pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from cluster.control.remembered import EarlyAborts
    from cluster.control.scheduler_actor import SchedulerActor
    from cluster.observability.request_trace import RequestTrace

    # The client: submission 7 got its final (3 tokens), submission 8 is still going.
    sub, _queue = _subscription()
    sub.queues[8] = asyncio.Queue()
    sub._open = {7: (None, None), 8: (None, None)}  # type: ignore[dict-item]
    sub._finals, sub._engines = OrderedDict(), {}
    _feed(sub, _out([10, 11]), 0)
    _feed(sub, EngineCoreOutput("r", [12], FinishReason.STOP), 2)
    sub._deliver_batch(pack_batch([(8, _out([20]), 0)]))
    answers: list[Any] = []

    class _Central:  # the actor handle's one method the resume calls
        class resume:
            @staticmethod
            async def remote(*args: Any) -> None:
                answers.append(args)

    sub.handle, sub.client_id = _Central(), "c"
    asyncio.run(sub._resume("d-2", [7, 8]))
    (client_id, iid, items) = answers[0]
    assert (client_id, iid) == ("c", "d-2")
    assert items == [(7, None, ("stop", None, 3)), (8, [20], None)]

    # The central actor: submission 7 is forgotten and its root span ends with that outcome.
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    actor = SchedulerActor.__new__(SchedulerActor)
    actor.flights, actor._internal, actor._early_aborts = {}, {}, EarlyAborts()
    flight = _flight([10, 11])
    flight.internal_id = "r#0"
    flight.trace = RequestTrace(tracer, None, "r", 3, 0.0, root_only=True)
    actor.flights["r"], actor._internal["r#0"] = flight, flight
    actor._orphans = {("c", 7): ("r#0", "d-2", "the engine died")}
    asyncio.run(actor.resume("c", "d-2", [items[0]]))
    assert "r" not in actor.flights and not actor._orphans
    (root,) = exporter.get_finished_spans()
    assert root.name == "tandem.request"
    assert tuple(root.attributes["gen_ai.response.finish_reasons"]) == ("stop",)
    assert root.attributes["gen_ai.usage.output_tokens"] == 3


def test_a_refill_gives_way_to_held_back_outputs_and_stale_ones_are_dropped() -> None:
    """After a broken stream an engine sends again what the client may have lost (no
    logprobs). Where outputs with logprobs are held back for a missing one, the refill
    covers only the gap: the held-back outputs keep their positions and their logprobs; and
    a held-back output that the refill overtook entirely is dropped, not kept forever."""

    def with_logprobs(tokens: list[int], finished: bool = False) -> EngineCoreOutput:
        out = _out(tokens, finished)
        out.new_logprobs = [{t: -0.5} for t in tokens]
        return out

    sub, queue = _subscription()
    _feed(sub, with_logprobs([11, 12]), 1)  # the decode engine's; its first token was lost
    _feed(sub, with_logprobs([13]), 3)
    _feed(sub, _out([10, 11, 12, 13]), 0)  # the refill, from position 0
    delivered = []
    while not queue.empty():
        delivered.append(queue.get_nowait())
    assert [o.new_token_ids for o in delivered] == [[10], [11, 12], [13]]
    assert delivered[0].new_logprobs is None  # the refilled token: none
    assert all(o.new_logprobs is not None for o in delivered[1:])  # kept
    assert sub._early[7] == {}  # nothing left behind

    sub, queue = _subscription()
    _feed(sub, _out([12]), 2)  # held back
    _feed(sub, _out([10, 11, 12, 13]), 0)  # a refill with logprobs off: all of it
    _feed(sub, _out([14], finished=True), 4)
    assert _drain(queue) == ([10, 11, 12, 13, 14], True)
    assert not sub._early.get(7)


def test_a_held_back_output_after_one_that_was_covered_is_delivered() -> None:
    """Two outputs held back (positions 2 and 3), then one from 0 that covers the first:
    that one is dropped, and the next, now due, goes out (it stayed held back for ever,
    and every later output behind it)."""

    def with_logprobs(tokens: list[int], finished: bool = False) -> EngineCoreOutput:
        out = _out(tokens, finished)
        out.new_logprobs = [{t: -0.5} for t in tokens]
        return out

    sub, queue = _subscription()
    _feed(sub, with_logprobs([12]), 2)
    _feed(sub, with_logprobs([13]), 3)
    _feed(sub, with_logprobs([10, 11, 12]), 0)
    _feed(sub, with_logprobs([14], finished=True), 4)
    assert _drain(queue) == ([10, 11, 12, 13, 14], True)
    assert not sub._early.get(7)


def test_thousands_of_held_back_outputs_are_delivered_in_a_loop() -> None:
    """A long gap (a lost batch, asked for again) holds back an output per step: when the
    gap fills they all go out, in order -- without one nested call each (which overflowed
    Python's stack past about a thousand)."""
    sub, queue = _subscription()
    for i in range(1, 5000):
        _feed(sub, _out([1000 + i]), i)
    _feed(sub, _out([1000]), 0)  # the missing one
    assert _drain(queue) == ([1000 + i for i in range(5000)], False)
    assert not sub._early.get(7)


def test_a_request_unknown_after_a_restart_is_lost_only_if_its_final_does_not_come(
    monkeypatch: Any,
) -> None:
    """After the central actor's restart, a request with output that it does not know either
    ended just before it was asked (its final, from its engine, still on its way) or was
    lost with the restart: it is given a moment for its final before its stream fails (it
    failed at once: a request that completed reached its user as an error)."""
    from cluster.control import lost_requests
    from cluster.errors import StreamLostError

    monkeypatch.setattr(lost_requests, "LOST_GRACE_S", 0.05)
    sub, queue = _subscription()
    sub._open = {7: (Request("r", [1, 2, 3], SamplingParams(max_tokens=9)), None)}
    _feed(sub, _out([4, 5]), 0)

    async def final_arrives() -> None:
        check = asyncio.ensure_future(sub._lost_unless_it_ends(7, "r"))
        _feed(sub, _out([6], finished=True), 2)  # the final was on its way
        await check

    asyncio.run(final_arrives())
    assert _drain(queue) == ([4, 5, 6], True)  # whole, and no error after it

    sub, queue = _subscription()
    sub._open = {7: (Request("r", [1, 2, 3], SamplingParams(max_tokens=9)), None)}
    _feed(sub, _out([4, 5]), 0)
    asyncio.run(sub._lost_unless_it_ends(7, "r"))  # nothing more comes: lost
    assert queue.get_nowait().new_token_ids == [4, 5]
    assert isinstance(queue.get_nowait(), StreamLostError)


def test_a_request_that_cannot_be_placed_ends_its_root_span() -> None:
    """Placing fails (no live decode instance, an adapter that does not load): the request
    is refused, and its root span -- started at its arrival -- ends with the error (it was
    never exported)."""
    import pytest
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from cluster.config import default_cluster_config
    from cluster.control.observer import RequestObserver
    from cluster.control.remembered import EarlyAborts
    from cluster.control.scheduler_actor import SchedulerActor

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    actor = SchedulerActor.__new__(SchedulerActor)
    actor.config = default_cluster_config()
    actor.observe = RequestObserver(actor.config, {}, {})
    actor.observe.tracer = provider.get_tracer("test")
    actor.flights, actor._internal, actor._early_aborts = {}, {}, EarlyAborts()
    actor.started, actor.recovering, actor._recovery, actor.max_model_len = True, False, None, 64

    async def place(flight: Flight) -> None:
        raise RuntimeError("no live decode instance")

    actor._place = place  # type: ignore[method-assign]
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=9))
    with pytest.raises(RuntimeError, match="no live decode"):
        asyncio.run(actor._submit(request))
    assert not actor.flights
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "tandem.request"]  # (its queue span ends too)
    assert not root.status.is_ok
    assert "no live decode instance" in (root.status.description or "")


def _placing_actor(place: Any) -> Any:
    """A central actor with engine actors, as far as ``submit_many`` goes; ``place`` places."""
    from cluster.config import default_cluster_config
    from cluster.control.clients import Clients
    from cluster.control.observer import RequestObserver
    from cluster.control.remembered import EarlyAborts
    from cluster.control.scheduler_actor import SchedulerActor

    actor = SchedulerActor.__new__(SchedulerActor)
    actor.config = default_cluster_config().model_copy(update={"engine_actors": True})
    actor.observe = RequestObserver(actor.config, {}, {})
    actor.flights, actor._internal, actor._early_aborts = {}, {}, EarlyAborts()
    actor.views = {}
    actor.clients = Clients(actor.flights, actor.abort, timeout_s=30.0)
    actor.started, actor.recovering, actor._recovery, actor.max_model_len = True, False, None, 64
    actor._place = place
    return actor


@pytest.mark.parametrize("fails", [True, False])
def test_a_submit_sent_again_while_the_first_is_placed_gets_the_first_ones_outcome(
    fails: bool,
) -> None:
    """A client with no answer (the central actor seemed away) sends its submit again while
    the first try is still being placed (an adapter loads on the instance). The second was
    refused "already in use", which the client took for placed -- and when the first then
    failed, the request hung. The second now gets the first one's outcome."""
    loading = asyncio.Event()
    placed: list[Flight] = []

    async def place(flight: Flight) -> None:
        await loading.wait()
        if fails:
            raise RuntimeError("adapter 'x' could not be loaded on d-0")
        placed.append(flight)

    actor = _placing_actor(place)

    def request() -> Request:
        return Request("r", [1, 2, 3], SamplingParams(max_tokens=9))

    async def main() -> tuple[Any, Any]:
        first = asyncio.ensure_future(actor.submit_many("c", [(request(), None, 7)]))
        await asyncio.sleep(0.01)
        again = asyncio.ensure_future(actor.submit_many("c", [(request(), None, 7)]))
        await asyncio.sleep(0.01)
        assert not again.done()  # (it was answered at once: "already in use")
        loading.set()
        return await first, await again

    (one,), (two,) = asyncio.run(main())
    if fails:
        assert isinstance(two, RuntimeError) and "could not be loaded" in str(two)
        assert str(one) == str(two) and not actor.flights
    else:
        assert one is None and two is None and len(placed) == 1  # placed once


def test_an_abort_of_an_unanswered_submit_ends_that_submit_only() -> None:
    """A batch the central actor did not answer: the client aborts each of its submits, as
    that submit. The abort, remembered (its submit had not come), ended any later submit of
    the id instead -- and the late submit it was meant for ran."""
    placed: list[Flight] = []

    async def place(flight: Flight) -> None:
        placed.append(flight)

    def request() -> Request:
        return Request("r", [1, 2, 3], SamplingParams(max_tokens=9))

    actor = _placing_actor(place)
    calls: list[tuple[Any, ...]] = []
    sub = Subscription.__new__(Subscription)
    sub.client_id = "c"
    sub.handle = SimpleNamespace(abort=SimpleNamespace(remote=lambda *args: calls.append(args)))
    sub._abort_remote((request(), None, 7))  # the client's abort of its unanswered submit
    assert calls == [("r", FinishReason.ABORT, "c", 7)]

    async def main() -> None:
        assert actor.abort(*calls[0]) is False  # not here yet: remembered for submit 7
        assert await actor.submit_many("c", [(request(), None, 8)]) == [None]
        later = actor.flights["r"]
        assert len(placed) == 1  # the later submit runs
        # The late first try, while the later one runs: refused; it replaced the later one
        # (whose end then nobody could ask for), taking it for one its client had ended.
        (late,) = await actor.submit_many("c", [(request(), None, 7)])
        assert isinstance(late, ValueError) and actor.flights["r"] is later
        del actor.flights["r"]  # (the later one ended)
        assert await actor.submit_many("c", [(request(), None, 7)]) == [None]
        assert "r" not in actor.flights and len(placed) == 1  # the late one ends at once

    asyncio.run(main())


def _actor_on_one_engine() -> tuple[Any, list[tuple[str, FinishReason]]]:
    """A central actor with engine actors that places every request on engine d-0 (internal
    id ``{id}@{submission}``), and the ends that engine is asked for."""

    async def place(flight: Flight) -> None:
        rid = flight.request.request_id
        flight.instance, flight.internal_id = "d-0", f"{rid}@{flight.submission}"
        actor._internal[flight.internal_id] = flight

    actor = _placing_actor(place)
    ends: list[tuple[str, FinishReason]] = []
    engine = SimpleNamespace(remote=True, dead=None, end=lambda *args: ends.append(args))
    actor.engines = {"d-0": engine}
    return actor, ends


def test_an_aimed_abort_that_comes_after_a_later_submit_replaced_its_submit_ends_it() -> None:
    """A submit placed but not answered; its client aborts it (as that submit) and reuses the
    id at once. Ray runs the later submit first: it takes the id (the first is over for its
    client), and the abort, finding the later one under the id, was only remembered --
    nothing ended the first, which decoded on its engine for nobody."""

    actor, ends = _actor_on_one_engine()

    def request() -> Request:
        return Request("r", [1, 2, 3], SamplingParams(max_tokens=9))

    async def main() -> None:
        assert await actor.submit_many("c", [(request(), None, 7)]) == [None]
        first = actor.flights["r"]
        assert await actor.submit_many("c", [(request(), None, 8)]) == [None]  # overtook
        later = actor.flights["r"]
        assert later is not first and actor._internal["r@7"] is first
        assert actor.abort("r", FinishReason.ABORT, "c", 7) is True
        assert ends == [("r@7", FinishReason.ABORT)] and first.aborting == FinishReason.ABORT
        assert actor.flights["r"] is later and later.aborting is None  # the later one runs on
        assert actor.abort("r", FinishReason.ABORT, "c", 6) is False  # not here: remembered

    asyncio.run(main())


def test_an_aimed_abort_finds_a_replaced_submit_by_its_key_and_ended_ones_are_not_kept() -> None:
    """An aimed abort that misses the id's current submit looked for a replaced one in every
    flight there was (O(flights) per miss, and misses are routine: a stop's later abort). The
    replaced flights are kept by (client, submission, request id) now: the abort still ends
    one on its engine, as often as it comes until its report ends it; and the entries of
    replaced flights that ended go, not kept for good."""

    actor, ends = _actor_on_one_engine()

    def request(rid: str) -> Request:
        return Request(rid, [1, 2, 3], SamplingParams(max_tokens=9))

    async def main() -> None:
        # "r", submission 7, replaced by 8 while its engine runs it (on for the whole test).
        assert await actor.submit_many("c", [(request("r"), None, 7)]) == [None]
        first = actor.flights["r"]
        assert await actor.submit_many("c", [(request("r"), None, 8)]) == [None]
        # Many more replaced, each of which then ends (its engine's report): their entries
        # go; "r"'s, whose flight runs on, stays through every sweep.
        for i in range(500):
            rid = f"s{i}"
            assert await actor.submit_many("c", [(request(rid), None, 1)]) == [None]
            replaced = actor.flights[rid]
            assert await actor.submit_many("c", [(request(rid), None, 2)]) == [None]
            actor._forget(replaced)  # its report: it ended
            actor._forget(actor.flights[rid])  # (the later one ends too)
        assert len(actor._internal) == 2  # "r"'s two
        assert len(actor._superseded) < 100  # (of 501 replaced: a bounded few, not all)
        assert actor._superseded[("c", 7, "r")] is first
        # A stop, then its stream's abort: both reach the replaced submit's engine.
        assert actor.abort("r", FinishReason.STOP, "c", 7) is True
        assert actor.abort("r", FinishReason.ABORT, "c", 7) is True
        assert ends == [("r@7", FinishReason.STOP), ("r@7", FinishReason.ABORT)]
        assert first.aborting == FinishReason.STOP and actor.flights["r"].aborting is None
        # Its report ends it: an abort of it afterwards misses (remembered) and its entry goes.
        actor._forget(first)
        assert actor.abort("r", FinishReason.ABORT, "c", 7) is False
        assert ("c", 7, "r") not in actor._superseded and len(ends) == 2
        # So does the abort of a replaced submit that ended long ago.
        assert actor.abort("s499", FinishReason.ABORT, "c", 1) is False

    asyncio.run(main())


def test_a_batch_sent_again_after_a_restart_aborts_only_the_submit_it_meant() -> None:
    """A caller leaves request r (submission 0) and reuses its id at once (submission 1):
    one batch, [abort r, submit r]. The central actor ran it and died before answering; the
    restarted one took submission 1 on from its engine, and the client sent the batch again.
    The abort, by the id alone, ended submission 1 -- the new request -- and its submit was
    answered as placed: the caller got an abort it never asked for."""
    placed: list[Flight] = []

    async def place(flight: Flight) -> None:
        placed.append(flight)

    def request() -> Request:
        return Request("r", [1, 2, 3], SamplingParams(max_tokens=9))

    actor = _placing_actor(place)
    actor.engines = {}
    sub = Subscription.__new__(Subscription)
    sub._ops, sub._flush_scheduled, sub.request_ids = [], True, {"r": 0}
    sub.abort("r")  # submission 0's stream left (the id is still its own here)
    ((abort, _),) = sub._ops

    async def main() -> None:
        # What the restarted actor took on: submission 1, placed by the one that died.
        assert await actor.submit_many("c", [(request(), None, 1)]) == [None]
        taken = actor.flights["r"]
        # The batch sent again: submission 1 runs on, placed once.
        assert await actor.submit_many("c", [abort, (request(), None, 1)]) == [None, None]
        assert actor.flights.get("r") is taken and taken.aborting is None
        assert len(placed) == 1

    asyncio.run(main())


def test_a_submit_sent_again_after_a_restart_that_ended_meanwhile_is_not_run_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The central actor placed submission 7 and died before answering; the request ended on
    its engine while no central actor ran (its client got the final from the engine). The
    client sent the submit again: the restarted actor, holding no flight of it, placed it
    again, and it ran to the end for nobody. The rebuild's ended submits are done."""
    from cluster.control import intake

    placed: list[Flight] = []

    async def place(flight: Flight) -> None:
        placed.append(flight)

    actor = _placing_actor(place)
    actor._ended_submits = frozenset({("c", 7)})  # (as the rebuild found on the engines)
    monkeypatch.setattr(intake, "ENDED_FINAL_WAIT_S", 0.05)

    def request(rid: str) -> Request:
        return Request(rid, [1, 2, 3], SamplingParams(max_tokens=9))

    async def main() -> None:
        assert await actor.submit_many("c", [(request("r"), None, 7)]) == [None]
        assert not placed and "r" not in actor.flights
        # Should its engine's final never reach the client, an error ends it after a while.
        [(_, late, _)] = await asyncio.wait_for(actor.clients.outbox("c").take(), 5)
        assert late.finish_reason == FinishReason.ERROR and "restarted" in (late.error or "")
        assert await actor.submit_many("d", [(request("r"), None, 7)]) == [None]  # another's
        assert await actor.submit_many("c", [(request("s"), None, 8)]) == [None]
        assert [f.submission for f in placed] == [7, 8]

    asyncio.run(main())


def test_a_flight_whose_id_was_reused_goes_when_its_engine_dies() -> None:
    """A client reuses the id of a request it has ended (engine actors): the old flight
    stays by its internal id for its engine's report that ends it. When that engine died
    instead, nothing dropped it: the actor kept it for good."""

    async def place(flight: Flight) -> None:
        pass

    actor = _placing_actor(place)
    old = Flight(
        Request("r", [1, 2, 3], SamplingParams(max_tokens=9)), None, Outbox(), "d-0", "decode"
    )
    old.internal_id, old.submission, old.client_id = "r@0", 1, "c"
    actor.flights["r"], actor._internal["r@0"] = old, old
    again = Request("r", [1, 2, 3], SamplingParams(max_tokens=9))
    outbox = actor.clients.outbox("c")
    asyncio.run(actor._submit(again, outbox=outbox, submission=2, client_id="c"))
    assert actor.flights["r"] is not old and "r@0" in actor._internal  # kept for its report
    actor.views = {"d-0": SimpleNamespace(alive=True)}
    actor.failures, actor._orphans, actor.specs = [], {}, {}
    actor.hand_offs = SimpleNamespace(drop=lambda iid: {})
    actor._confirm = lambda confirmed: None
    actor._engine_died("d-0", "its process died")
    assert "r@0" not in actor._internal and actor.flights["r"] is not old


def test_an_engine_that_joins_while_a_new_client_subscribes_is_noticed() -> None:
    """A new client's outbox was made only after its first notice (the engines) went out:
    an instance that joined in between was told to the outboxes there were, not to it, and
    the client never streamed from that engine -- its requests placed there got nothing."""
    actor = _placing_actor(None)
    actor.engines = {}

    async def main() -> None:
        stream = actor.subscribe("c")
        assert await stream.__anext__() == {"engines": {}}
        actor.clients.notify_engines({"d-1": "handle"})  # an instance joins meanwhile
        assert await asyncio.wait_for(stream.__anext__(), 1) == {"engines": {"d-1": "handle"}}
        await stream.aclose()

    asyncio.run(main())


def test_a_gap_nothing_else_asks_to_fill_is_asked_for_and_never_hangs(monkeypatch: Any) -> None:
    """An output is held back for one that never comes and no stream broke (its engine's
    stream ended, or the central scheduler's replay died with it): nothing asked for it
    again and the request hung. Holding one back starts the gap watch: it asks the engines,
    and a gap that lasts ends the request with an error."""
    from cluster.control import delivery
    from cluster.errors import StreamLostError

    monkeypatch.setattr(delivery, "GAP_GIVE_UP_S", 0.3)
    asked: list[Any] = []

    class Engine:
        class refill:  # (a Ray actor method)
            @staticmethod
            async def remote(client_id: str, positions: list[tuple[int, int]]) -> None:
                asked.append(positions)

    async def main() -> None:
        sub, queue = _subscription()
        sub.loop = asyncio.get_running_loop()
        sub._gap_watch = None
        sub.client_id = "c"
        sub._actors = {"d-1": Engine()}
        sub._open = {7: (Request("r", [1, 2, 3], SamplingParams(max_tokens=9)), None)}
        aborted: list[str] = []
        sub.abort = aborted.append  # type: ignore[method-assign]
        _feed(sub, _out([10]), 0)
        _feed(sub, _out([15, 16]), 5)  # 1 to 4 never come
        await asyncio.sleep(1.2)
        assert asked and asked[0] == [(7, 1)]  # the engines were asked from position 1
        tokens = [queue.get_nowait() for _ in range(queue.qsize())]
        assert tokens[0].new_token_ids == [10] and isinstance(tokens[-1], StreamLostError)
        assert aborted == ["r"]  # nothing runs on for nobody

    asyncio.run(main())


def test_a_request_unknown_after_a_restart_without_output_is_sent_again_unless_it_ends(
    monkeypatch: Any,
) -> None:
    """After the central actor's restart, a request without output that it does not know was
    never placed -- or ended with no token just before it was asked (an error at its
    prefill), its final on its way: it was sent again at once and ran twice, for nobody. It
    is given a moment for its final first."""
    from collections import Counter

    from cluster.control import lost_requests

    monkeypatch.setattr(lost_requests, "LOST_GRACE_S", 0.05)

    async def restart(final: bool) -> list[int]:
        sub, _ = _subscription()
        sub.loop = asyncio.get_running_loop()
        sub.client_id = "c"
        sub._ops, sub._in_flight, sub._submitting = [], Counter(), set()
        sub._open = {7: (Request("r", [1, 2, 3], SamplingParams(max_tokens=9)), None)}

        class Handle:
            class unknown_requests:  # (a Ray actor method)
                @staticmethod
                async def remote(client_id: str, pairs: list[Any]) -> list[int]:
                    return [7]

        sub.handle = Handle()
        submitted: list[int] = []

        def submit(request: Request, trace_context: Any, submission: int) -> Any:
            submitted.append(submission)
            return sub.loop.create_future()

        sub._submit = submit  # type: ignore[method-assign]
        await sub._resubmit_lost()
        if final:
            _feed(sub, _out([], finished=True), 0)  # its final was on its way
        await asyncio.sleep(0.2)
        return submitted

    assert asyncio.run(restart(final=True)) == []
    assert asyncio.run(restart(final=False)) == [7]


def _dying_engine(first: Any) -> Any:
    """An engine actor's handle whose stream sends the batch ``first``, then dies with the
    engine (what it would have sent next -- request 7's last token and its final -- went
    with it); its pings say it is dead."""
    import ray

    async def ready(value: Any) -> Any:
        return value

    class Engine:
        class subscribe:  # (a Ray actor method: a streaming generator)
            @staticmethod
            def remote(client_id: str, positions: Any) -> Any:
                async def batches() -> Any:
                    yield ready(first)
                    raise ray.exceptions.ActorDiedError()

                return batches()

        class ping:
            @staticmethod
            async def remote() -> str:
                raise ray.exceptions.ActorDiedError()

    return Engine()


def _following_subscription() -> tuple[Any, Any]:
    """A subscription (and request 7's queue) on the running loop, ready to follow engines,
    with request 7 open."""
    from collections import Counter

    sub, queue = _subscription()
    sub.loop = asyncio.get_running_loop()
    sub.client_id = "c"
    sub._ops, sub._in_flight, sub._submitting = [], Counter(), set()
    sub._engines, sub._actors = {}, {}
    sub._open = {7: (Request("r", [1, 2, 3], SamplingParams(max_tokens=3)), None)}
    return sub, queue


def test_a_final_lost_with_an_engine_that_died_ends_its_request_instead_of_hanging(
    monkeypatch: Any,
) -> None:
    """A request finished on its engine, which reported it (the central actor forgot it);
    the batch with its last token and its final never reached the client: the engine's
    process died first (or a retire killed it before a client that was reconnecting took
    its last batch). Nothing asked for it again -- no move or resume (the central actor no
    longer holds it), no gap (nothing comes after a final) -- and the request waited for
    ever. Once an engine dies, the open requests the central actor no longer knows get a
    moment for their final, then fail; one it still knows (it moves on) is left alone."""


    from cluster.control import lost_requests
    from cluster.errors import StreamLostError

    monkeypatch.setattr(lost_requests, "LOST_GRACE_S", 0.05)

    async def engine_dies(central_knows_it: bool) -> list[Any]:
        sub, queue = _following_subscription()

        class Handle:
            class unknown_requests:  # (a Ray actor method)
                @staticmethod
                async def remote(client_id: str, pairs: list[Any]) -> list[int]:
                    return [] if central_knows_it else [7]

        sub.handle = Handle()
        sub._follow({"d-1": _dying_engine(pack_batch([(7, _out([10, 11]), 0)]))})
        await asyncio.sleep(0.5)
        return [queue.get_nowait() for _ in range(queue.qsize())]

    outs = asyncio.run(engine_dies(central_knows_it=False))
    assert outs[0].new_token_ids == [10, 11]
    assert isinstance(outs[-1], StreamLostError)  # an error (a 503), not a wait for ever
    outs = asyncio.run(engine_dies(central_knows_it=True))  # it moves on: resumed, not failed
    assert [o.new_token_ids for o in outs] == [[10, 11]]


def test_an_engine_death_during_a_central_restart_leaves_the_unknown_to_the_restarts_check(
    monkeypatch: Any,
) -> None:
    """An engine and the central actor died together (one node): the restarted central actor
    knows none of the requests that were on that engine, nor those its dead process had not
    given an engine yet -- the restart's own check (``_resubmit_lost`` after it) sends the
    ones without output again. The engine's check asked the restarted actor too and failed
    them first, with a 503 "lost with its engine" (and the resubmit ran on for nobody)."""


    from cluster.control import lost_requests
    from cluster.errors import StreamLostError

    monkeypatch.setattr(lost_requests, "LOST_GRACE_S", 0.05)

    async def engine_dies() -> list[Any]:
        sub, queue = _following_subscription()

        class Handle:
            class unknown_requests:  # (a Ray actor method)
                @staticmethod
                async def remote(client_id: str, pairs: list[Any]) -> list[int]:
                    # The restarted actor answers (its stream came back meanwhile): it knows
                    # nothing of request 7, which its dead process had not placed.
                    sub._generation += 1
                    return [7]

        sub.handle = Handle()
        sub._follow({"d-1": _dying_engine(pack_batch([]))})  # (7 has no output yet)
        await asyncio.sleep(0.5)
        return [queue.get_nowait() for _ in range(queue.qsize())]

    outs = asyncio.run(engine_dies())
    assert not [o for o in outs if isinstance(o, StreamLostError)]  # the restart's check decides
