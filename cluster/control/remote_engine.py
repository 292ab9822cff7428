"""``RemoteEngine``: the central scheduler's end of an ``EngineActor`` -- an instance engine
in a process of its own (``control/engine_actor.py``). It stands where an ``InstanceEngine``
stands in ``SchedulerActor.engines``, with the same methods; what it sends goes out as one
numbered op batch per turn of the event loop (the actor applies them in that order), and
what asks for an answer is a coroutine.

It also watches the actor: one that stops answering ``ping`` (its process died, or it
hangs) is killed and reported to ``on_dead``; so is one that does not stop or hand over
what it holds when its instance leaves. Its requests move on with the tokens their clients
have (``control/migration.py``). What the central scheduler asks of it for operators
(stats, metrics, introspection) waits at most ``engine_ask_timeout_s``: a hung engine does
not hang ``/metrics`` or a resize; one whose ping goes unanswered for
``engine_ping_timeout_s`` is taken for dead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from cluster.config import ClusterConfig
from cluster.control.engine_actor import EngineActor
from cluster.control.engine_reports import EngineReport, Lost
from cluster.control.engine_wire import WirePlacement, rebase_placement, shift
from cluster.control.held import Placement
from cluster.control.placement import InstanceSpec
from cluster.errors import failure_text
from kv_transfer.tracing import root_carrier
from scheduler.request import FinishReason

logger = logging.getLogger(__name__)

ENGINE_WATCH_S = 1.0  # how often an engine is pinged when health checks are off
# How long the central scheduler waits for an engine's answer to what it asks (stats,
# metrics, what it holds) before it goes on without it is ``engine_ask_timeout_s``, for its
# ping ``engine_ping_timeout_s`` (ClusterConfig); for a stop (the step that runs ends first:
# at most ``step_timeout_s``, after which its worker counts as hung anyway) and the
# hand-over after it, this beyond that step.
STOP_TIMEOUT_S = 30.0


def engine_actor_prefix(central_actor_id: str) -> str:
    """The names of a central scheduler's engine actors start with this (its actor id stays
    the same across its restarts)."""
    return f"tandem-engine/{central_actor_id}/"


class RemoteEngine:
    """An instance engine in an ``EngineActor`` (started on the instance's node)."""

    remote = True

    def __init__(
        self,
        config: ClusterConfig,
        spec: InstanceSpec,
        max_model_len: int,
        central: Any,
        on_dead: Callable[[str, str], None],
        attach: tuple[Any, int] | None = None,
    ) -> None:
        """Start the instance's engine actor -- or, with ``attach`` (its handle and the op
        epoch it gave this central scheduler), take on one that runs already (a restarted
        central scheduler)."""
        import ray

        self.config = config
        self.spec = spec
        self.instance_id = spec.instance_id
        self.role = spec.pool.role
        self.failed: str | None = None  # from its reports
        self._draining = False
        self._on_dead = on_dead
        self._epoch = 0 if attach is None else attach[1]
        self._seq = 0
        self._ops: list[tuple[Any, ...]] = []
        self._flush_scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.dead: str | None = None
        self._stopping = False  # ``stop`` began: the engine leaves by design, not by death
        self._last_metrics = ""  # its last ``metrics_text``
        if attach is not None:
            self.actor: Any = attach[0]
            return
        # Detached and named: it outlives a central scheduler that dies (which finds it again
        # by name when it restarts); the central scheduler's shutdown kills it.
        options: dict[str, Any] = {
            "num_cpus": 0,
            "max_concurrency": 10_000,
            "lifetime": "detached",
            "name": engine_actor_prefix(ray.get_runtime_context().get_actor_id() or "")
            + spec.instance_id,
        }
        node = spec.info.get("node_id")
        if node:  # beside its workers: no cross-node hop per step
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
        actor_class: Any = ray.remote(EngineActor).options(**options)
        self.actor = actor_class.remote(config, spec, max_model_len, central)

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the watch (always: ``health_check_interval_s: 0`` turns off the workers'
        checks, but nothing else would notice this process die -- its requests would hang
        and the router send it more); ``ready`` waits for the engine to serve."""
        self._spawn(self._watch())

    async def ready(self) -> None:
        await self.actor.start.remote()

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        self._flush()
        if self.dead is None:
            try:
                await self._ask("stop", timeout_s=self._stop_timeout_s)
            except Exception as exc:  # hung, or dead: its requests move on without it
                logger.warning("instance %s: its engine did not stop: %s", self.instance_id, exc)
                self.declare_dead(f"the engine of instance {self.instance_id} did not stop")

    def close(self) -> None:
        """After ``stop``: the engine's process goes."""
        import ray

        ray.kill(self.actor)

    async def take_all(self) -> tuple[list[EngineReport], list[Lost]]:
        """After ``stop``: the engine's reports not sent yet (ages: apply them with
        ``SchedulerActor.report``) and what it still holds, as lost."""
        if self.dead is not None:
            return [], []
        try:
            reports, lost = await self._ask("take_all", timeout_s=self._stop_timeout_s)
        except Exception as exc:
            logger.warning("instance %s: its engine did not hand over: %s", self.instance_id, exc)
            self.declare_dead(f"the engine of instance {self.instance_id} did not hand over")
            return [], []
        delta = time.monotonic()
        for item in lost:
            item.first_token_at = shift(item.first_token_at, delta)
            item.last_token_at = shift(item.last_token_at, delta)
            item.scheduled_at = shift(item.scheduled_at, delta)
        return reports, lost

    async def wait_drained(self, timeout_s: float = 5.0) -> None:
        """Until the clients took the engine's last outputs (or ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while self.dead is None and time.monotonic() < deadline:
            try:
                # Each call bounded too: an engine cut off (a node partitioned) would hold up
                # the retire, and with it every resize after it.
                left = max(0.0, deadline - time.monotonic())
                if await asyncio.wait_for(self.actor.drained.remote(), left):
                    return
            except Exception:  # (a timeout included)
                return
            await asyncio.sleep(0.05)

    @property
    def alive(self) -> bool:
        return self.dead is None and self.failed is None

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        self._op(("draining", value))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch(self) -> None:
        interval = self.config.health_check_interval_s or ENGINE_WATCH_S
        while self.dead is None:
            await asyncio.sleep(interval)
            try:
                await asyncio.wait_for(self.actor.ping.remote(), self._ping_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.dead is None:
                    # (Its requests end with it where they cannot move, and clients read it:
                    # Ray's text of it -- the actor's id, pid, node address -- is the log's.)
                    logger.warning(
                        "instance %s: its engine's ping failed: %r", self.instance_id, exc
                    )
                    what = failure_text(exc)
                    reason = f"the engine process of instance {self.instance_id} died ({what})"
                    self.declare_dead(reason)
                return

    @property
    def _ping_timeout_s(self) -> float:
        return float(self.config.engine_ping_timeout_s)

    @property
    def _stop_timeout_s(self) -> float:
        return STOP_TIMEOUT_S + (self.config.step_timeout_s or 0.0)

    def declare_dead(self, reason: str) -> None:
        """Take the engine for dead: it is killed (one that only stopped answering must not
        run on) and ``on_dead`` hears it, once."""
        if self.dead is not None:
            return
        self.dead = reason
        logger.warning("%s", reason)
        import ray

        ray.kill(self.actor)
        self._on_dead(self.instance_id, reason)

    # -- requests ----------------------------------------------------------------------------
    def add(self, placements: list[Placement]) -> None:
        wires = []
        delta = -time.monotonic()
        for p in placements:
            assert p.client_id is not None and p.submission is not None
            wire = WirePlacement(
                p.request,
                p.client_request_id,
                p.client_id,
                p.submission,
                p.hand_off,
                p.num_cached_tokens,
                p.arrival_time,
                p.scheduled_at,
                p.first_token_at,
                p.last_token_at,
                p.client_params,
                None if p.trace is None or p.trace.root is None else root_carrier(p.trace.root),
            )
            rebase_placement(wire, delta)
            wires.append(wire)
        self._op(("add", wires))

    def abort(self, internal_ids: list[str]) -> None:
        self._op(("abort", list(internal_ids)))

    def end(self, internal_id: str, reason: FinishReason, error: str | None = None) -> bool:
        """Ask the engine to end the request with a final output to its client. The answer
        comes as a report (finished), so this always says True: the caller waits for it."""
        self._op(("end", internal_id, reason.value, error))
        return True

    def release_kv(self, internal_id: str) -> None:
        """A prefilled request's KV will not be read: its lease ends now."""
        self._op(("release_kv", internal_id))

    def handed_off(self, internal_ids: list[str]) -> None:
        self._op(("handed_off", list(internal_ids)))

    def drop_client(self, client_id: str) -> None:
        self._op(("drop_client", client_id))

    def fail(self, reason: str, hung: bool = False) -> None:
        self._op(("fail", reason, hung))

    def keep_autoscaler(self, memo: Any) -> None:
        """Keep the autoscaler's memo for a restarted central actor (``EngineSnapshot``)."""
        self._op(("autoscaler", memo))

    def keep_adapters(self, registry: Any) -> None:
        """Keep the LoRA registry for a restarted central actor (``EngineSnapshot``)."""
        self._op(("adapters", registry))

    def _op(self, item: tuple[Any, ...]) -> None:
        self._ops.append(item)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._ops or self.dead is not None:
            self._ops = []
            return
        items, self._ops = self._ops, []
        self._spawn(self._sent(self.actor.ops.remote(self._epoch, self._seq, items)))
        self._seq += 1

    async def _sent(self, ref: Any) -> None:
        """An op batch's outcome: an engine that died is declared dead now, not at the next
        ping, and so is one the batch may not have reached (unavailable, or any failure of
        Ray's own: the object lost, the owner gone): the engine applies batches in order, so
        it would hold every later one for ever, with the requests they place, while it went
        on answering pings. One that ran and raised (a bug) is logged: it was applied."""
        import ray

        try:
            await ref
        except ray.exceptions.RayTaskError:
            logger.exception("instance %s: its engine failed an op batch", self.instance_id)
        except Exception as exc:
            if self.dead is None and not self._stopping:
                died = isinstance(exc, ray.exceptions.RayActorError)
                logger.warning("instance %s: an op batch failed: %r", self.instance_id, exc)
                what = failure_text(exc)  # (the reason reaches clients: no Ray internals)
                self.declare_dead(
                    f"the engine process of instance {self.instance_id} died ({what})"
                    if died
                    else f"an op batch may not have reached the engine of instance "
                    f"{self.instance_id} ({what}): every later one would wait for it"
                )

    # -- introspection -----------------------------------------------------------------------
    async def _ask(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """The engine's answer to ``method``; ``TimeoutError`` after ``timeout_s`` (default
        ``engine_ask_timeout_s``)."""
        if timeout_s is None:
            timeout_s = float(self.config.engine_ask_timeout_s)
        self._flush()  # after what was sent before
        try:
            return await asyncio.wait_for(getattr(self.actor, method).remote(*args), timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"the engine of instance {self.instance_id} did not answer {method} "
                f"within {timeout_s:g} s"
            ) from None

    async def holds_requests(self) -> bool:
        if self.dead is not None:
            return False
        try:
            return bool(await self._ask("holds_requests"))
        except TimeoutError:
            return True  # a drain waits for it until its timeout
        except Exception:  # it died meanwhile: what it held moves on (``Migration``)
            return False

    async def describe_requests(
        self, internal_ids: list[str]
    ) -> dict[str, tuple[str | None, int | None]]:
        if self.dead is not None:
            return {}
        try:
            result: dict[str, tuple[str | None, int | None]] = await self._ask(
                "describe_requests", internal_ids
            )
        except Exception:  # hung, or it died meanwhile
            return {}
        return result

    async def stats(self) -> dict[str, Any]:
        if self.dead is not None:
            return {"role": self.role, "alive": False, "dead": self.dead}
        try:
            result: dict[str, Any] = await self._ask("stats")
        except TimeoutError as exc:
            return {"role": self.role, "alive": self.alive, "unresponsive": str(exc)}
        except Exception as exc:  # it died meanwhile (the watch reports it)
            return {"role": self.role, "alive": False, "dead": self.dead or repr(exc)}
        return result

    async def check_integrity(self) -> None:
        await self._ask("check_integrity")

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._ask("reset_prefix_cache"))

    async def metrics_text(self) -> str:
        """The engine's request metrics; its last ones when it does not answer (hung, slow,
        dead): a scrape without them would read its counters as reset to the central
        scheduler's part, and Prometheus's ``rate()`` would add their whole history."""
        if self.dead is not None:
            return self._last_metrics
        try:
            text: str = await self._ask("metrics_text")
        except Exception as exc:  # hung, or it died meanwhile
            logger.warning("/metrics: instance %s's last metrics (%s)", self.instance_id, exc)
            return self._last_metrics
        self._last_metrics = text
        return text

    async def flush_traces(self) -> None:
        if self.dead is None:
            try:  # (its exporter waits up to 5 s itself)
                await self._ask("flush_traces", timeout_s=self.config.engine_ask_timeout_s + 5.0)
            except Exception as exc:  # shutting down: its spans are lost, nothing else
                logger.warning("instance %s: traces not flushed: %s", self.instance_id, exc)
