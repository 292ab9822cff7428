"""What the central scheduler gives an ``InstanceEngine`` (``engine.py``) -- a ``Placement``
-- and what the engine holds of each request it runs (``Held``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cluster.control.engine_reports import Lost
from cluster.control.flights import Submission
from scheduler import Request, SamplingParams
from scheduler.outputs import EngineCoreOutput

# Where a request is on an instance: its phase and the tokens its client has (None, None: not
# there).
RequestPlace = tuple[str | None, int | None]

# Where a request's outputs go: (output, the position of its first token in the request's
# output -- a final without tokens: the number of tokens before it).
Sink = Callable[[EngineCoreOutput, int], None]


@dataclass
class Placement:
    """A request the central scheduler gives an instance engine."""

    request: Request  # the scheduler's copy, under the internal id; output_token_ids: the
    # tokens its client already has (a decode part after a hand-off, a move)
    client_request_id: str  # the id its client knows it by (outputs carry it)
    sink: Sink
    hand_off: bool = False  # a prefill part: when prefilled, report it instead of finishing
    num_cached_tokens: int | None = None  # the prefill instance's prefix hit (a decode part)
    # For metrics (time.monotonic() of the central scheduler's process):
    arrival_time: float = 0.0
    scheduled_at: float | None = None  # its first step anywhere (an earlier placement's)
    first_token_at: float | None = None  # its first token reached the client
    last_token_at: float | None = None  # its last one did (a hand-off, a move)
    trace: Any = None  # the request's RequestTrace while tracing is on
    # Its client, for an engine in another process (``RemoteEngine``: no sink crosses).
    client_id: str | None = None
    submission: Submission | None = None
    client_params: SamplingParams | None = None  # a prefill part's: what its client asked


@dataclass(slots=True)
class Held:
    """A request this engine holds."""

    placement: Placement
    tokens: list[int]  # every output token its client has (or is being sent), in order
    num_cached_tokens: int | None
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    # When this instance made its first token of the request, and how many its client had
    # before: the pace here alone, without a hand-off's wait (the autoscaler's TPOT).
    made_here_from: tuple[float, int] | None = None

    # What the observer reads (it observes central flights and engine requests alike).
    @property
    def request(self) -> Request:
        return self.placement.request

    @property
    def trace(self) -> Any:
        return self.placement.trace

    @property
    def sent(self) -> list[int]:
        return self.tokens

    @property
    def first_scheduled_at(self) -> float | None:
        """Its first step anywhere (queue time ends, prefill starts)."""
        return self.placement.scheduled_at or self.scheduled_at

    def lost(self, internal_id: str) -> Lost:
        return Lost(
            internal_id,
            list(self.tokens),
            self.first_token_at,
            self.last_token_at,
            self.first_scheduled_at,
            self.num_cached_tokens,
        )
