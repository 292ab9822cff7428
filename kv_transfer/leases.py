"""Leases: KV blocks a worker keeps for someone to pull (the in-place transports, ``grpc``).

A lease names a request's blocks on one worker for a layer range, until every layer has been
pulled at least once or the lease expires. Pulls pin it while they read, so an expiry never
frees blocks under a reader. The worker's step thread adds leases and collects the ended ones
(``finished_sending``); server threads pin and unpin them.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class Lease:
    """``block_ids`` of ``req_id`` for the model ``layers``, held until ``expires``."""

    req_id: str
    block_ids: list[int]
    layers: range
    expires: float  # time.monotonic()
    unpulled: set[int] = field(default_factory=set)  # model layers no pull has sent yet
    active: int = 0  # pulls streaming now: the lease cannot expire under them
    ended: bool = False  # (a pull in progress checks it before its last message)
    released: bool = False  # no one will read the rest: it ends with its last pull


class LeaseTable:
    """The leases of one worker. Thread-safe: the step thread adds leases and collects ended
    ones; the server's threads pin a lease for the duration of a pull."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._by_req: dict[str, set[str]] = {}  # req_id -> its live lease ids
        self._ended: set[str] = set()  # req_ids whose last lease ended, not yet reported
        # Leases that ran out unread: the decode side failed, or nobody told this side that no
        # one will read (a release ends a lease at once; in a healthy cluster this stays 0).
        self.num_expired = 0

    def add(self, req_id: str, block_ids: list[int], layers: range, duration_s: float) -> str:
        lease_id = secrets.token_hex(16)  # unguessable: a second secret besides the token
        lease = Lease(req_id, list(block_ids), layers, time.monotonic() + duration_s)
        lease.unpulled = set(layers)
        with self._lock:
            self._leases[lease_id] = lease
            self._by_req.setdefault(req_id, set()).add(lease_id)
        return lease_id

    def pin(self, lease_id: str, layers: range) -> Lease:
        """Start a pull of ``layers``: ``KeyError`` if the lease is gone, ``ValueError`` if the
        layers are not within it."""
        with self._lock:
            lease = self._leases[lease_id]
            if (
                len(layers) == 0
                or layers.start < lease.layers.start
                or layers.stop > lease.layers.stop
            ):
                raise ValueError(f"layers {layers} are not within the lease's {lease.layers}")
            lease.active += 1
            return lease

    def unpin(self, lease_id: str, layers: range, complete: bool) -> None:
        """A pull ended; ``complete``: every byte of ``layers`` was sent."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return
            lease.active -= 1
            if complete:
                lease.unpulled.difference_update(layers)
                if not lease.unpulled and lease.active == 0:
                    self._end(lease_id)

    def take_ended(self) -> set[str]:
        """Req ids whose leases all ended (pulled, or expired now) since the last call."""
        now = time.monotonic()
        with self._lock:
            for lease_id, lease in list(self._leases.items()):
                if lease.active:
                    continue
                if not lease.unpulled or lease.released:
                    self._end(lease_id)  # pulled (the last pull ended after another) or let go
                elif now >= lease.expires:
                    logger.info(
                        "KV lease of %s expired with layers %s unpulled",
                        lease.req_id,
                        sorted(lease.unpulled),
                    )
                    self.num_expired += 1
                    self._end(lease_id)
            # A request that leases again in the same step (its old save released, its
            # recomputed prompt saved: a preemption) is not done sending: reporting the old
            # lease's end would free the blocks the new one still lends.
            ended = self._ended - self._by_req.keys()
            self._ended = set()
        return ended

    def end_request(self, req_id: str) -> None:
        """``req_id``'s leases end now, unless a pull is reading one (it ends after it)."""
        with self._lock:
            for lease_id in list(self._by_req.get(req_id, ())):
                lease = self._leases[lease_id]
                if lease.active:
                    lease.released = True  # ends with its last pull (take_ended)
                else:
                    self._end(lease_id)

    def end_all(self) -> None:
        """Every lease ends now, unreported: the caches they point into are gone, and so is
        the scheduler that would free their blocks (new caches come with a fresh one). A
        report would reach that fresh scheduler, which may hold a request of the same id
        again (a lost request placed anew): its new lease's blocks would be freed early."""
        with self._lock:
            for lease_id in list(self._leases):
                self._end(lease_id)
            self._ended = set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def _end(self, lease_id: str) -> None:
        lease = self._leases.pop(lease_id)
        lease.ended = True
        live = self._by_req[lease.req_id]
        live.discard(lease_id)
        if not live:
            del self._by_req[lease.req_id]
            self._ended.add(lease.req_id)
