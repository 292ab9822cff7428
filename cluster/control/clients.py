"""The clients that stream from the SchedulerActor in batches (``submit`` / ``subscribe``):
each one's ``Outbox`` and whether it still lives.

A client is a ``ClusterClient``'s ``Subscription`` (one per event loop: a driver, an ingress
replica). Its requests' outputs wait in its outbox, merged per request, until its stream takes
them: one Ray message per batch, whatever the number of requests. A client whose stream ends
or that falls silent is dropped, and its unfinished requests are aborted -- Ray does not end
the stream of a caller whose process died, so keep-alives are what tell.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from typing import Any

from cluster.control.flights import Flight, Outbox, Submission
from cluster.errors import ClientDroppedError
from scheduler.outputs import EngineCoreOutput

logger = logging.getLogger(__name__)

DROPPED_REMEMBERED = 10_000  # client ids kept to refuse their late submits (ids are unique)


class Clients:
    """Outboxes and keep-alives by client id. ``flights`` is the actor's own dict (read to
    find a client's requests); ``abort`` ends one request by its client id."""

    def __init__(
        self,
        flights: dict[str, Flight],
        abort: Callable[[str], bool],
        timeout_s: float,
        on_drop: Callable[[str], None] | None = None,
        on_resubscribe: Callable[[str], None] | None = None,
    ) -> None:
        self._flights = flights
        self._abort = abort
        self._on_drop = on_drop  # told each client dropped (after its requests' aborts)
        # Told each client whose new stream takes over one still running here (``stream``).
        self._on_resubscribe = on_resubscribe
        self.timeout_s = timeout_s
        self._outboxes: dict[str, Outbox] = {}
        self._seen: dict[str, float] = {}  # client id -> its last keep-alive (or submit)
        self._dropped: OrderedDict[str, None] = OrderedDict()  # the latest dropped clients
        self._streams: dict[str, int] = {}  # client id -> the number of its latest stream

    def outbox(self, client_id: str) -> Outbox:
        """The client's outbox (a new one if it has none: ``submit`` may come first).
        ``ClientDroppedError`` (a 503, retryable) for a client that was dropped: a submit
        still on its way when the client timed out must fail, not wait in an outbox nobody
        reads."""
        if client_id in self._dropped:
            raise ClientDroppedError(f"client {client_id} was dropped (timed out or unsubscribed)")
        outbox = self._outboxes.get(client_id)
        if outbox is None:
            outbox = self._outboxes[client_id] = Outbox()
            # A client that submits but never subscribes or keeps alive is reaped too.
            self._seen.setdefault(client_id, time.monotonic())
        return outbox

    async def stream(
        self, client_id: str, first: Callable[[], dict[str, Any]] | None = None
    ) -> AsyncGenerator[list[tuple[Submission, EngineCoreOutput, int | None]] | dict[str, Any]]:
        """The client's batches until it is dropped (``SchedulerActor.subscribe``), and the
        notices for every client (``notify_engines``: a dict) in between; dropped when the
        stream ends, however it ends. A client that subscribes again while its earlier
        stream still runs here (it saw that stream fail, e.g. a connection lost for a while)
        gets the outbox: the earlier stream stops taking from it and ends without dropping
        the client. ``first``: the stream's first notice, made once it took over (a notice
        the earlier stream takes before then goes to its broken link, and one made before
        would miss it)."""
        outbox = self.outbox(client_id)
        again = client_id in self._streams  # an earlier stream of it still runs here
        number = self._streams[client_id] = self._streams.get(client_id, 0) + 1
        outbox.ready.set()  # (an earlier stream waiting wakes, and leaves)
        if again and self._on_resubscribe is not None:
            # What that stream yielded since it broke never reached the client: the asks
            # for its tokens (``ask_resume``) not answered yet are made again.
            self._on_resubscribe(client_id)
        try:
            if first is not None:
                yield first()
            while True:
                # Nothing is taken before the stream knows it still streams: a batch held
                # across a yield and put back after a takeover would land behind (or merge
                # with) what came meanwhile -- an earlier output after its request's final.
                await outbox.ready.wait()
                if self._streams.get(client_id) != number:  # a later stream took over:
                    return  # (the wake-up stays set for it)
                notice, outbox.notice = outbox.notice, None
                if notice is not None:
                    yield notice
                    continue
                if outbox.resume:
                    asks, outbox.resume = outbox.resume, []
                    yield {"resume": asks}
                    continue
                batch = await outbox.take()  # (set: no wait, nothing runs in between)
                if batch:
                    yield batch
                if outbox.closed and not outbox.pending:
                    return
        finally:
            if self._streams.get(client_id) == number:
                del self._streams[client_id]
                self.drop(client_id, outbox)

    def keepalive(self, client_id: str) -> None:
        self._seen[client_id] = time.monotonic()

    def drop(self, client_id: str, outbox: Outbox | None = None) -> None:
        """Forget the client (only its stream ``outbox``, when given): its stream ends after
        what is pending, and its unfinished requests are aborted."""
        current = self._outboxes.get(client_id)
        if current is None or (outbox is not None and current is not outbox):
            return
        del self._outboxes[client_id]
        self._seen.pop(client_id, None)
        self._dropped[client_id] = None
        while len(self._dropped) > DROPPED_REMEMBERED:
            self._dropped.popitem(last=False)
        current.close()
        for rid in [r for r, f in self._flights.items() if f.outbox is current]:
            self._abort(rid)
        if self._on_drop is not None:
            self._on_drop(client_id)

    def ask_resume(self, client_id: str, iid: str, submissions: list[Submission]) -> bool:
        """Ask the client for the tokens it has of ``submissions`` (its requests on instance
        ``iid``, whose engine died: ``control/migration.py``). False: no such client."""
        outbox = self._outboxes.get(client_id)
        if outbox is None or outbox.closed:
            return False
        outbox.resume.append((iid, list(submissions)))
        outbox.ready.set()
        return True

    def notify_engines(self, engines: dict[str, Any]) -> None:
        """Tell every client the engine actors to stream from (``{iid: handle}``: the
        subscription's first notice's form), before its next batch (the latest only)."""
        for outbox in self._outboxes.values():
            outbox.notice = {"engines": engines}
            outbox.ready.set()

    async def reap_silent(self) -> None:
        """Forever: drop every client that sent a keep-alive once and then none for
        ``timeout_s`` (clients that never send one -- in-process callers -- are never
        dropped)."""
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s / 2))
            now = time.monotonic()
            for client_id, seen in list(self._seen.items()):
                if now - seen > self.timeout_s:
                    del self._seen[client_id]
                    if client_id in self._outboxes:
                        logger.warning("client %s is silent: its requests are aborted", client_id)
                        self.drop(client_id)

    def close_all(self) -> None:
        """Shutting down: every stream ends once its last batch is taken."""
        for outbox in self._outboxes.values():
            outbox.close()
