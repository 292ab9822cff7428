"""``Migration._move`` places the requests a dead instance lost side by side: one whose
adapter is slow to load (or never loads) holds up none of the others -- but those of one
adapter in turn, each routed once the one before is counted where it went."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from cluster.control.engine_reports import Lost
from cluster.control.flights import Flight
from cluster.control.migration import Migration
from scheduler import FinishReason, Request, SamplingParams
from scheduler.request import LoRARequest


class Moves(Migration):
    """The mixin with what it uses of the actor; ``_place`` stands in for routing (a request
    named in ``stuck`` waits for an adapter load that does not end, ``bad`` fails)."""

    def __init__(self, flights: list[Flight], stuck: set[str], bad: set[str]) -> None:
        self._internal = {f.internal_id: f for f in flights}
        self.config: Any = SimpleNamespace(engine_actors=False)
        self.num_moves = 0
        self.observe: Any = SimpleNamespace(moved=lambda flight, reason: None)
        self.placed: list[str] = []
        self.ended: list[tuple[str, str]] = []
        self.stuck, self.bad = stuck, bad
        self.release = asyncio.Event()

    async def _place(self, flight: Flight) -> None:
        rid = flight.request.request_id
        if rid in self.stuck:
            await self.release.wait()
        if rid in self.bad:
            raise RuntimeError("no decode instance is alive")
        self.placed.append(rid)

    def _end(self, flight: Flight, reason: FinishReason, error: str = "", **_: Any) -> None:
        self.ended.append((flight.request.request_id, error))


def flight(rid: str, lora: LoRARequest | None = None) -> Flight:
    request = Request(rid, [1, 2, 3], SamplingParams(max_tokens=8), lora_request=lora)
    return Flight(request, None, None, "d-0", "decode", internal_id=f"{rid}@1")


def test_a_request_whose_adapter_load_hangs_holds_up_none_of_the_others() -> None:
    async def main() -> Moves:
        adapter = LoRARequest(lora_name="x", lora_int_id=1, lora_path="/x")
        flights = [flight(rid, adapter if rid in "ae" else None) for rid in "abcde"]
        moves = Moves(flights, stuck={"a"}, bad={"c"})
        lost = [Lost(f.internal_id, [5, 6], None, None, None, None) for f in flights]
        task = asyncio.ensure_future(moves._move("d-0", lost, "the engine died"))
        for _ in range(20):
            await asyncio.sleep(0)
        # The others are placed (or failed) in their order while "a" still waits.
        assert moves.placed == ["b", "d"]  # "e" waits for "a": the same adapter
        assert [rid for rid, _ in moves.ended] == ["c"]
        assert "the request could not move: no decode instance is alive" in moves.ended[0][1]
        assert not task.done()
        moves.release.set()
        await asyncio.wait_for(task, 5)
        return moves

    moves = asyncio.run(main())
    assert moves.placed == ["b", "d", "a", "e"]
    assert moves.num_moves == 5
    assert all(f.sent == [5, 6] and f.num_moves == 1 for f in moves._internal.values())


def test_a_request_being_moved_is_not_moved_again_when_its_old_engine_dies() -> None:
    """A request its instance lost waits in its move for an adapter to load, still naming
    that instance; the instance's engine process then dies. It was taken for one of the
    dead engine's requests (its client asked for its tokens) and moved a second time: two
    engines decoded it into one stream. It is left to the move under way."""

    async def main() -> Moves:
        adapter = LoRARequest(lora_name="x", lora_int_id=1, lora_path="/x")
        moving = flight("a", adapter)
        moves = Moves([moving], stuck={"a"}, bad=set())
        moves.flights = {"a": moving}
        moves.views = {"d-0": SimpleNamespace(alive=True)}
        moves.started = True
        moves.failures = []
        moves.hand_offs = SimpleNamespace(drop=lambda iid: {})
        moves._confirm = lambda confirmed: None
        moves._orphans = {}
        moves.specs = {}
        asked: list[Any] = []
        moves.clients = SimpleNamespace(ask_resume=lambda *args: asked.append(args) or True)
        moving.client_id, moving.submission = "client", 7
        lost = [Lost(moving.internal_id, [5], None, None, None, None)]
        task = asyncio.ensure_future(moves._move("d-0", lost, "the worker died"))
        for _ in range(5):
            await asyncio.sleep(0)
        assert moving.moving and moves.placed == []
        moves._engine_died("d-0", "its process died")
        assert not asked and not moves._orphans  # not taken for the dead engine's
        await moves._move("d-0", lost, "again")  # (a client's answer, had it been asked)
        moves.release.set()
        await asyncio.wait_for(task, 5)
        return moves

    moves = asyncio.run(main())
    assert moves.placed == ["a"]  # once
    assert not moves._internal["a@1"].moving and moves.num_moves == 1


def test_an_adapter_its_workers_could_not_read_is_loaded_again_before_its_next_request() -> None:
    """A request its workers ended because they could not read its adapter again (its files
    went after an eviction: ``LoRAManager.unreadable``) leaves the adapter no longer counted
    as loaded on that instance: the next request for it has ``ensure`` load it there again
    first -- the client's 404 naming it, or another instance that still has it -- instead of
    running there and failing the same way (a 503 "retry") for as long as the cluster runs.
    A request that failed otherwise leaves the count as it was."""
    from cluster.control.adapters import LoRAAdapters
    from cluster.control.engine_reports import EngineReport
    from cluster.control.report_intake import ReportIntake
    from scheduler.outputs import ADAPTER_UNREADABLE

    class Intake(ReportIntake):
        """The mixin with what ``_on_report`` uses of the actor; one in-process engine."""

        def __init__(self, flights: list[Flight]) -> None:
            self._internal = {f.internal_id: f for f in flights}
            self.engines: Any = {"d-0": SimpleNamespace(remote=False)}
            self.views: Any = {"d-0": SimpleNamespace(update=lambda summary: None)}
            self.hand_offs: Any = None
            config: Any = SimpleNamespace(lora=object(), serve=SimpleNamespace(lora_modules={}))
            self.lora = LoRAAdapters(config, {})

        def _forget(self, flight: Flight) -> None:
            pass

    adapter = LoRARequest(lora_name="x", lora_int_id=3, lora_path="/gone/x")
    intake = Intake([flight("other", adapter), flight("gone", adapter)])
    intake.lora.reset("d-0")
    intake.lora._loaded["d-0"].add(3)  # (``ensure`` loaded it there)
    failed = {"other@1": "remote KV load failed", "gone@1": f"{ADAPTER_UNREADABLE}x` could not"}
    for internal, loaded in (("other@1", {3}), ("gone@1", set())):
        outcome = ("error", failed[internal], 0, 0)
        report = EngineReport("d-0", None, finished=[internal], outcomes={internal: outcome})
        intake._on_report(report)  # type: ignore[arg-type]
        assert intake.lora._loaded["d-0"] == loaded, internal
