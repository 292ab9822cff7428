"""What an engine actor remembers of the requests that left it, for a client whose stream
from it broke (``EngineActor.refill``): their tokens and how they ended -- or, handed off to
a decode engine, their first token -- kept ``PAST_KEEP_S`` (the client asks again within
seconds), ``RECENT_FINALS`` at most, as compact arrays."""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from cluster.control.engine_wire import Route
from cluster.control.flights import Outbox, Submission
from scheduler.outputs import EngineCoreOutput
from scheduler.request import FinishReason

PAST_KEEP_S = 60.0
RECENT_FINALS = 16384


@dataclass(slots=True)
class Past:
    """A request that left this engine -- ended (``finish_reason``) or handed off to a
    decode engine (None) -- with its tokens from position ``offset`` on (``refill``)."""

    client_request_id: str
    offset: int
    tokens: array[int]
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    num_cached_tokens: int
    error: str | None
    at: float  # when (monotonic)


class PastRequests:
    """The requests that left one engine lately, by (client, submission)."""

    def __init__(self) -> None:
        self._past: OrderedDict[tuple[str, Submission], Past] = OrderedDict()

    def __len__(self) -> int:
        return len(self._past)

    def ended(self) -> list[tuple[str, Submission]]:
        """The (client, submission) of the requests that ended here lately."""
        return [key for key, past in self._past.items() if past.finish_reason is not None]

    def remember(self, route: Route, out: EngineCoreOutput | None, index: int) -> None:
        """Keep what request ``route`` sent its client (``out``: its final, at output
        position ``index``; None: handed off), dropping what is too old or too many."""
        new = [] if out is None else out.new_token_ids
        offset, tokens = 0, route.tokens
        if len(tokens) != index + len(new):  # no token list shared with it
            offset, tokens = index, list(new)
        now = time.monotonic()
        self._past[(route.client_id, route.submission)] = Past(
            route.client_request_id,
            offset,
            array("q", tokens),
            None if out is None else out.finish_reason,
            None if out is None else out.stop_reason,
            0 if out is None else out.num_cached_tokens,
            None if out is None else out.error,
            now,
        )
        past = self._past
        while past and (
            len(past) > RECENT_FINALS or next(iter(past.values())).at < now - PAST_KEEP_S
        ):
            past.popitem(last=False)

    def refill(self, outbox: Outbox, client_id: str, wanted: dict[Submission, int]) -> int:
        """Put into ``outbox`` what each of ``wanted`` (submission -> the position its client
        has) that left lately sent from there on, with its end; returns how many."""
        count = 0
        for submission, start in wanted.items():
            past = self._past.get((client_id, submission))
            if past is None:
                continue
            end = past.offset + len(past.tokens)
            if past.finish_reason is None and start >= end:
                continue  # handed off: the client has all it sent
            start = min(max(start, past.offset), end)
            out = EngineCoreOutput(
                past.client_request_id,
                past.tokens[start - past.offset :].tolist(),
                past.finish_reason,
                past.stop_reason,
                past.num_cached_tokens,
                error=past.error,
            )
            outbox.put(submission, out, start)
            count += 1
        return count

    def drop_client(self, client_id: str) -> None:
        for key in [k for k in self._past if k[0] == client_id]:
            del self._past[key]
