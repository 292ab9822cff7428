"""What a restarted central scheduler takes on from its engines (``restart.rebuild``): which
copy of each request they hold goes on (``triage``), and the root spans of traced requests,
made again with the ids the engines' spans name as their parent (``remade_trace``,
``end_remade_root``)."""

from __future__ import annotations

import time
from typing import Any

from cluster.control.engine_reports import EndedTrace
from cluster.control.engine_wire import HeldSnapshot
from cluster.control.flights import made_after


def triage(
    held: list[tuple[str, HeldSnapshot]], ended: set[tuple[str, Any]]
) -> list[tuple[str, HeldSnapshot, bool]]:
    """The requests the engines hold, as (instance, request, take it on), in the order to
    take them on. A request is known by its (client, submission). Requests that run go
    first: one both decoding on one engine and prefilled on another, its hand-off never
    confirmed (the restart fell between the two), is the decoding one, and the prefilled
    copy is dropped; so is a second copy of any request (a move's new copy and the old). A
    prefilled copy of a request that already ended on its decode engine (``ended``: the
    report that confirmed its hand-off reached the previous process, its ``handed_off`` op
    to the prefill engine did not) is dropped too, not handed off again. So is a copy of an
    earlier submission under an id its client used again (the client ended it -- a client
    never has two open requests under one id -- but its abort died with the previous process):
    the client streams the newest one only."""
    order = sorted(held, key=lambda pair: pair[1].prefilled is not None)
    newest: dict[tuple[str, str], Any] = {}  # (client, request id) -> its last submission
    for _, h in held:
        key = (h.route.client_id, h.route.client_request_id)
        if key not in newest or made_after(h.route.submission, newest[key]):
            newest[key] = h.route.submission
    taken: dict[str, tuple[str, Any]] = {}  # client request id -> (client, submission)
    out = []
    for iid, h in order:
        route = h.route
        mine = (route.client_id, route.submission)
        if (
            (h.prefilled is not None and mine in ended)
            or taken.get(route.client_request_id) == mine
            or newest[(route.client_id, route.client_request_id)] != route.submission
        ):
            out.append((iid, h, False))
            continue
        taken[route.client_request_id] = mine
        out.append((iid, h, True))
    return out


def remade_trace(actor: Any, carrier: dict[str, str] | None, request: Any) -> Any:
    """The root span of a traced request in flight, made again with the ids its engines'
    spans name as their parent (it died unexported with the previous process), from its
    arrival; it ends when an engine reports the request finished, as the first would have."""
    tracer = actor.observe.tracer
    if tracer is None or not carrier:
        return None
    from cluster.observability.request_trace import RequestTrace
    from kv_transfer.tracing import given_ids, remade_root

    ids = remade_root(carrier)
    if ids is None:
        return None
    trace_id, span_id, parent = ids
    with given_ids(trace_id, span_id):
        trace = RequestTrace(
            tracer,
            parent,
            request.request_id,
            request.num_prompt_tokens,
            request.arrival_time,
            root_only=True,
        )
    if trace.root is not None:
        trace.root.set_attribute("tandem.remade", True)  # after the central actor's restart
        trace.root.add_event("central_restart")
    return trace


def end_remade_root(actor: Any, ended: EndedTrace) -> None:
    """Make again, and end as it ended, the root span of a traced request that finished on
    an engine while the central actor was away (``_lost_root``)."""
    from cluster.observability.request_trace import RequestTrace
    from kv_transfer.tracing import given_ids, remade_root

    ids = remade_root(ended.carrier)
    if ids is None:
        return
    trace_id, span_id, parent = ids
    arrival = time.monotonic() - (time.time_ns() - ended.arrival_ns) / 1e9
    with given_ids(trace_id, span_id):
        trace = RequestTrace(
            actor.observe.tracer,
            parent,
            ended.request_id,
            ended.prompt_tokens,
            arrival,
            root_only=True,
        )
    if trace.root is None:
        return
    trace.root.set_attribute("tandem.remade", True)
    trace.root.add_event("central_restart")
    reason, error, num_tokens, _ = ended.outcome or ("unknown", None, 0, 0)
    trace.finish(reason, error, num_tokens, end_time=ended.ended_ns)
