"""``Dispatch``: how the ``SchedulerActor`` places a request (a mixin): it routes the flight
-- again, past instances whose node lacks its LoRA adapter's files and past instances that
failed while the adapter loaded -- and gives its request, under a fresh internal id, to the
chosen instance's engine (the prefill part, or the whole request to a decode instance)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from cluster.config import ClusterConfig
from cluster.control.adapters import LoRAAdapters
from cluster.control.flights import Flight, clone_request, prefill_request
from cluster.control.held import Placement
from cluster.control.router import Route, Router
from cluster.control.summaries import InstanceView
from cluster.errors import AdapterLoadError, UnavailableError
from scheduler import Request
from scheduler.outputs import EngineCoreOutput

MAX_LOST_ROUTES = 3  # a request routed to an instance that failed meanwhile is routed again
KEPT_FAILING = "instances kept failing while the request was being routed"


class Dispatch:
    """Routing a flight and handing its request to an instance's engine."""

    # What of the actor this uses (annotations only: the actor's own or its other mixins').
    config: ClusterConfig
    router: Router
    lora: LoRAAdapters
    engines: dict[str, Any]  # InstanceEngine or RemoteEngine
    roles: dict[str, str]
    failures: list[dict[str, Any]]
    flights: dict[str, Flight]
    _internal: dict[str, Flight]
    _seq: Iterator[int]
    _live: Callable[[str], list[InstanceView]]
    _end: Callable[..., None]

    async def _place(self, flight: Flight) -> None:
        """Route the flight and give its request to the chosen instance(s), under a fresh
        internal id. Tokens already sent travel with it (a move after a failure): the new
        instance recomputes prompt + those tokens and continues after them."""
        request = flight.request
        placed_as = flight.internal_id
        # Routed again, without them, past instances whose node lacks the adapter's files
        # (another node may have them: the router knows nothing of adapters) -- at most once
        # per instance -- and past routes lost to an instance that failed or left while the
        # adapter loaded, at most MAX_LOST_ROUTES times.
        cannot: set[str] = set()
        missing: AdapterLoadError | None = None
        lost = 0
        for attempt in itertools.count():
            live = self._live("decode")
            decode = [v for v in live if v.instance_id not in cannot]
            if not decode:
                if missing is not None and not lost:  # no live instance's node has them
                    raise missing  # (the 404)
                if missing is not None:  # one that may have had them failed: retryable
                    raise UnavailableError(KEPT_FAILING)
                raise RuntimeError(self._none_left("decode"))
            prefill = [v for v in self._live("prefill") if v.instance_id not in cannot]
            if flight.sent:  # moving mid-stream: straight to a decode instance
                route = Route(None, self.router.best_decode(decode))
            else:
                first = attempt == 0 and flight.num_moves == 0
                route = self.router.route(request, prefill, decode, first)
            target = route.prefill or route.decode
            if request.lora_request is not None:
                view = target
                try:
                    for view in {route.decode, target}:
                        await self.lora.ensure(view.instance_id, request.lora_request)
                except KeyError:  # the instance left its pool meanwhile
                    lost += 1
                    if lost >= MAX_LOST_ROUTES:
                        raise UnavailableError(KEPT_FAILING) from None
                    continue
                except Exception as exc:  # not on that node, or not for this model: a 4xx
                    failure = self.lora.request_error(request.lora_request, view.instance_id, exc)
                    if failure is exc:
                        raise
                    if not (isinstance(failure, AdapterLoadError) and failure.missing):
                        raise failure from None  # the model cannot take it: so on every node
                    missing = failure
                    cannot.add(view.instance_id)
                    continue
            if target.serves and route.decode.serves:
                if cannot:  # its siblings still to come go where it went, not where it failed
                    self.router.follow(request, route)
                break
            lost += 1  # it failed (or began to drain) while the adapter loaded
            if lost >= MAX_LOST_ROUTES:  # (retryable: a 503, not a bare RuntimeError's 500)
                raise UnavailableError(KEPT_FAILING)
        if self.flights.get(request.request_id) is not flight:
            # Aborted while an adapter loaded, or (a move) its id was reused meanwhile.
            self._internal.pop(flight.internal_id, None)
            return
        if flight.internal_id != placed_as:
            return  # placed meanwhile, while an adapter loaded (by another move)
        if flight.aborting is not None:  # its abort went to an engine that no longer held it
            self._end(flight, flight.aborting, tokens=flight.sent)
            return
        # Schedulers see a unique internal id: an aborted request may linger in one (its
        # blocks wait for a load to end) while the client already reuses its id.
        self._internal.pop(flight.internal_id, None)
        flight.internal_id = internal = f"{request.request_id}@{next(self._seq)}"
        self._internal[internal] = flight
        if route.prefill is None:
            flight.stage = "decode"
            part = clone_request(request, request_id=internal, output_token_ids=list(flight.sent))
            hand_off = False
        else:
            flight.stage = "prefill"
            flight.decode_target = route.decode
            part = prefill_request(request, internal)
            if flight.trace is not None:  # the prefill worker's save joins the trace
                from kv_transfer.tracing import inject

                assert part.kv_transfer_params is not None
                part.kv_transfer_params["trace_context"] = inject(flight.trace.root)
            wanted = request.sampling_params.max_tokens
            hand_off = wanted is None or wanted > 1
        self._send(target, flight, part, hand_off)

    def _send(self, view: InstanceView, flight: Flight, part: Request, hand_off: bool) -> None:
        """Give ``part`` (the flight's request under its internal id) to ``view``'s instance
        (counted in its view at once); its outputs go straight to the flight's client."""
        view.sent(max(part.num_tokens - part.num_computed_tokens, 0))
        flight.instance = view.instance_id
        if flight.trace is not None:  # a prefill part opens no decode span at its first
            flight.trace.hand_off = hand_off  # token (the decode instance's opens there)

        def sink(out: EngineCoreOutput, index: int) -> None:
            flight.deliver(out, index)

        placement = Placement(
            part,
            flight.request.request_id,
            sink,
            hand_off=hand_off,
            num_cached_tokens=flight.num_cached_tokens,
            arrival_time=flight.request.arrival_time,
            scheduled_at=flight.scheduled_at,
            first_token_at=flight.first_token_at,
            last_token_at=flight.last_token_at,
            trace=flight.trace,
            client_id=flight.client_id,
            submission=flight.tag,
            client_params=flight.request.sampling_params if hand_off else None,
        )
        self.engines[view.instance_id].add([placement])

    def _none_left(self, role: str) -> str:
        roles = ("decode", "both") if role == "decode" else ("prefill",)
        ids = [i for i, r in self.roles.items() if r in roles]
        failed = [f for f in self.failures if f["instance_id"] in ids and f["event"] == "failed"]
        last = f"; last failure: {failed[-1]['reason']}" if failed else ""
        return (
            f"no live {role}-capable instance (role {' or '.join(roles)}): "
            f"{len(ids)} configured, none alive{last}"
        )
