"""What the central scheduler knows of an instance: the engine's per-step ``EngineSummary``
and the ``InstanceView`` built from them.

An instance engine sends one summary per step -- its load, KV usage and the step's prefix-cache
events -- never per-token traffic; the central scheduler's router scores instances on the
views alone, so it works the same whether an engine runs in its process or in another.

Between summaries the central scheduler keeps sending requests. The view counts each one it
sent at once (``sent``) and forgets it when a summary shows the engine received it
(``EngineSummary.num_received``), so a burst routed between two steps spreads over the
instances instead of piling onto the one that looked idle.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from scheduler.kv_events import KVCacheEvent, PrefixIndex


@dataclass(slots=True)
class EngineSummary:
    """One instance engine's state after a step."""

    instance_id: str
    num_received: int  # requests the engine has been given so far (add_request calls)
    queued_tokens: int  # tokens still to compute for the requests it holds
    num_waiting: int  # requests not scheduled yet (arriving, or in the waiting queue)
    num_active: int  # requests it holds, unfinished
    kv_usage: float  # fraction of its KV blocks in use
    kv_events: list[KVCacheEvent] = field(default_factory=list)  # since the last summary


MAX_LATENCIES = 4096  # per instance: a window's worth at any rate the autoscaler acts on


class InstanceView:
    """The central scheduler's picture of one instance, for routing and admission."""

    def __init__(
        self, instance_id: str, role: str, block_size: int, enable_prefix_caching: bool
    ) -> None:
        self.instance_id = instance_id
        self.role = role
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix = PrefixIndex()
        self.alive = True
        self.draining = False  # leaving: gets no new request
        self.kv_usage = 0.0
        self._queued_tokens = 0
        self._num_waiting = 0
        self._num_active = 0
        self._num_sent = 0
        self._unseen: deque[tuple[int, int]] = deque()  # (send number, tokens) not yet summarized
        self._unseen_tokens = 0
        # (when, "ttft" or "tpot", seconds, begun) of its latest requests, the newest last:
        # when it was measured, and when what it measures began (the autoscaler's signals;
        # ``forget_latencies`` drops the old ones).
        self.latencies: deque[tuple[float, str, float, float]] = deque(maxlen=MAX_LATENCIES)

    def latency(self, now: float, kind: str, seconds: float, span_s: float) -> None:
        """A latency measured over the last ``span_s`` seconds (a TTFT: itself; a TPOT: the
        time from the first token to the last)."""
        self.latencies.append((now, kind, seconds, now - span_s))

    def forget_latencies(self, before: float) -> None:
        while self.latencies and self.latencies[0][0] < before:
            self.latencies.popleft()

    def received_so_far(self, num_received: int) -> None:
        """Count from an engine that has been given ``num_received`` requests already (a
        view rebuilt after a central scheduler's restart)."""
        self._num_sent = num_received

    def sent(self, num_tokens: int) -> None:
        """A request of ``num_tokens`` tokens to compute went to the engine."""
        self._num_sent += 1
        self._unseen.append((self._num_sent, num_tokens))
        self._unseen_tokens += num_tokens

    def update(self, summary: EngineSummary) -> None:
        unseen = self._unseen
        while unseen and unseen[0][0] <= summary.num_received:
            self._unseen_tokens -= unseen.popleft()[1]
        self._queued_tokens = summary.queued_tokens
        self._num_waiting = summary.num_waiting
        self._num_active = summary.num_active
        self.kv_usage = summary.kv_usage
        self.prefix.apply(summary.kv_events)

    @property
    def num_sent(self) -> int:
        """Requests sent to the engine so far (the last one's place: ``num_received``)."""
        return self._num_sent

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens + self._unseen_tokens

    @property
    def num_waiting(self) -> int:
        return self._num_waiting + len(self._unseen)

    @property
    def num_active(self) -> int:
        return self._num_active + len(self._unseen)

    @property
    def serves(self) -> bool:
        """Takes new requests: alive and not draining."""
        return self.alive and not self.draining
