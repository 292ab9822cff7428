"""``Migration``: what the ``SchedulerActor`` does when an instance's engine process dies
(engine actors). The engine took its requests' tokens with it -- the central actor learns a
request's tokens only when it changes instance, never per token -- but each request's client
has every token it was sent. So the actor asks the clients: each answers with the tokens of
its requests that were on the dead engine (``Subscription`` keeps them), once its stream from
that engine has ended (nothing more can arrive from it; after ``RESUME_WAIT_S`` it stops
reading that stream and answers anyway), and each request moves on after
those tokens, as after a worker's failure (``Migration._move``): re-prefilled elsewhere
from prompt + tokens, its stream going on where it stopped. A client that does not answer
within ``RESUME_TIMEOUT_S`` (it died with the engine, say) has its requests ended with an
error naming the engine. (NVIDIA Dynamo's frontend "migration" works the same way: the
frontend holds the tokens and re-sends them to a live worker.)"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from cluster.config import ClusterConfig
from cluster.control.clients import Clients
from cluster.control.engine_reports import Lost
from cluster.control.flights import Flight, Outcome, Submission
from cluster.control.handoffs import HandOffs
from cluster.control.observer import RequestObserver
from cluster.control.placement import InstanceSpec
from cluster.control.summaries import InstanceView
from scheduler.outputs import EngineCoreOutput
from scheduler.request import FinishReason

# How long the actor waits for a client's tokens of its requests on a dead engine.
RESUME_TIMEOUT_S = 10.0

logger = logging.getLogger(__name__)


class Migration:
    """The ``SchedulerActor``'s handling of a dead engine process (a mixin)."""

    # What of the actor this uses (annotations only: the actor's own or its other mixins').
    views: dict[str, InstanceView]
    flights: dict[str, Flight]
    _internal: dict[str, Flight]
    failures: list[dict[str, Any]]
    clients: Clients
    # A dead engine's requests waiting for their clients' tokens: by (client, submission),
    # the request's internal id, the engine's instance and why it died.
    _orphans: dict[tuple[str, Submission], tuple[str, str, str]]
    started: bool
    config: ClusterConfig
    specs: dict[str, InstanceSpec]
    num_moves: int
    observe: RequestObserver
    _place: Callable[[Flight], Coroutine[Any, Any, None]]
    _spawn: Callable[[Coroutine[Any, Any, None]], None]
    _end: Callable[..., None]  # SchedulerActor._end(flight, reason, error=, tokens=)
    _forget: Callable[[Flight], None]
    hand_offs: HandOffs
    _confirm: Callable[[dict[str, list[str]]], None]

    def _engine_died(self, iid: str, reason: str) -> None:
        """An engine actor's process died: its instance leaves routing, and each request it
        held moves on once its client says which tokens it has (``resume``)."""
        view = self.views.get(iid)
        if view is None or not self.started:  # (shutting down: everything ends anyway)
            return
        view.alive = False
        self._confirm(self.hand_offs.drop(iid))  # what it had not confirmed moves on too
        self.failures.append(
            {"instance_id": iid, "event": "failed", "reason": reason, "time": time.time()}
        )
        for flight in [f for f in self._internal.values() if f.instance == iid]:
            if self.flights.get(flight.request.request_id) is not flight:
                # Its id was reused by its client (``Intake._submit``), which has no use for
                # it: only its engine's report dropped it, and none comes now.
                self._forget(flight)
        for flight in self.flights.values():
            if flight.prefilled_on == iid and flight.instance != iid:
                # Handed off: its first token may have died in this engine's stream while
                # the decode engine's tokens, after it, wait at the client.
                _replay(flight, EngineCoreOutput(flight.request.request_id, []), flight.sent)
        asked: dict[str, list[Submission]] = {}
        waiting: list[tuple[tuple[str, Submission], str]] = []
        for flight in [f for f in self.flights.values() if f.instance == iid]:
            if flight.moving:  # it left already: being placed elsewhere (an adapter loads)
                continue
            client = flight.client_id
            if flight.aborting is not None:  # its abort went to the engine that died
                self._end(flight, flight.aborting, tokens=flight.sent)
                continue
            if client is None or flight.submission is None:  # nobody holds its tokens
                self._end_flight(flight, reason)
                continue
            key = (client, flight.submission)
            self._orphans[key] = (flight.internal_id, iid, reason)
            asked.setdefault(client, []).append(flight.submission)
            waiting.append((key, flight.internal_id))
        for client, submissions in asked.items():
            if not self.clients.ask_resume(client, iid, submissions):  # gone meanwhile
                for key, internal in waiting:
                    if key[0] == client:
                        self._orphan_ends(key, internal, "its client left")
        if waiting:
            logger.warning(
                "instance %s: %d requests wait for their clients' tokens to move on",
                iid,
                len(waiting),
            )
            self._spawn(self._expire_orphans(waiting))
        spec = self.specs.get(iid)
        if spec is not None and spec.actors:
            self._spawn(self._release_workers(iid, spec))

    def _ask_again(self, client_id: str) -> None:
        """Client ``client_id`` subscribed again while its earlier stream ran here (that one
        broke on its side): an ask for its tokens that stream took may be lost. Every one of
        its requests still waiting is asked again (a second answer finds nothing waiting)."""
        asked: dict[str, list[Submission]] = {}
        for (client, submission), (_, iid, _) in self._orphans.items():
            if client == client_id:
                asked.setdefault(iid, []).append(submission)
        for iid, submissions in asked.items():
            self.clients.ask_resume(client_id, iid, submissions)

    async def _release_workers(self, iid: str, spec: InstanceSpec) -> None:
        """A dead engine's instance never serves again (a resize replaces it): its workers,
        detached, would hold their resources (a GPU) for as long as Ray ran. They go once
        the reads of their KV in flight (hand-offs the decode side confirmed) have had their
        lease."""
        import ray

        await asyncio.sleep(self.config.kv_transfer.effective_lease_s)
        if self.specs.get(iid) is not spec:  # retired meanwhile (which stopped them)
            return
        for actor in spec.actors:
            ray.kill(actor)
        logger.info("instance %s: the workers of its dead engine stopped", iid)

    async def resume(
        self,
        client_id: str,
        iid: str,
        items: list[tuple[Submission, list[int] | None, Outcome | None]],
    ) -> None:
        """Client ``client_id``'s answer for its requests on instance ``iid``'s dead engine:
        each submission with every token the client has of it, and they move on after those;
        or with None and how it ended (its final output reached the client before the engine
        died, so it is over; None: its consumer left before the end)."""
        lost: list[Lost] = []
        reason = f"the engine process of instance {iid} died"
        now = time.monotonic()
        for submission, client_tokens, outcome in items:
            orphan = self._orphans.get((client_id, submission))
            if orphan is None or orphan[1] != iid:
                continue  # ended meanwhile (aborted, or its client answered too late)
            del self._orphans[(client_id, submission)]
            internal, _, reason = orphan
            flight = self._internal.get(internal)
            if flight is None or flight.instance != iid:
                continue
            if client_tokens is None:  # its final reached the client before the engine died
                self._forget(flight)
                if flight.trace is not None:  # the root span; the engine ended its own
                    left = ("abort", "its client left before the end", len(flight.sent))
                    flight.trace.finish(*(outcome or left))
                continue
            tokens = list(client_tokens)
            sent = flight.sent  # what it had at its hand-off: the client may lack some of it
            if len(sent) > len(tokens) and sent[: len(tokens)] == tokens:
                tokens = list(sent)
            lost.append(
                Lost(
                    internal,
                    tokens,
                    flight.first_token_at or (now if tokens else None),
                    now if tokens else None,
                    flight.scheduled_at,
                    flight.num_cached_tokens,
                )
            )
        if lost:
            await self._move(iid, lost, reason)

    async def _expire_orphans(self, waiting: list[tuple[tuple[str, Submission], str]]) -> None:
        await asyncio.sleep(RESUME_TIMEOUT_S)
        why = f"its client did not resume it within {RESUME_TIMEOUT_S:g} s"
        for key, internal in waiting:
            self._orphan_ends(key, internal, why)

    def _orphan_ends(self, key: tuple[str, Submission], internal: str, why: str) -> None:
        """End the request still waiting under ``key`` as ``internal`` (not one that moved
        on since and waits again, after another engine died)."""
        orphan = self._orphans.get(key)
        if orphan is None or orphan[0] != internal:
            return
        del self._orphans[key]
        _, iid, reason = orphan
        flight = self._internal.get(internal)
        if flight is not None and flight.instance == iid:
            self._end_flight(flight, f"{reason}; {why}")

    async def _move(self, iid: str, lost: list[Lost], reason: str) -> None:
        """Place requests an instance lost again: re-prefilled elsewhere from prompt + the
        tokens their clients have. Those of one adapter are placed in turn, in their order
        (each is routed after the one before is counted where it went: side by side, all
        would pick the same instance while its adapter loads); those of other adapters, and
        those without, side by side -- one waiting for its adapter to load (``_place``) holds
        up none of the others."""
        turns: dict[Any, list[Flight]] = {}  # adapter id (or the flight) -> its flights
        for item in lost:
            flight = self._internal.get(item.internal_id)
            if flight is None or flight.instance != iid:
                continue  # aborted meanwhile
            if flight.moving:  # (its engine died while it moved: its client answered)
                continue
            if flight.aborting is not None:  # its abort reached the engine too late
                self._end(flight, flight.aborting, tokens=item.tokens)
                continue
            flight.sent = list(item.tokens)
            # What the engine it left sent last may never have reached the client (its
            # process stopped before Ray delivered it), and the next engine's tokens come
            # after these: the client gets them again, so its stream has no gap.
            refill = self.config.engine_actors
            _replay(flight, EngineCoreOutput(flight.request.request_id, []), flight.sent, refill)
            flight.first_token_at = item.first_token_at
            flight.last_token_at = item.last_token_at
            if flight.num_cached_tokens is None:
                flight.num_cached_tokens = item.num_cached_tokens
            flight.scheduled_at = flight.scheduled_at or item.scheduled_at
            flight.num_moves += 1
            self.num_moves += 1
            self.observe.moved(flight, reason)
            lora = flight.request.lora_request
            key = ("alone", id(flight)) if lora is None else ("lora", lora.lora_int_id)
            turns.setdefault(key, []).append(flight)
            flight.moving = True
        await asyncio.gather(*(self._move_in_turn(flights, reason) for flights in turns.values()))

    async def _move_in_turn(self, flights: list[Flight], reason: str) -> None:
        for flight in flights:
            try:
                await self._place(flight)
            except Exception as exc:
                error = f"{reason}; the request could not move: {exc}"
                self._end(flight, FinishReason.ERROR, error, tokens=flight.sent)
            finally:
                flight.moving = False

    def _end_flight(self, flight: Flight, error: str) -> None:
        """End a flight with an error from the actor (its engine is gone)."""
        self._end(flight, FinishReason.ERROR, error)


def _replay(
    flight: Flight, out: EngineCoreOutput, tokens: list[int] | None, refill: bool = True
) -> None:
    """Deliver ``out`` after ``tokens``, the output the actor knows its client should have.
    A client of engine actors orders a request's outputs by position and drops what it
    already has, so the tokens are sent from position 0 and fill any gap (the tokens of an
    engine that stopped before its last outputs reached the client); it is the request's
    own queue, or ``refill`` False (engines in this process, whose outputs cannot be lost):
    ``out`` alone, after ``tokens``. Tokens already there cost nothing but the message; the
    tokens refilled this way carry no logprobs (the engine that made them is gone)."""
    if flight.outbox is None or tokens is None or not refill:
        if out.new_token_ids or out.finish_reason is not None:
            flight.deliver(out, None if tokens is None else len(tokens))
        return
    if not tokens and out.finish_reason is None:
        return
    out.new_token_ids = list(tokens) + out.new_token_ids
    flight.deliver(out, 0)
