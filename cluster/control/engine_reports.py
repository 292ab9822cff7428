"""What an instance's engine tells the central scheduler (``InstanceEngine`` in its process, or
an ``EngineActor`` over Ray): the ``EngineReport`` of each step, and in it the requests that
were prefilled, lost or ended there."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.control.summaries import EngineSummary
from scheduler.outputs import EngineCoreOutput


@dataclass(slots=True)
class Prefilled:
    """A prefill part sampled its first token (already sent to the client): it continues on
    a decode instance with the KV the prefill worker saved (``kv_transfer_params``)."""

    internal_id: str
    first: EngineCoreOutput  # the first token (and its logprobs)
    kv_transfer_params: dict[str, Any] | None
    num_cached_tokens: int
    first_token_at: float | None
    scheduled_at: float | None  # its first step (prefill started)


@dataclass(slots=True)
class Lost:
    """A request the engine cannot serve any more (its worker failed, the instance left):
    the central scheduler places it again after the ``tokens`` its client has."""

    internal_id: str
    tokens: list[int]
    first_token_at: float | None
    last_token_at: float | None
    scheduled_at: float | None  # its first step anywhere
    num_cached_tokens: int | None  # the prefix hit its client was told


# How a request ended, for its root span when another process ends it: (finish reason, error,
# output tokens, wall-clock ns of the end). The end is the engine's instant, not the time its
# report reached the central actor (a busy or restarting one reads it late).
EngineOutcome = tuple[str, str | None, int, int]


@dataclass
class EngineReport:
    """What one step changed, for the central scheduler (also sent at once when requests end
    outside a step, on a failure and on a rejoin)."""

    instance_id: str
    summary: EngineSummary
    finished: list[str] = field(default_factory=list)  # internal ids that ended here
    prefilled: list[Prefilled] = field(default_factory=list)
    lost: list[Lost] = field(default_factory=list)
    failure: str | None = None  # the instance failed (the loop stopped)
    rejoined: bool = False  # a fresh loop serves again (after a failure): empty cache
    # How the finished ones ended, for the root span of a request traced across processes.
    outcomes: dict[str, EngineOutcome] = field(default_factory=dict)
    # (internal id, source instance) of KV this decode instance will not read (its local
    # prefix cache had the prompt): the source's lease can end now.
    kv_unread: list[tuple[str, str]] = field(default_factory=list)
    # ("ttft" or "tpot", seconds, the seconds it was measured over) of requests measured here
    # since the last report (engine actors: the autoscaler's signals; an in-process engine's
    # go to the actor directly).
    latencies: list[tuple[str, float, float]] = field(default_factory=list)
    # Engine actors: what the root span of each traced request that finished needs, should
    # the central actor not know the request (it restarted and lost it: ``EndedTrace``).
    ended_traces: dict[str, EndedTrace] = field(default_factory=dict)
    # Engine actors: (the sending actor's incarnation, its number), given when it is first
    # sent. A report sent again (no answer came) may have been applied already: the central
    # actor applies each number once.
    sequence: tuple[str, int] | None = None


@dataclass(slots=True)
class EndedTrace:
    """A traced request that finished on an engine actor: its root span's carrier
    (``root_carrier``) and what the span says, for a central actor that has to make the
    root again (``restart_triage.end_remade_root``)."""

    carrier: dict[str, str]
    request_id: str
    prompt_tokens: int
    # Wall-clock ns, as the engine's own spans (a report may wait for a restarting central
    # actor: an age would grow by the wait).
    arrival_ns: int
    ended_ns: int
    outcome: EngineOutcome | None  # as ``EngineReport.outcomes``
