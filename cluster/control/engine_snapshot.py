"""What an ``EngineActor`` (``engine_actor.py``) gives a restarted central scheduler to rebuild
its state from (``EngineSnapshot``): the instance, its load and whole prefix cache, the
requests held there, and what the central actor asked the engines to keep."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from cluster.control.engine import InstanceEngine
from cluster.control.engine_reports import EndedTrace, EngineReport, Prefilled
from cluster.control.engine_wire import EngineSnapshot, HeldSnapshot, Route, shift
from cluster.control.placement import InstanceSpec
from cluster.control.refill import PastRequests


class Snapshots:
    """``EngineActor``'s snapshot (its state is set up by the actor)."""

    spec: InstanceSpec
    max_model_len: int
    _epoch: int
    _next_op: int
    _early_ops: dict[int, list[tuple[Any, ...]]]
    _outgoing: deque[EngineReport]
    _routes: dict[str, Route]
    _awaiting: dict[str, Prefilled]
    _adapters: Any
    _autoscaler: Any
    _stopped: bool
    _max_seq: int
    _past: PastRequests
    _unsent_traces: dict[str, EndedTrace]
    _engine: Callable[[], InstanceEngine]

    def snapshot(self) -> EngineSnapshot:
        """Everything a restarted central scheduler rebuilds its state from: the instance,
        its load and whole prefix cache, and every request held here (prefilled ones whose
        hand-off it did not confirm included). Reports still queued keep their milestones
        but lose their cache events: the snapshot's supersede them."""
        from scheduler.kv_events import AllBlocksCleared, BlockStored

        engine = self._engine()
        self._epoch += 1
        self._next_op = 0
        self._early_ops.clear()
        now = time.monotonic()
        summary = engine.loop.summary()
        pool = engine.loop.scheduler.kv_cache_manager.block_pool
        summary.kv_events = [AllBlocksCleared(), BlockStored(tuple(pool.cached))]
        for queued in self._outgoing:
            queued.summary.kv_events = []
        held: list[HeldSnapshot] = []
        for internal, h in engine.held.items():
            route = self._routes.get(internal)
            if route is None:
                continue
            p = h.placement
            held.append(
                HeldSnapshot(
                    internal,
                    route,
                    p.hand_off,
                    list(h.tokens),
                    h.num_cached_tokens,
                    p.arrival_time - now,
                    None if h.first_scheduled_at is None else h.first_scheduled_at - now,
                    shift(h.first_token_at, -now),
                    shift(h.last_token_at, -now),
                )
            )
        for internal, prefilled in self._awaiting.items():
            route = self._routes.get(internal)
            if route is None:
                continue
            held.append(
                HeldSnapshot(
                    internal,
                    route,
                    True,
                    list(prefilled.first.new_token_ids),
                    prefilled.num_cached_tokens,
                    route.request.arrival_time - now,
                    shift(prefilled.scheduled_at, -now),
                    shift(prefilled.first_token_at, -now),
                    shift(prefilled.first_token_at, -now),
                    prefilled=replace(
                        prefilled,
                        first_token_at=shift(prefilled.first_token_at, -now),
                        scheduled_at=shift(prefilled.scheduled_at, -now),
                    ),
                )
            )
        return EngineSnapshot(
            self.spec,
            self.max_model_len,
            self._epoch,
            engine.draining,
            engine.failed,
            summary,
            held,
            self._adapters,
            self._max_seq,
            self._take_unsent_traces(),
            self._past.ended(),
            autoscaler=self._autoscaler,
            stopped=self._stopped,
        )

    def _take_unsent_traces(self) -> dict[str, EndedTrace]:
        taken, self._unsent_traces = self._unsent_traces, {}
        return taken
