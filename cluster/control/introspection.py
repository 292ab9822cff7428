"""What operators read of the central scheduler (a mixin of ``SchedulerActor``): the
cluster's metrics, where each request is, the instances' stats, worker health and transfer
history, what the cluster was built from; and the test hooks (fault injection, integrity,
prefix-cache reset)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from cluster.config import ClusterConfig
from cluster.control.flights import Flight
from cluster.control.observer import RequestObserver
from cluster.control.operations import answer
from cluster.control.placement import MONITOR, InstanceSpec


class Introspection:
    """Metrics and introspection over a ``SchedulerActor``'s state."""

    # The actor's state (set by SchedulerActor.__init__ and start).
    config: ClusterConfig
    declared: ClusterConfig  # as given (``config`` has ``transport: auto`` resolved)
    engines: dict[str, Any]  # InstanceEngine or RemoteEngine
    roles: dict[str, str]
    specs: dict[str, InstanceSpec]
    flights: dict[str, Flight]
    max_model_len: int
    num_moves: int
    failures: list[dict[str, Any]]
    observe: RequestObserver
    autoscaler: Any  # control.autoscaler.Autoscaler

    # ... and what of the actor this uses.
    async def _ready(self) -> None:
        raise NotImplementedError

    # -- metrics ----------------------------------------------------------------------------
    async def metrics_text(self) -> str:
        """Prometheus exposition text of the whole cluster (``/metrics``): the engine
        actors' request metrics merged with this process's."""
        remote = [e for e in self.engines.values() if e.remote]
        others = list(await asyncio.gather(*(e.metrics_text() for e in remote)))
        return self.observe.render(await self.stats(), others)

    # -- introspection -----------------------------------------------------------------------
    def live_request_ids(self) -> list[str]:
        """Ids of the requests in flight (for operators and tests)."""
        return sorted(self.flights)

    async def requests(self) -> dict[str, dict[str, Any]]:
        """Where each request in flight is: its ``instance``, its ``phase`` (``queued``: not
        scheduled there yet, or preempted; ``prefill``; ``transfer``: its KV is being loaded
        on the decode instance; ``decode``), the tokens sent to its client so far and how
        often it moved off a failed instance."""
        by_instance: dict[str, list[str]] = {}
        for flight in self.flights.values():
            by_instance.setdefault(flight.instance, []).append(flight.internal_id)
        where: dict[str, tuple[str | None, int | None]] = {}
        for iid, ids in by_instance.items():
            engine = self.engines.get(iid)
            if engine is not None:
                where.update(await answer(engine.describe_requests(ids)))
        result = {}
        for rid, flight in sorted(self.flights.items()):
            phase, sent = where.get(flight.internal_id, (None, None))
            result[rid] = {
                "instance": flight.instance,
                "phase": phase or "queued",
                "num_tokens_sent": len(flight.sent) if sent is None else sent,
                "num_moves": flight.num_moves,
            }
        return result

    def settings(self) -> dict[str, Any]:
        """What the cluster was built from (``ClusterConfig.cluster_settings``), to tell
        whether a new deployment may reuse it."""
        return self.declared.cluster_settings()

    async def model_info(self) -> dict[str, Any]:
        """What a client needs to tokenize and validate: the model and the context length."""
        await self._ready()
        first = next(iter(self.specs.values())).info
        return {
            **first,
            "max_model_len": self.max_model_len,
            "priority_scheduling": self.config.priority_scheduling,
        }

    def _kv_transport(self) -> str | None:
        """The KV transport the workers use (``auto`` resolved); None without P/D."""
        return self.config.kv_transfer.transport if self.config.disaggregated else None

    def describe(self) -> dict[str, Any]:
        # Serve's health check of the app's cluster calls this every few seconds: a restarted
        # central actor rebuilds (and its autoscaler runs again) without waiting for a
        # client, an engine's report or an operator -- none may come to an idle cluster.
        kick = getattr(self, "_kick_recovery", None)
        if kick is not None:
            kick()
        return {
            "instances": {
                iid: {
                    "role": self.roles[iid],
                    "pool": spec.pool.name,
                    "node_id": spec.info.get("node_id"),
                    "num_blocks": spec.info["num_blocks"],
                }
                for iid, spec in self.specs.items()
            },
            "max_model_len": self.max_model_len,
            "kv_transport": self._kv_transport(),
        }

    async def stats(self) -> dict[str, Any]:
        """Per-instance state: requests held, KV usage, counters (for tests and metrics)."""
        await self._ready()
        engines = list(self.engines.items())  # asked at once: one slow engine costs its wait
        answers = await asyncio.gather(*(answer(e.stats()) for _, e in engines))
        instances = {iid: answer for (iid, _), answer in zip(engines, answers, strict=True)}
        return {
            "pid": os.getpid(),
            "num_flights": len(self.flights),
            "num_moves": self.num_moves,
            "failures": list(self.failures),
            "kv_transport": self._kv_transport(),
            "instances": instances,
            "autoscaling": self.autoscaler.stats() if self.autoscaler.enabled else {},
        }

    async def transfer_history(self) -> dict[str, list[Any]]:
        """Every instance's finished KV loads (``TransferRecord``s), for benchmarks: every
        stage's records (each moves its own layers); a dead worker's died with it."""
        result: dict[str, list[Any]] = {}
        for iid, spec in self.specs.items():
            stages = await spec.call_stages(
                "transfer_history", group=MONITOR, return_exceptions=True
            )
            result[iid] = [r for stage in stages if isinstance(stage, list) for r in stage]
        return result

    async def worker_health(self) -> dict[str, dict[str, Any]]:
        """Each instance's ``health()`` (node id, pid, state): its first worker's, with every
        pipeline stage's under ``stages``."""
        result: dict[str, dict[str, Any]] = {}
        for iid, spec in self.specs.items():
            stages = [
                s if isinstance(s, dict) else {"ok": False, "error": f"{type(s).__name__}"}
                for s in await spec.call_stages("health", group=MONITOR, return_exceptions=True)
            ]
            result[iid] = {**stages[0], "stages": stages}
        return result

    async def set_fault_injection(
        self, instance_id: str, load_delay_s: float = 0.0, step_delay_s: float = 0.0
    ) -> None:
        """Testing: slow one instance's worker down (``ModelWorker.set_fault_injection``)."""
        await self.specs[instance_id].call_stages("set_fault_injection", load_delay_s, step_delay_s)

    async def check_integrity(self) -> None:
        """Raise ``AssertionError`` if any instance's scheduler is inconsistent."""
        for engine in list(self.engines.values()):
            await answer(engine.check_integrity())

    async def reset_prefix_cache(self) -> bool:
        done = [await answer(e.reset_prefix_cache()) for e in list(self.engines.values())]
        return all(done)
