"""A restarted central scheduler sorts the requests its engines hold (``restart_triage.triage``):
which copy of a request it takes on, and which it drops instead of handing it off again."""

from __future__ import annotations

from cluster.control.engine_reports import Prefilled
from cluster.control.engine_wire import HeldSnapshot, Route
from cluster.control.refill import PastRequests
from cluster.control.restart_triage import triage
from scheduler import FinishReason, Request, SamplingParams
from scheduler.outputs import EngineCoreOutput


def held(rid: str, internal: str, prefilled: bool, client: str = "c", sub: int = 1) -> HeldSnapshot:
    request = Request(internal, [1, 2, 3], SamplingParams(max_tokens=8))
    route = Route(client, sub, rid, request, None)
    first = EngineCoreOutput(internal, [7])
    done = Prefilled(internal, first, {"handle": 1}, 0, None, None) if prefilled else None
    return HeldSnapshot(internal, route, prefilled, [7], 0, 0.0, None, None, None, done)


def decisions(out: list[tuple[str, HeldSnapshot, bool]]) -> list[tuple[str, str, bool]]:
    return [(iid, h.internal_id, take) for iid, h, take in out]


def test_a_prefilled_copy_of_a_request_that_ended_on_its_decode_engine_is_dropped() -> None:
    # The decode engine's report confirmed the hand-off and the request ran to its end
    # there; the prefill engine never heard (the previous process died first). Handing it off
    # again would run it twice and send its client a second stream.
    out = triage([("p-0", held("a", "a@1", prefilled=True))], {("c", 1)})
    assert decisions(out) == [("p-0", "a@1", False)]


def test_a_prefilled_copy_still_to_hand_off_is_taken_on() -> None:
    out = triage([("p-0", held("a", "a@1", prefilled=True))], {("c", 2), ("other", 1)})
    assert decisions(out) == [("p-0", "a@1", True)]


def test_the_decoding_copy_wins_over_the_prefilled_one_in_any_order() -> None:
    prefilled = ("p-0", held("a", "a@1", prefilled=True))
    decoding = ("d-0", held("a", "a@2", prefilled=False))
    for found in ([prefilled, decoding], [decoding, prefilled]):
        out = triage(found, set())
        assert decisions(out) == [("d-0", "a@2", True), ("p-0", "a@1", False)]


def test_requests_of_other_clients_or_submissions_are_not_confused() -> None:
    found = [
        ("p-0", held("a", "a@1", prefilled=True, client="c", sub=1)),
        ("p-1", held("a", "a@2", prefilled=True, client="c", sub=2)),  # the id used again
        ("d-0", held("a", "a@3", prefilled=False, client="other", sub=1)),
    ]
    out = triage(found, {("c", 1)})
    assert sorted(decisions(out)) == [
        ("d-0", "a@3", True),
        ("p-0", "a@1", False),
        ("p-1", "a@2", True),
    ]


def test_an_engine_lists_the_requests_that_ended_there_not_those_handed_off() -> None:
    past = PastRequests()
    ended = held("a", "a@1", prefilled=False).route
    handed = held("b", "b@1", prefilled=True, sub=2).route
    past.remember(ended, EngineCoreOutput("a@1", [9], FinishReason.LENGTH), 1)
    past.remember(handed, None, 1)
    assert past.ended() == [("c", 1)]
    # What the snapshot carries is what triage takes: the prefilled copy elsewhere is dropped.
    out = triage([("p-0", held("a", "a@0", prefilled=True))], set(past.ended()))
    assert decisions(out) == [("p-0", "a@0", False)]


def test_an_earlier_submission_under_a_reused_id_is_dropped_in_any_order() -> None:
    # The client aborted "a" (submission 1) and sent "a" again (submission 2); the abort died
    # with the previous process, so the engines hold both. The client streams the second
    # only: taking the first on too would make it the flight its aborts and ends reach.
    old = ("d-0", held("a", "a@1", prefilled=False, sub=1))
    new = ("d-1", held("a", "a@2", prefilled=False, sub=2))
    for found in ([old, new], [new, old]):
        assert sorted(decisions(triage(found, set()))) == [
            ("d-0", "a@1", False),
            ("d-1", "a@2", True),
        ]
    # Another client's request under the same id is its own.
    other = ("d-2", held("a", "a@3", prefilled=False, client="other", sub=1))
    assert ("d-2", "a@3", True) in decisions(triage([old, new, other], set()))
