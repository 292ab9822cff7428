"""``KVPeers``: how the ``SchedulerActor`` connects its workers' KV transports (a mixin):
each new instance's workers and the others learn how to reach one another (``nixl``: agents
and pool layouts), ``transport: auto`` falls back to ``ray`` at start when they cannot, and a
rejoined instance is connected before it serves again."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from cluster.config import ClusterConfig
from cluster.control.adapters import LoRAAdapters
from cluster.control.placement import MONITOR, InstanceSpec
from cluster.control.summaries import InstanceView

logger = logging.getLogger(__name__)

# A rejoined instance whose workers cannot reach the others (or be reached) tries again after
# these pauses, then every last one: a peer that died during its probe, or a passing network
# fault, must not keep it out for good. Its workers' transport being another is final.
REJOIN_RETRY_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)


class KVPeers:
    """The KV transport's connections between the cluster's workers."""

    # What of the actor this uses (annotations only: the actor's own or its other mixins').
    config: ClusterConfig
    specs: dict[str, InstanceSpec]
    engines: dict[str, Any]  # InstanceEngine or RemoteEngine
    views: dict[str, InstanceView]
    failures: list[dict[str, Any]]
    lora: LoRAAdapters
    autoscaler: Any  # control.autoscaler.Autoscaler
    _kv_auto: bool
    _new_view: Callable[[InstanceSpec], InstanceView]
    _spawn: Callable[[Coroutine[Any, Any, None]], None]

    @property
    def kv_fallback(self) -> str | None:
        """The KV transport a new worker falls back to if its own cannot be set up."""
        return "ray" if self._kv_auto else None

    async def _connect_kv_peers(self, specs: list[InstanceSpec]) -> None:
        """Tell every worker how to reach the new instances' workers, and these the others
        (the ``nixl`` transport). Under ``transport: auto`` a new instance first reads a
        little from each other instance: if it cannot, the cluster's first instances fall
        back to ``ray``; a later one is refused. A transport the user named is never swapped
        for another: an instance it cannot connect is refused (``RuntimeError``)."""
        from cluster.control.placement import connect_kv_peers, disconnect_kv_peers, kv_peer_names

        if not self.config.disaggregated:
            return
        probe = self._kv_auto and self.config.kv_transfer.transport == "nixl"
        live = [s for i, s in self.specs.items() if self.views[i].alive]
        wait = self._kv_peers_wait_s()
        errors = await connect_kv_peers([*live, *specs], specs, probe, wait)
        self._fail_unanswered(live)
        # A new one that did not answer is an error (refused below): its mark goes with it --
        # left, it would fail the instance in a later round, had the first start fallen back.
        hung = [spec for spec in specs if spec.unanswered is not None]
        for spec in hung:
            spec.unanswered = None
        if not errors:
            if specs and not self.specs:
                how = " (auto)" if self._kv_auto else ""
                logger.info("KV transport: %s%s", self.config.kv_transfer.transport, how)
            return
        # ``transport: nixl`` as configured: no fallback; nor for a worker that hangs (its
        # ``use_kv_transport`` would never answer either).
        if self.specs or not self._kv_auto or hung:
            # Refused: the live workers, told of the new ones, forget them (their agents'
            # endpoints and handles stayed for as long as the workers lived).
            names = [name for spec in specs for name in kv_peer_names(spec)]
            await disconnect_kv_peers(live, names, wait)
            raise RuntimeError(f"the nixl KV transport cannot reach: {'; '.join(errors)}")
        logger.warning(
            "KV transport: nixl cannot reach every worker (%s); falling back to ray",
            "; ".join(errors),
        )
        self.config = self.config.with_kv_transport("ray")
        options = self.config.kv_transfer.connector_options()
        for spec in specs:
            await spec.call_stages("use_kv_transport", "ray", options)
            spec.kv_peers = []

    def _kv_peers_wait_s(self) -> float:
        """How long a connection round waits for an instance's workers (``placement``)."""
        from cluster.control.placement import kv_peers_timeout_s

        return kv_peers_timeout_s(self.config.step_timeout_s)

    def _fail_unanswered(self, specs: list[InstanceSpec]) -> None:
        """Instances whose workers did not answer a connection round in time
        (``_kv_peers_wait_s``) hang: each fails as after a step timeout -- its
        requests move, its workers are ended (and, with max_restarts, come back and rejoin)
        -- rather than serve without the peers the round was for."""
        for spec in specs:
            why = spec.unanswered
            if why is None:
                continue
            spec.unanswered = None
            engine = self.engines.get(spec.instance_id)
            if engine is not None:
                reason = f"instance {spec.instance_id}: {why} (hung)"
                logger.error("%s", reason)
                engine.fail(reason, hung=True)

    def _rejoined(self, iid: str) -> None:
        """A failed instance is back with a fresh scheduler: a new view (empty cache)."""
        spec = self.specs[iid]
        draining = self.views[iid].draining
        self.views[iid] = view = self._new_view(spec)
        view.draining = draining
        self.lora.reset(iid)
        if self.config.disaggregated:  # its workers' KV transport is new: connect it first
            view.alive = False
            self._spawn(self._rejoin_kv(iid, view, len(self.failures)))
        else:
            self._serves_again(iid)

    def _serves_again(self, iid: str) -> None:
        logger.info("instance %s rejoined with an empty cache", iid)
        # Its pool has its size back: the latencies of the outage (a smaller pool's) and a
        # wish timed on them would grow it on a load it now serves.
        spec = self.specs.get(iid)
        if spec is not None:
            self.autoscaler.resized(spec.pool.name)
        self.failures.append(
            {"instance_id": iid, "event": "rejoined", "reason": "", "time": time.time()}
        )

    async def _rejoin_kv(self, iid: str, view: InstanceView, mark: int) -> None:
        """A rejoined instance's workers: the cluster's KV transport (a restarted process
        starts with the one it was created with, which ``auto`` may have left), their new
        agents handed to every worker and the others' to them; then it serves again. A probe
        that fails (a peer died meanwhile: its own failure is being handled) is tried again
        (``REJOIN_RETRY_S``) with the instances alive then; the first failure is recorded."""
        from cluster.control.placement import kv_peer_names

        spec = self.specs[iid]
        before = kv_peer_names(spec)  # its workers' previous agents: the others forget them
        refused = False
        for attempt in itertools.count():
            if attempt:
                await asyncio.sleep(REJOIN_RETRY_S[min(attempt, len(REJOIN_RETRY_S)) - 1])
            if self._left_or_failed(iid, view, mark):
                return
            problem, final = await self._connect_rejoined(iid, spec, before)
            if self._left_or_failed(iid, view, mark):  # failed again, or left
                return
            if problem is None:
                break
            # Until it connects it would fail every hand-off: it stays out of routing.
            logger.error(
                "instance %s cannot rejoin: KV transport: %s%s",
                iid,
                problem,
                "" if final else " (trying again)",
            )
            if not refused:
                refused = True
                self.failures.append(
                    {"instance_id": iid, "event": "failed", "reason": f"KV transport: {problem}"}
                    | {"time": time.time()}
                )
                mark = len(self.failures)  # (this failure is not one that ends the rejoin)
            if final:
                return
        view.alive = True
        self._serves_again(iid)

    def _left_or_failed(self, iid: str, view: InstanceView, mark: int) -> bool:
        """The rejoining instance failed again since ``mark``, or left its pool."""
        return self.views.get(iid) is not view or any(
            f["instance_id"] == iid and f["event"] == "failed" for f in self.failures[mark:]
        )

    async def _connect_rejoined(
        self, iid: str, spec: InstanceSpec, before: list[str]
    ) -> tuple[str | None, bool]:
        """Connect a rejoined instance's workers with the live ones: what failed (None:
        nothing), and whether that is final (its workers use another transport)."""
        from cluster.control.placement import (
            KV_PEERS_TIMEOUT_S,
            connect_kv_peers,
            disconnect_kv_peers,
            kv_peer_names,
        )

        wait = self._kv_peers_wait_s()

        # A worker that hangs fails this try, not the rejoin. The monitor's calls (``step``
        # False) wait behind no step.
        def within(call: Any, step: bool = True) -> Any:
            return asyncio.wait_for(call, wait if step else KV_PEERS_TIMEOUT_S)

        transport = self.config.kv_transfer.transport
        try:
            health = await within(spec.call_stages("health", group=MONITOR), step=False)
            if any(h.get("kv_transport") != transport for h in health):
                options = self.config.kv_transfer.connector_options()
                await within(spec.call_stages("use_kv_transport", transport, options))
                health = await within(spec.call_stages("health", group=MONITOR), step=False)
            used = {h.get("kv_transport") for h in health}
            if used != {transport}:  # e.g. NIXL cannot start there any more: it fell back
                return f"its workers use {sorted(map(str, used))}, the cluster {transport}", True
            probe = self._kv_auto and transport == "nixl"
            while True:
                live = [s for i, s in self.specs.items() if self.views[i].alive or i == iid]
                connected = {s.instance_id: self.views[s.instance_id] for s in live}
                errors = await connect_kv_peers(live, [spec], probe, wait)
                self._fail_unanswered(live)  # (itself included: its failure ends the rejoin)
                gone = [n for n in before if n not in kv_peer_names(spec)]
                await disconnect_kv_peers([s for s in live if s is not spec], gone, wait)
                if errors or not self._serving_since(connected):
                    return "; ".join(errors) or None, False
        except TimeoutError:  # (its str is empty)
            return f"its workers did not answer within {wait:g} s", False
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}", False

    def _serving_since(self, connected: dict[str, InstanceView]) -> list[InstanceSpec]:
        """The instances alive now that are not among ``connected`` (the ones a connection
        round took, with their views then): they joined or rejoined during it, connecting
        without the instance that round was for (not alive then), as it without them --
        neither has the other's agents. One that failed and rejoined during the round (a new
        view: ``_rejoined``) counts too: its restarted workers have new agents. Whichever of
        two such instances is let serve second connects again, with the other.
        Call it right before letting an instance serve (no ``await`` in between)."""
        return [
            s
            for i, s in self.specs.items()
            if self.views[i].alive and connected.get(i) is not self.views[i]
        ]

    async def _connect_serving_since(
        self, specs: list[InstanceSpec], connected: dict[str, InstanceView]
    ) -> None:
        """New instances ``specs``, connected with the instances ``connected`` (alive then),
        are about to serve: connect them with any that rejoined meanwhile (``_serving_since``);
        ``RuntimeError`` if they cannot reach one (as ``_connect_kv_peers`` refuses them)."""
        from cluster.control.placement import connect_kv_peers, disconnect_kv_peers, kv_peer_names

        if not self.config.disaggregated:
            return
        probe = self._kv_auto and self.config.kv_transfer.transport == "nixl"
        wait = self._kv_peers_wait_s()
        while missed := self._serving_since(connected):
            connected.update({s.instance_id: self.views[s.instance_id] for s in missed})
            errors = await connect_kv_peers([*missed, *specs], specs, probe, wait)
            self._fail_unanswered(missed)
            if errors:
                # Refused: every live worker told of them forgets them -- the ones
                # ``_connect_kv_peers`` told, and those of earlier rounds here, not only
                # this round's (the new ones are not among ``specs`` yet).
                names = [name for spec in specs for name in kv_peer_names(spec)]
                await disconnect_kv_peers(list(self.specs.values()), names, wait)
                raise RuntimeError(
                    f"the {self.config.kv_transfer.transport} KV transport "
                    f"cannot reach: {'; '.join(errors)}"
                )
