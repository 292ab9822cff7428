"""What crosses between the central scheduler and an ``EngineActor``
(``control/engine_actor.py``): placements on their way (``WirePlacement``), reports
(merged while one is on its way: ``coalesce``), where each request placed on an engine
sends its outputs (``Route``), and the snapshot a restarted central scheduler rebuilds its
state from (``EngineSnapshot``).

Instants cross processes as ages (``rebase_*``): two nodes' ``time.monotonic()`` clocks are
not comparable, a duration is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.control.engine_reports import EndedTrace, EngineReport, Prefilled
from cluster.control.flights import Submission
from cluster.control.placement import InstanceSpec
from scheduler import Request, SamplingParams


@dataclass(slots=True)
class WirePlacement:
    """A ``Placement`` on its way to an engine actor: its client by id instead of a sink,
    its instants as (negative) offsets from the moment it was sent."""

    request: Request
    client_request_id: str
    client_id: str
    submission: Submission
    hand_off: bool
    num_cached_tokens: int | None
    arrival_time: float
    scheduled_at: float | None
    first_token_at: float | None
    last_token_at: float | None
    client_params: SamplingParams | None = None  # a prefill part's: what its client asked
    trace_context: dict[str, str] | None = None  # the request's root span, when traced


def shift(value: float | None, delta: float) -> float | None:
    return None if value is None else value + delta


def rebase_placement(p: WirePlacement, delta: float) -> None:
    """Move ``p``'s instants by ``delta``: ``-time.monotonic()`` before sending (ages),
    ``+time.monotonic()`` on receipt (the receiver's clock)."""
    p.arrival_time += delta
    p.request.arrival_time += delta
    p.scheduled_at = shift(p.scheduled_at, delta)
    p.first_token_at = shift(p.first_token_at, delta)
    p.last_token_at = shift(p.last_token_at, delta)


def rebase_report(report: EngineReport, delta: float) -> None:
    """``rebase_placement`` for the instants an ``EngineReport`` carries."""
    for p in report.prefilled:
        p.first_token_at = shift(p.first_token_at, delta)
        p.scheduled_at = shift(p.scheduled_at, delta)
    for lost in report.lost:
        lost.first_token_at = shift(lost.first_token_at, delta)
        lost.last_token_at = shift(lost.last_token_at, delta)
        lost.scheduled_at = shift(lost.scheduled_at, delta)


def sequence_of(internal_id: str) -> int:
    """The central actor's sequence number in an internal id (``{request id}@{n}``)."""
    tail = internal_id.rpartition("@")[2]
    return int(tail) if tail.isdigit() else 0


def plain(report: EngineReport) -> bool:
    """A step's report that may be merged with the next one."""
    return not (report.lost or report.failure or report.rejoined)


def coalesce(into: EngineReport, later: EngineReport) -> EngineReport:
    """One report saying what two consecutive plain ones say: the later summary, every
    prefix-cache event and milestone of both, in order."""
    later.summary.kv_events[:0] = into.summary.kv_events
    later.finished[:0] = into.finished
    later.prefilled[:0] = into.prefilled
    later.outcomes = {**into.outcomes, **later.outcomes}
    later.kv_unread[:0] = into.kv_unread
    later.latencies[:0] = into.latencies
    later.ended_traces = {**into.ended_traces, **later.ended_traces}
    return later


@dataclass(slots=True)
class Route:
    """Where a request placed here sends its outputs, and what a restarted central
    scheduler needs to take it on again (``EngineActor.snapshot``)."""

    client_id: str
    submission: Submission
    client_request_id: str
    request: Request  # this engine's part (the scheduler's copy)
    client_params: SamplingParams | None  # a prefill part's: its client's
    trace_context: dict[str, str] | None = None  # its root span (``root_carrier``), if traced
    arrival_time: float = 0.0  # when its client sent it (this process's clock)
    # Every output token its client has been sent, from position 0: the engine's own list
    # (``Held.tokens``), for a refill after a broken stream.
    tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class HeldSnapshot:
    """A request an engine holds, for a restarted central scheduler (instants as ages)."""

    internal_id: str
    route: Route  # its client, and the engine's part
    hand_off: bool
    tokens: list[int]  # what its client has
    num_cached_tokens: int | None
    arrival_time: float
    scheduled_at: float | None
    first_token_at: float | None
    last_token_at: float | None
    prefilled: Prefilled | None = None  # prefilled, its hand-off not confirmed


@dataclass(slots=True)
class EngineSnapshot:
    """What an engine actor tells a restarted central scheduler (``EngineActor.snapshot``)."""

    spec: InstanceSpec
    max_model_len: int
    epoch: int  # the new central scheduler's op epoch (its batches start at 0)
    draining: bool
    failed: str | None
    summary: Any  # an EngineSummary whose events rebuild the prefix index from nothing
    held: list[HeldSnapshot]
    adapters: Any = None  # the LoRA registry the central actor gave it (``adapters.Registry``)
    max_seq: int = 0  # the highest sequence number of the internal ids placed here
    # Traced requests that ended here while no central actor got the reports saying so.
    ended_traces: dict[str, EndedTrace] = field(default_factory=dict)
    # (client, submission) of the requests that ended here in the last minute: a prefilled
    # copy of one of them elsewhere is not handed off again (its confirmation was lost).
    ended: list[tuple[str, Any]] = field(default_factory=list)
    # The central actor's ``Autoscaler.memo`` (the newest of every engine's is restored).
    autoscaler: Any = None
    # Stopped by a retire that the previous central actor died in: it never steps again.
    stopped: bool = False
