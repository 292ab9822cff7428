"""What the central actor remembers of requests that are not (or not yet) here: aborts that
came before their request (Ray runs an async actor's calls out of order), and user requests
refused by their first part (their later samples and prompts are refused too)."""

from __future__ import annotations

import time

from cluster.control.flights import Submission
from scheduler import Request


def _user_request_id(request: Request) -> str:
    """The id a part of a user request shares with its other parts: without its sample's
    ``#{i}`` (n > 1) and its prompt's ``-{k}`` (a batch of prompts; the front end's ids)."""
    rid = request.request_id
    if request.num_samples > 1:
        rid = rid.rpartition("#")[0]
    suffix = f"-{request.prompt_index}"
    if request.prompt_index > 0 and rid.endswith(suffix):
        rid = rid[: -len(suffix)]
    return rid


class RefusedRequests:
    """User requests refused by their first part (the waiting bound): their later samples
    and prompts are refused too, not placed, counted and aborted right after (a batch of 64
    prompts under overload, just when the bound matters). Remembered ``ttl_s``, by client."""

    def __init__(self, ttl_s: float = 10.0, max_ids: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.max_ids = max_ids
        self._refused: dict[tuple[str | None, str], float] = {}

    def remember(self, client_id: str | None, request: Request) -> None:
        now = time.monotonic()
        while self._refused and (
            len(self._refused) + 2 > self.max_ids  # (room for the two below)
            or next(iter(self._refused.values())) < now - self.ttl_s
        ):
            del self._refused[next(iter(self._refused))]
        rid = _user_request_id(request)
        self._refused[(client_id, rid)] = now  # its samples
        if rid.endswith("-0"):  # the first prompt of a batch, maybe: its others
            self._refused[(client_id, rid[:-2])] = now

    def refused(self, client_id: str | None, request: Request) -> bool:
        """Whether ``request`` is a later part of a user request refused lately."""
        at = self._refused.get((client_id, _user_request_id(request)))
        return at is not None and at >= time.monotonic() - self.ttl_s


class EarlyAborts:
    """Aborts that arrived before their request. Ray runs an async actor's calls out of order,
    so a client's ``abort`` sent right after its ``submit`` can be handled first: it is
    remembered for ``ttl_s``, and the request ends with ``abort`` as soon as it is submitted.
    An abort of a request that finished recently is not remembered (its id may be reused)."""

    def __init__(self, ttl_s: float = 60.0, max_ids: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_ids = max_ids
        self._pending: dict[str, float] = {}  # request id -> when its abort came
        # Aborts aimed at given submits of their id, as (client, submission): those end only
        # these, never a later submit under the id (``Intake.abort``).
        self._aimed: dict[str, set[tuple[str | None, Submission | None]]] = {}
        self._finished: dict[str, float] = {}  # request id -> when it finished
        self._samples: dict[str, int] = {}  # n > 1 request id -> its samples aborted so far

    def remember(
        self,
        request_id: str,
        taken: int = 0,
        aimed: tuple[str | None, Submission | None] | None = None,
    ) -> None:
        """``taken``: for the id of an ``n > 1`` request, its samples that came already;
        ``aimed``: the one submit (client, submission) it ends (else any of the id)."""
        now = time.monotonic()
        self._prune(now)
        if aimed is not None:
            # It ends that one submit, never a later one: an id that finished lately (an
            # earlier submit of it) is no reason to forget it -- the aimed one may still come.
            if request_id not in self._pending or request_id in self._aimed:
                self._aimed.setdefault(request_id, set()).add(aimed)
            self._pending[request_id] = now
            return
        if request_id not in self._finished:
            self._aimed.pop(request_id, None)
            self._pending[request_id] = now
            if taken:
                self._samples[request_id] = taken

    def remember_family(self, family: str, running: int, num_samples: int | None) -> None:
        """An abort by the id of a request that is not here: as ``remember``, and if it is
        the user's id of an ``n > 1`` request (``running`` of its samples here, of
        ``num_samples``), only for the samples still to come -- none if every sample came
        (running, or ended lately: ``{family}#{i}``)."""
        if num_samples is None:  # none running: yet to come, or ended lately (sample 0)
            if f"{family}#0" not in self._finished:
                self.remember(family)
            return
        came = running + sum(f"{family}#{i}" in self._finished for i in range(num_samples))
        if came < num_samples:
            self.remember(family, taken=came)

    def finished(self, request_id: str) -> None:
        now = time.monotonic()
        self._finished[request_id] = now
        if len(self._finished) > self.max_ids:
            self._prune(now)

    def take(
        self, request_id: str, submit: tuple[str | None, Submission | None] = (None, None)
    ) -> bool:
        """Whether an abort of ``request_id`` waits for it -- for ``submit`` (client,
        submission) when the abort was aimed (and forget that it did)."""
        self._finished.pop(request_id, None)  # a new request under an old id
        aimed = self._aimed.get(request_id)
        if aimed is not None:
            if submit not in aimed:
                return False  # a later submit of the id runs (the aimed one may still come)
            aimed.discard(submit)
            if aimed:  # aborts aimed at other submits of the id wait on for theirs
                when = self._pending.get(request_id)
                return when is not None and time.monotonic() - when <= self.ttl_s
            del self._aimed[request_id]
        when = self._pending.pop(request_id, None)
        self._samples.pop(request_id, None)  # (only ids in ``_pending`` have samples counted)
        return when is not None and time.monotonic() - when <= self.ttl_s

    def take_sample(self, family: str, num_samples: int) -> bool:
        """Whether an abort of the ``n > 1`` request ``family`` waits for this sample of it
        (an abort by the user's id before its samples came); forgotten once ``num_samples``
        of them came, in whatever order."""
        self._finished.pop(family, None)  # a new request under an old id
        if family in self._aimed:
            # Aimed at a submit of a request with that very id (a client's ``Abort``), never
            # at the samples of an ``n > 1`` request that reuses it as its user's id.
            return False
        when = self._pending.get(family)
        if when is None:
            return False
        taken = self._samples.get(family, 0) + 1
        if taken >= num_samples:
            self._pending.pop(family, None)
            self._samples.pop(family, None)
        else:
            self._samples[family] = taken
        return time.monotonic() - when <= self.ttl_s

    def _prune(self, now: float) -> None:
        # ``_aimed`` and ``_samples`` hold ids in ``_pending`` only: what they keep of an
        # abort goes with it, here as where ``take`` and ``take_sample`` end one (no sweep).
        for table in (self._pending, self._finished):
            while table and (
                len(table) > self.max_ids or now - next(iter(table.values())) > self.ttl_s
            ):
                request_id = next(iter(table))
                del table[request_id]
                if table is self._pending:
                    self._aimed.pop(request_id, None)
                    self._samples.pop(request_id, None)
