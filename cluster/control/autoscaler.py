"""The autoscaler: pools that follow the load, driven by the central scheduler (a pool's
``autoscaling`` section; off by default).

Every ``interval_s`` the actor reads each autoscaled pool's signals from its instances' views
-- the requests they hold, their KV usage, and the TTFT / TPOT of their recent requests (each
measured where it happened: a request's TTFT on the instance that sampled its first token,
its TPOT on the one that finished it, from the first token made there: a hand-off's wait
is not the decode pool's pace) -- and its ``PoolPolicy`` names the size it wants:

    ongoing     ceil(requests held / target_ongoing_requests)        (Ray Serve's rule)
    TTFT        a pool grows by one while the TTFT p90 of the requests whose first token it
                sampled breaks the SLO (a prefill pool's; a decode pool's short prompts,
                which conditional disaggregation leaves there; a colocated pool's)
    TPOT, KV    a decode or colocated pool grows by one while its TPOT p90 breaks the SLO,
                or its KV usage passes max_kv_usage
    shrink      one instance at a time, and only with room to spare: the requests held at
                the smaller size under half the target, TTFT p90 under half its target, TPOT
                p90 under 70% of its target, KV usage at the smaller size under 70% of
                max_kv_usage, and the load per instance at the smaller size under 80% of
                the load per instance at which the pool last broke an SLO (``capacity``).
                The last is what keeps a pool that grew on an SLO from shrinking back while
                the load that broke it lasts: at the larger size its latencies are fine and
                each instance holds fewer requests, so the other rules alone would shrink it,
                break the SLO again, and grow it again, a drain and a model load each time.
                The load is the pool's rate of first tokens for a prefill pool (its requests
                come and go within a step or two; unmeasured with too few of them, and then
                the rule waits) and the requests held for the others; ``capacity`` rises
                when the pool carries more per instance with its latencies measured and well
                within their SLOs (the traffic changed).

clamped to ``[min_replicas, max_replicas]``. A wish must hold ``upscale_delay_s`` (to grow) or
``downscale_delay_s`` (to shrink) before it is acted on, through ``scale_pool``: new instances
ask Ray for their pool's resources (so the Ray autoscaler, or KubeRay, adds nodes when none
are free), removed ones drain first. Latencies from before a pool's last resize do not count
towards its next decision. Every decision is logged, kept (``decisions``), and counted in
``/metrics`` (``tandem:autoscaler_decisions``, ``tandem:pool_replicas``,
``tandem:pool_desired_replicas``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from cluster.config import AutoscalingConfig

logger = logging.getLogger(__name__)

SHRINK_TTFT = 0.5  # a pool shrinks only with its TTFT p90 under this share of the target,
SHRINK_TPOT = 0.7  # its TPOT p90 under this share,
SHRINK_KV = 0.7  # and its KV usage, at the smaller size, under this share of max_kv_usage;
SHRINK_ONGOING = 0.5  # the requests held, at the smaller size, under this share of the target
SHRINK_LOAD = 0.8  # and the load per instance, at the smaller size, under this share of the
# load per instance that last broke an SLO
REJOIN_GRACE_S = 10.0  # past startup_timeout_s, for an instance that came back to report it
MIN_SAMPLES = 8  # latencies a window needs before they count, either way
MISSED_ROUNDS = 3  # a pool not read for longer than this many rounds times its wish afresh
MAX_DECISIONS = 1000


@dataclass(frozen=True)
class PoolSignals:
    replicas: int  # instances serving (alive, not draining)
    ongoing: int  # requests they hold, queued or running
    kv_usage: float  # their mean KV cache usage (0-1)
    # p90s of the requests whose first token came from the pool, and of those that finished
    # on it, over the window (None: fewer than MIN_SAMPLES)
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None
    # first tokens the pool sampled per second over the window (None: too few to tell)
    first_tokens_per_s: float | None = None


@dataclass(frozen=True)
class Decision:
    time: float  # time.monotonic()
    pool: str
    replicas: int
    desired: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.replicas else "down"


class PoolPolicy:
    """What one pool wants, and when to act on it."""

    def __init__(self, pool: str, role: str, config: AutoscalingConfig) -> None:
        self.pool, self.role, self.config = pool, role, config
        self._direction = 0  # the wish being timed: +1 grow, -1 shrink, 0 none
        self._since = 0.0
        # The load per instance at which the pool last broke an SLO (None: it never did).
        self.capacity: float | None = None

    def load(self, s: PoolSignals) -> float | None:
        """The pool's load, in the unit ``capacity`` is kept in (None: not measured yet)."""
        if self.role == "prefill":
            return s.first_tokens_per_s
        return float(s.ongoing)

    def desired(self, s: PoolSignals) -> tuple[int, str]:
        """The size the pool wants now, and why."""
        c, n = self.config, s.replicas
        if n == 0:  # every instance dead for good (the caller checks): start afresh
            return c.min_replicas, "no live instance"
        want = math.ceil(s.ongoing / c.target_ongoing_requests)
        why = f"{s.ongoing} requests held (target {c.target_ongoing_requests:g} per instance)"
        ttft = s.ttft_p90_s * 1000 if s.ttft_p90_s is not None else None
        tpot = s.tpot_p90_s * 1000 if s.tpot_p90_s is not None else None
        ttft_slo = c.slo_ttft_ms  # (on the requests whose first token it sampled)
        tpot_slo = c.slo_tpot_ms if self.role in ("decode", "both") else None
        kv_limit = c.max_kv_usage if self.role in ("decode", "both") else None
        breaks = []
        if ttft_slo is not None and ttft is not None and ttft > ttft_slo:
            breaks.append(f"TTFT p90 {ttft:.0f} ms > {ttft_slo:g} ms")
        if tpot_slo is not None and tpot is not None and tpot > tpot_slo:
            breaks.append(f"TPOT p90 {tpot:.1f} ms > {tpot_slo:g} ms")
        if kv_limit is not None and s.kv_usage > kv_limit:
            breaks.append(f"KV usage {s.kv_usage:.0%} > {kv_limit:.0%}")
        # An SLO breach grows only a loaded pool (a request per instance at least): a target
        # an idle instance cannot meet (a long prompt's TTFT) needs no more instances.
        if breaks and want <= n and s.ongoing >= n:
            want, why = n + 1, "; ".join(breaks)
        if want < n <= c.min_replicas:  # (n == 1: nothing to shrink to)
            want = n
        elif want < n:  # shrink only with room to spare, one instance at a time
            tight = []
            if ttft_slo is not None and ttft is not None and ttft > SHRINK_TTFT * ttft_slo:
                tight.append("TTFT")
            if tpot_slo is not None and tpot is not None and tpot > SHRINK_TPOT * tpot_slo:
                tight.append("TPOT")
            if kv_limit is not None and n > 1 and s.kv_usage * n / (n - 1) > SHRINK_KV * kv_limit:
                tight.append("KV usage")
            if s.ongoing > SHRINK_ONGOING * c.target_ongoing_requests * (n - 1):
                tight.append("the requests held")
            load, capacity = self.load(s), self.capacity
            if (
                capacity is not None
                and load is not None
                and load / (n - 1) > SHRINK_LOAD * capacity
            ):
                tight.append("the load that broke an SLO")
            if tight:
                want, why = n, f"{why}, but {' and '.join(tight)} leave no room to shrink"
            else:
                want = n - 1
        return max(c.min_replicas, min(c.max_replicas, want)), why

    def reset(self) -> None:
        self._direction = 0

    def decide(self, now: float, s: PoolSignals) -> Decision | None:
        """A resize once the pool has wanted it for its delay; None meanwhile."""
        want, why = self.desired(s)
        direction = (want > s.replicas) - (want < s.replicas)
        load, capacity = self.load(s), self.capacity
        if capacity is not None and load is not None and s.replicas and self._comfortable(s):
            self.capacity = max(capacity, load / s.replicas)
        if direction == 0:
            self._direction = 0
            return None
        if direction != self._direction:
            self._direction, self._since = direction, now
        delay = self.config.upscale_delay_s if direction > 0 else self.config.downscale_delay_s
        if now - self._since < delay:
            return None
        self._direction = 0
        if direction > 0 and _reason_kind(why) != "ongoing" and s.replicas > 0 and load is not None:
            self.capacity = load / s.replicas  # what broke it, per instance
        return Decision(now, self.pool, s.replicas, want, why)

    def _comfortable(self, s: PoolSignals) -> bool:
        """Latencies measured, and well within their SLOs (the shrink margins)."""
        c = self.config
        checks = []
        if c.slo_ttft_ms is not None:
            checks.append((s.ttft_p90_s, SHRINK_TTFT * c.slo_ttft_ms))
        if c.slo_tpot_ms is not None and self.role != "prefill":
            checks.append((s.tpot_p90_s, SHRINK_TPOT * c.slo_tpot_ms))
        measured = [(v, bound) for v, bound in checks if v is not None]
        return bool(measured) and all(v * 1000 <= bound for v, bound in measured)


def _p90(values: list[float]) -> float | None:
    if len(values) < MIN_SAMPLES:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


class Autoscaler:
    """Runs the pools' policies for ``actor`` (the ``SchedulerActor``: its views, its pools'
    instances and ``scale_pool``)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        pools = [pool for pool in actor.config.pools if pool.autoscaling is not None]
        self.policies = {
            pool.name: PoolPolicy(pool.name, pool.role, pool.autoscaling) for pool in pools
        }
        # A pool whose every instance died: brought back by its workers' restarts, or (none)
        # by the autoscaler, at min_replicas (scale_pool retires the dead).
        self._restarts = {pool.name: pool.max_restarts > 0 for pool in pools}
        self._empty_since: dict[str, float] = {}  # pool -> when it was first seen with none
        # Per pool, its failed instances that may come back (``_restarting``) -> when each
        # was first seen down.
        self._down_since: dict[str, dict[str, float]] = {}
        self.decisions: deque[Decision] = deque(maxlen=MAX_DECISIONS)  # the latest, in order
        self.counts: dict[tuple[str, str], int] = {}  # (pool, "direction:reason") -> resizes
        self.failed = 0  # resizes that raised (they are asked for again after their delay)
        self.desired: dict[str, int] = {}
        self._changed: dict[str, float] = {}  # pool -> when it was last resized
        self._started = time.monotonic()  # no signal is older (a window is never longer)
        # Every pool is read each round, every ``interval`` (the smallest of the pools').
        self.interval = min((p.config.interval_s for p in self.policies.values()), default=1.0)
        self._read: dict[str, float] = {}  # pool -> when its policy last decided
        # What a restarted central actor carries on from (``memo``, kept by the engine
        # actors): per pool, the size of a grow under way -- its new instances' workers die
        # with this process (``restart.rebuild`` kills them) -- and what ``restore`` found.
        self._growing: dict[str, int] = {}
        self._resume: dict[str, int] = {}
        self._shared: Any = None  # the memo as last given to the engines (without its time)

    @property
    def enabled(self) -> bool:
        return bool(self.policies)

    def signals(self, pool: str, now: float) -> PoolSignals:
        actor = self.actor
        config = self.policies[pool].config
        ids = actor._pool_instances(pool)
        views = [actor.views[i] for i in ids]
        # The latencies of the pool's present size: measured (a request's wait for its first
        # token, or its decode from the first token to the last) wholly since the last resize,
        # so the old size's slow requests finishing after a growth do not grow it again.
        changed = self._changed.get(pool, self._started)
        since = max(now - config.window_s, changed)
        ttft: list[float] = []
        tpot: list[float] = []
        first_tokens = 0
        for view in views:
            view.forget_latencies(now - config.window_s)
            for when, kind, seconds, begun in view.latencies:
                if when < since:
                    continue
                first_tokens += kind == "ttft"
                if begun >= changed:
                    (ttft if kind == "ttft" else tpot).append(seconds)
        span = now - since
        rate = first_tokens / span if first_tokens >= MIN_SAMPLES and span > 0 else None
        return PoolSignals(
            replicas=len(ids),
            ongoing=sum(v.num_active for v in views),
            kv_usage=sum(v.kv_usage for v in views) / len(views) if views else 0.0,
            ttft_p90_s=_p90(ttft),
            tpot_p90_s=_p90(tpot),
            first_tokens_per_s=rate,
        )

    def _restarting(self, pool: str, now: float) -> int:
        """The pool's failed instances that its workers' restarts (max_restarts) may bring
        back -- not declared dead for good -- each for as long as a recovery may take
        (startup_timeout_s): they count towards the pool's size, as Ray Serve counts its
        starting replicas. A resize meanwhile would retire them (``scale_pool`` retires the
        dead) and load new instances in their place."""
        if not self._restarts[pool]:
            return 0
        actor = self.actor
        live = set(actor._pool_instances(pool))
        down = [
            i
            for i in actor._pool_instances(pool, alive=False)
            if i not in live and getattr(actor.engines.get(i), "dead", None) is None
        ]
        seen = self._down_since.get(pool, {})
        self._down_since[pool] = seen = {i: seen.get(i, now) for i in down}
        bound = self.actor.config.startup_timeout_s + REJOIN_GRACE_S
        return sum(now - since < bound for since in seen.values())

    def resized(self, pool: str) -> None:
        """Pool ``pool`` was resized (by anyone): its latencies so far are the old size's,
        and a wish timed before is void."""
        self._changed[pool] = time.monotonic()
        policy = self.policies.get(pool)
        if policy is not None:
            policy.reset()

    async def step(self) -> list[Decision]:
        """Decide for every autoscaled pool once, and act on what was decided. A resize in
        progress (an operator's, or another pool's) skips the round: a decision is made and
        acted on with nothing awaited in between, so it never lands on a size it did not
        see."""
        taken = []
        for pool, policy in self.policies.items():
            if self.actor._resizing.locked():
                break
            now = time.monotonic()
            signals = self.signals(pool, now)
            self.desired[pool] = policy.desired(signals)[0]  # (also while restarts are awaited)
            restarting = self._restarting(pool, now)
            if signals.replicas == 0 and self._restarts[pool]:
                # Its workers restart (max_restarts) and it rejoins: wait for that, as long as
                # a recovery may take (startup_timeout_s). Past it, none came back (restarts
                # used up, a node gone for good): start the pool afresh.
                empty = self._empty_since.setdefault(pool, now)
                if now - empty < self.actor.config.startup_timeout_s + REJOIN_GRACE_S:
                    continue
            elif signals.replicas:
                self._empty_since.pop(pool, None)
            read, self._read[pool] = self._read.get(pool), now
            if read is not None and now - read > MISSED_ROUNDS * self.interval:
                # Not read for a while (a resize held the rounds up -- another pool's model
                # load, an operator's -- or its restarts were awaited): a delay is a wish that
                # lasted while watched, and one timed before the gap would be acted on at the
                # first reading after it.
                policy.reset()
            decision = policy.decide(now, signals)
            if decision is None:
                continue
            if restarting and decision.desired <= decision.replicas + restarting:
                # Its restarting instances make up the size it wants: a grow would retire
                # them for new instances' model loads, a shrink would retire them with a
                # live one (two at once). It waits for them (or for their time to pass).
                continue
            if decision.desired < decision.replicas and self.actor._pool_draining(pool):
                # What the draining instances still hold moves to this pool when their drain
                # times out: a second shrink before then sizes it without that load.
                policy.reset()
                continue
            logger.info(
                "autoscaler: pool %s %d -> %d (%s)",
                pool,
                decision.replicas,
                decision.desired,
                decision.reason,
            )
            growing = decision.desired > decision.replicas
            if growing:  # (kept by the engines until it ends: a restart resumes it)
                self._growing[pool] = decision.desired
                self._share()
            try:
                # A shrink returns once its instances drain (out of routing at once): a
                # drain never holds up the next round, of this pool or another.
                await self.actor.scale_pool(pool, decision.desired, wait=False)
            except Exception as exc:  # e.g. no resources: it asks again after its delay
                logger.warning("autoscaler: pool %s could not be resized: %s", pool, exc)
                self.failed += 1
                continue
            finally:
                if growing:  # (at once: another pool's model load may follow in this round)
                    self._growing.pop(pool, None)
                    self._share()
            self.decisions.append(decision)
            key = (pool, f"{decision.direction}:{_reason_kind(decision.reason)}")
            self.counts[key] = self.counts.get(key, 0) + 1
            taken.append(decision)
        self._share()  # (a capacity learned, a grow ended)
        return taken

    async def run(self) -> None:
        """Step every ``interval_s`` (the smallest of the pools'); first, after a restart,
        finish the grows the previous process had under way (``restore``)."""
        await self._resume_growth()
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.step()
            except Exception:
                logger.exception("autoscaler step failed")

    # -- a restarted central actor --------------------------------------------------------
    def memo(self) -> dict[str, Any]:
        """What a restarted central actor's autoscaler carries on from (the engine actors
        keep it, as the LoRA registry): per pool, the load per instance at which it last
        broke an SLO (``PoolPolicy.capacity``: without it a pool grown on an SLO shrinks back
        under the very load that broke it), and the size of a grow under way."""
        capacity = {p: pol.capacity for p, pol in self.policies.items() if pol.capacity}
        return {"time": time.time(), "capacity": capacity, "growing": dict(self._growing)}

    def _share(self) -> None:
        memo = self.memo()
        kept = {k: v for k, v in memo.items() if k != "time"}
        share = getattr(self.actor, "_share_autoscaler", None)
        if kept != self._shared and share is not None:
            self._shared = kept
            share(memo)

    def restore(self, memos: list[Any]) -> None:
        """After a restart (``restart.rebuild``): the newest of the engines' memos."""
        kept = [m for m in memos if isinstance(m, dict)]
        if not kept:
            return
        memo = max(kept, key=lambda m: m.get("time", 0.0))
        for pool, capacity in memo.get("capacity", {}).items():
            if pool in self.policies:
                self.policies[pool].capacity = capacity
        self._resume = {p: n for p, n in memo.get("growing", {}).items() if p in self.policies}

    async def _resume_growth(self) -> None:
        """Grows the previous process decided and did not finish (its new workers were
        killed as orphans): asked for again at once -- they were timed already -- unless the
        pool has that size now."""
        resume, self._resume = self._resume, {}
        for pool, target in resume.items():
            # As ``step``: its restarting instances count (a resize would retire them for new
            # model loads), and an operator's resize under way wins (its size is newer).
            now = time.monotonic()
            have = len(self.actor._pool_instances(pool)) + self._restarting(pool, now)
            if have >= target or self.actor._resizing.locked():
                continue
            logger.info("autoscaler: pool %s -> %d (a grow cut short by a restart)", pool, target)
            self._growing[pool] = target
            self._share()
            try:
                await self.actor.scale_pool(pool, target, wait=False)
            except Exception as exc:
                logger.warning("autoscaler: pool %s could not be resized: %s", pool, exc)
                self.failed += 1
            finally:
                self._growing.pop(pool, None)
        self._share()

    def stats(self) -> dict[str, Any]:
        """Per pool: its size, what it wants, its resizes by direction and reason, and the
        last few."""
        result: dict[str, Any] = {}
        for pool in self.policies:
            result[pool] = {
                "replicas": len(self.actor._pool_instances(pool)),
                "desired": self.desired.get(pool),
                "decisions": {k: n for (p, k), n in self.counts.items() if p == pool},
                "last": [asdict(d) for d in self.decisions if d.pool == pool][-5:],
            }
        return result


def _reason_kind(reason: str) -> str:
    """A decision's reason as a label: what drove it."""
    for kind in ("TTFT", "TPOT", "KV usage"):
        if reason.startswith(kind):
            return kind.lower().replace(" ", "_")
    return "ongoing"
