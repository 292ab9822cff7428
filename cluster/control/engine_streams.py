"""The client side of an ``EngineActor`` (``engine_actor.py``): each client's stream of its
requests' outputs from this engine, one batch per wake-up, and the refill of what a broken
stream may have lost."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

from cluster.control.clients import DROPPED_REMEMBERED
from cluster.control.engine_wire import Route
from cluster.control.flights import Outbox, Submission, pack_batch
from cluster.control.refill import PastRequests
from scheduler.outputs import EngineCoreOutput

logger = logging.getLogger(__name__)


class ClientStreams:
    """``EngineActor``'s client streams (its state is set up by the actor)."""

    instance_id: str
    _outboxes: dict[str, Outbox]
    _dropped: OrderedDict[str, None]
    _streams: dict[str, int]
    _past: PastRequests
    _break: dict[str | None, bool]
    _unreachable_until: float
    _routes: dict[str, Route]
    num_refilled: int

    def _outbox(self, client_id: str) -> Outbox | None:
        if client_id in self._dropped:
            return None
        outbox = self._outboxes.get(client_id)
        if outbox is None:
            outbox = self._outboxes[client_id] = Outbox()
        return outbox

    async def subscribe(
        self, client_id: str, positions: list[tuple[Submission, int]] | None = None
    ) -> Any:
        """Client ``client_id``'s outputs from this instance, one batch per wake-up (a step's
        outputs of all its requests), packed as ``flights.pack_batch``; ends when the central
        scheduler drops the client or the engine stops. (A generator: Ray streams those.)

        A client whose stream from here broke while this engine lives subscribes again with
        ``positions`` (each open request's next output position at the client): what the
        broken stream may have lost is sent again first (``refill``), and the earlier stream,
        if it still runs here, stops taking the client's outputs."""
        outbox = self._outbox(client_id)
        if outbox is None:
            return
        number = self._streams[client_id] = self._streams.get(client_id, 0) + 1
        if positions:
            self.refill(client_id, positions)
        outbox.streams += 1
        try:
            while True:
                batch = await outbox.take()
                if self._streams.get(client_id) != number:  # a later stream took over
                    for submission, out, index in batch:
                        outbox.put(submission, out, index)
                    return
                if self._break and (
                    self._break.pop(client_id, None) is not None
                    or self._break.pop(None, None) is not None
                ):
                    raise ConnectionError("the stream broke (fault injection)")
                if batch:
                    yield pack_batch(batch)
                if outbox.closed and not outbox.pending:
                    return
        finally:
            outbox.streams -= 1

    def refill(self, client_id: str, positions: list[tuple[Submission, int]]) -> int:
        """Send client ``client_id`` again, from the position it has (``positions``), the
        tokens of each of its requests placed here and of those that ended here lately
        (with their end); returns how many requests were refilled. Tokens sent this way
        carry no logprobs; the client drops what it already has."""
        wanted = dict(positions)
        outbox = self._outbox(client_id)
        if outbox is None or not wanted:
            return 0
        count = 0
        for route in self._routes.values():
            start = wanted.get(route.submission)
            if route.client_id != client_id or start is None or start >= len(route.tokens):
                continue
            out = EngineCoreOutput(route.client_request_id, route.tokens[start:])
            outbox.put(route.submission, out, start)
            count += 1
        count += self._past.refill(outbox, client_id, wanted)
        self.num_refilled += count
        if count:
            logger.info(
                "instance %s: refilled %d requests of %s", self.instance_id, count, client_id
            )
        return count

    def break_streams(self, client_id: str | None = None, unreachable_s: float = 0.0) -> None:
        """Testing: the next batch for ``client_id`` (any client: None) is lost and its
        stream ends with an error, as if the connection broke; the engine lives on. For
        ``unreachable_s`` its pings are answered only after that long (a glitch between it
        and its clients)."""
        self._break[client_id] = True
        self._unreachable_until = time.monotonic() + unreachable_s

    def _drop_client(self, client_id: str) -> None:
        self._dropped[client_id] = None
        while len(self._dropped) > DROPPED_REMEMBERED:
            self._dropped.popitem(last=False)
        self._streams.pop(client_id, None)
        self._past.drop_client(client_id)
        outbox = self._outboxes.pop(client_id, None)
        if outbox is not None:
            outbox.close()
