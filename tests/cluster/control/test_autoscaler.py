"""The autoscaler: each pool's policy (Ray Serve's ongoing-requests rule, SLO breaches, KV
pressure, hysteresis, delays, bounds), and the whole loop -- the central scheduler resizing a
pool through ``scale_pool`` -- in the simulator, where a load step makes the decode pool grow
and the end of it makes the pool shrink back, with every request served and every block
returned."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from cluster.config import AutoscalingConfig, ClusterConfig
from cluster.control.autoscaler import PoolPolicy, PoolSignals
from cluster.control.summaries import InstanceView
from cluster.observability.exposition import render_stats
from cluster.sim.cost import LinearCostModel
from cluster.sim.simulator import Simulation
from cluster.sim.workload import WorkItem, poisson


def _policy(role: str = "decode", **kw: Any) -> PoolPolicy:
    base = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 10.0}
    base |= {"upscale_delay_s": 5.0, "downscale_delay_s": 20.0}
    return PoolPolicy("d", role, AutoscalingConfig(**{**base, **kw}))


def test_the_ongoing_rule_is_ray_serves_and_stays_within_bounds() -> None:
    policy = _policy()
    assert policy.desired(PoolSignals(1, 25, 0.1))[0] == 3  # ceil(25 / 10)
    assert policy.desired(PoolSignals(1, 100, 0.1))[0] == 4  # max_replicas
    assert policy.desired(PoolSignals(2, 0, 0.0))[0] == 1  # min_replicas
    assert policy.desired(PoolSignals(2, 15, 0.2))[0] == 2


def test_a_pool_with_no_live_instance_starts_afresh_at_its_minimum() -> None:
    policy = _policy(min_replicas=2)
    assert policy.desired(PoolSignals(0, 0, 0.0)) == (2, "no live instance")
    assert policy.decide(0.0, PoolSignals(0, 0, 0.0)) is None  # after upscale_delay_s
    decision = policy.decide(5.0, PoolSignals(0, 0, 0.0))
    assert decision is not None and (decision.replicas, decision.desired) == (0, 2)


def test_an_slo_breach_grows_the_pool_on_its_side_only() -> None:
    slos = {"slo_ttft_ms": 200.0, "slo_tpot_ms": 50.0}
    slow_first = PoolSignals(1, 1, 0.1, ttft_p90_s=0.5, tpot_p90_s=0.01)
    slow_after = PoolSignals(1, 1, 0.1, ttft_p90_s=0.05, tpot_p90_s=0.2)
    assert _policy("prefill", **slos).desired(slow_first)[0] == 2
    assert _policy("prefill", **slos).desired(slow_after)[0] == 1  # TPOT is not its doing
    assert _policy("decode", **slos).desired(slow_after)[0] == 2
    # A decode pool's TTFT samples are the short prompts it prefilled itself (conditional
    # disaggregation left them there): slow ones are its doing too.
    assert _policy("decode", **slos).desired(slow_first)[0] == 2
    assert _policy("both", **slos).desired(slow_first)[0] == 2
    want, why = _policy("decode").desired(PoolSignals(1, 1, 0.95))  # KV nearly full
    assert want == 2 and why.startswith("KV usage")


def test_shrinking_is_one_step_at_a_time_and_only_with_room_to_spare() -> None:
    policy = _policy("decode", slo_tpot_ms=50.0)
    assert policy.desired(PoolSignals(3, 0, 0.1, tpot_p90_s=0.01))[0] == 2  # not 1 at once
    want, why = policy.desired(PoolSignals(3, 0, 0.1, tpot_p90_s=0.04))  # 80% of the target
    assert want == 3 and "TPOT" in why
    assert policy.desired(PoolSignals(2, 0, 0.5))[0] == 2  # 100% KV once on one instance
    # 8 held on 2 instances would want 1 (target 10), but 8 on one is over half the target.
    want, why = _policy().desired(PoolSignals(2, 8, 0.1))
    assert want == 2 and "requests held" in why
    assert _policy().desired(PoolSignals(2, 5, 0.1))[0] == 1


def test_a_wish_must_last_its_delay_and_a_change_of_mind_restarts_the_clock() -> None:
    policy = _policy()
    busy, idle = PoolSignals(1, 30, 0.1), PoolSignals(3, 0, 0.0)
    assert policy.decide(0.0, busy) is None
    assert policy.decide(4.9, busy) is None
    decision = policy.decide(5.0, busy)
    assert decision is not None and (decision.replicas, decision.desired) == (1, 3)
    assert decision.direction == "up" and "30 requests held" in decision.reason
    assert policy.decide(6.0, idle) is None  # shrinking waits downscale_delay_s
    assert policy.decide(20.0, PoolSignals(3, 30, 0.1)) is None  # busy again: no wish
    assert policy.decide(21.0, idle) is None  # the clock starts again
    assert policy.decide(40.9, idle) is None
    late = policy.decide(41.0, idle)
    assert late is not None and (late.desired, late.direction) == (2, "down")


def test_a_pool_grown_on_an_slo_keeps_its_size_while_the_load_that_broke_it_lasts() -> None:
    """A prefill pool breaks its TTFT SLO at 10 first tokens/s on one instance and grows.
    At two instances the same load is comfortable and holds few requests -- the other shrink
    rules alone would shrink it, break the SLO and grow it again, one drain and model load
    per cycle. It shrinks once the load per instance at the smaller size is under 80% of
    the one that broke it."""
    policy = _policy("prefill", slo_ttft_ms=500.0, upscale_delay_s=0.0, downscale_delay_s=0.0)
    breaking = PoolSignals(1, 2, 0.1, ttft_p90_s=2.0, first_tokens_per_s=10.0)
    grown = policy.decide(0.0, breaking)
    assert grown is not None and grown.desired == 2 and grown.reason.startswith("TTFT")
    assert policy.capacity == 10.0
    same_load = PoolSignals(2, 1, 0.05, ttft_p90_s=0.15, first_tokens_per_s=10.0)
    want, why = policy.desired(same_load)
    assert want == 2 and "the load that broke an SLO" in why
    assert policy.decide(1.0, same_load) is None
    lighter = PoolSignals(2, 1, 0.05, ttft_p90_s=0.1, first_tokens_per_s=7.0)
    shrunk = policy.decide(2.0, lighter)
    assert shrunk is not None and shrunk.desired == 1


def test_a_pool_that_carries_more_within_its_slo_learns_a_higher_capacity() -> None:
    policy = _policy("decode", slo_tpot_ms=50.0, upscale_delay_s=0.0)
    policy.decide(0.0, PoolSignals(1, 8, 0.2, tpot_p90_s=0.08))  # 8 held broke it
    assert policy.capacity == 8.0
    policy.decide(1.0, PoolSignals(2, 24, 0.2, tpot_p90_s=0.02))  # 12 each, well within
    assert policy.capacity == 12.0
    policy.decide(2.0, PoolSignals(2, 30, 0.2, tpot_p90_s=0.045))  # within, not by the margin
    assert policy.capacity == 12.0
    grown_on_load = _policy(upscale_delay_s=0.0)
    assert grown_on_load.decide(0.0, PoolSignals(1, 30, 0.1)) is not None
    assert grown_on_load.capacity is None  # the requests-held rule learns nothing


def test_a_pool_at_its_minimum_stays_there_whatever_it_learned() -> None:
    """A pool grown on an SLO and shrunk back to one instance has a capacity; idle, or
    carrying little, it wants no fewer than its minimum (the shrink check divided the load by
    the instances left: by zero)."""
    decode = _policy("decode", slo_tpot_ms=50.0, upscale_delay_s=0.0)
    decode.decide(0.0, PoolSignals(1, 8, 0.2, tpot_p90_s=0.08))
    assert decode.capacity == 8.0
    assert decode.desired(PoolSignals(1, 0, 0.0)) == (1, "0 requests held (target 10 per instance)")
    assert decode.decide(1.0, PoolSignals(1, 0, 0.0)) is None
    prefill = _policy("prefill", slo_ttft_ms=500.0, upscale_delay_s=0.0)
    prefill.decide(0.0, PoolSignals(1, 2, 0.1, ttft_p90_s=2.0, first_tokens_per_s=10.0))
    assert prefill.capacity == 10.0
    assert prefill.desired(PoolSignals(1, 0, 0.0, first_tokens_per_s=9.0))[0] == 1


def test_signals_after_a_resize_are_the_new_sizes_own() -> None:
    """After a resize the p90s take only latencies measured wholly since: a slow request of
    the old size finishing now does not grow the pool again. The first-token rate counts
    every first token in the window, and a window never reaches back before the autoscaler
    started (a rate over 15 s of which 5 existed read a third of the real one)."""
    import time

    from cluster.control.autoscaler import Autoscaler
    from cluster.control.summaries import InstanceView

    config = ClusterConfig.model_validate(
        {
            "model": "m",
            "pools": [
                {
                    "name": "d",
                    "role": "decode",
                    "replicas": 1,
                    "autoscaling": {"max_replicas": 4, "slo_tpot_ms": 50.0, "window_s": 15.0},
                },
                {"name": "p", "role": "prefill", "replicas": 1},
            ],
        }
    )
    view = InstanceView("d-0", "decode", 16, True)
    actor = type("Actor", (), {})()  # the central actor's parts the autoscaler reads
    actor.config, actor.views = config, {"d-0": view}
    actor._pool_instances = lambda pool: ["d-0"] if pool == "d" else []
    autoscaler = Autoscaler(actor)
    now = time.monotonic()
    for _ in range(10):  # 5 s of first tokens, 2 a second
        view.latency(now, "ttft", 0.1, 0.1)
    assert autoscaler.signals("d", now + 5.0).first_tokens_per_s == pytest.approx(2.0, rel=0.01)
    autoscaler.resized("d")
    changed = time.monotonic()
    for _ in range(10):  # the old size's slow decodes, finishing after the resize
        view.latency(changed + 1.0, "tpot", 0.2, 3.0)
    signals = autoscaler.signals("d", changed + 1.0)
    assert signals.tpot_p90_s is None  # none measured at this size yet
    for _ in range(10):  # the new size's, measured from after the resize
        view.latency(changed + 2.0, "tpot", 0.03, 0.5)
    assert autoscaler.signals("d", changed + 2.0).tpot_p90_s == 0.03


def test_a_pool_whose_instances_never_come_back_is_started_afresh(monkeypatch: Any) -> None:
    """A pool with no live instance and max_restarts waits for its workers' restarts, but only
    as long as a recovery may take (startup_timeout_s): past it (restarts used up, a node gone)
    the autoscaler starts it afresh at min_replicas, instead of waiting for ever."""
    import time

    from cluster.control import autoscaler as module

    monkeypatch.setattr(module, "REJOIN_GRACE_S", 0.0, raising=False)
    config = ClusterConfig.model_validate(
        {
            "model": "m",
            "startup_timeout_s": 0.3,
            "pools": [
                {
                    "name": "d",
                    "role": "decode",
                    "replicas": 1,
                    "max_restarts": 2,
                    "autoscaling": {"min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 0},
                },
                {"name": "p", "role": "prefill", "replicas": 1},
            ],
        }
    )
    resized: list[tuple[str, int]] = []
    live: list[str] = []  # the pool's serving instances: none, its one instance failed

    async def scale_pool(pool: str, replicas: int, wait: bool) -> None:
        resized.append((pool, replicas))

    actor = type("Actor", (), {})()  # the central actor's parts the autoscaler reads
    actor.config, actor.views, actor._resizing = config, {}, asyncio.Lock()
    actor._pool_instances = lambda pool, alive=True: list(live) if pool == "d" else []
    actor.scale_pool = scale_pool
    autoscaler = module.Autoscaler(actor)
    assert asyncio.run(autoscaler.step()) == [] and resized == []  # its restart may come
    assert autoscaler.desired["d"] == 1  # what it wants meanwhile (the gauge is not stale)
    time.sleep(0.1)
    assert asyncio.run(autoscaler.step()) == [] and resized == []  # (still within the time)
    time.sleep(0.3)  # past startup_timeout_s: no restart brought it back
    (decision,) = asyncio.run(autoscaler.step())
    assert (decision.replicas, decision.desired, decision.reason) == (0, 1, "no live instance")
    assert resized == [("d", 1)]


def test_a_restarting_instance_counts_towards_its_pools_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool at its minimum (2) whose instance d-1 failed and restarts (max_restarts): the
    restart brings it back, so the pool is not grown meanwhile -- the grow would retire d-1
    (scale_pool retires the dead) and load a new instance in its place -- for as long as a
    recovery may take (startup_timeout_s). Past it, or declared dead for good (its engine
    actor died), it is replaced."""
    from types import SimpleNamespace

    from cluster.control import autoscaler as module

    clock = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    config = ClusterConfig.model_validate(
        {
            "model": "m",
            "startup_timeout_s": 60.0,
            "pools": [
                {
                    "name": "d",
                    "role": "decode",
                    "replicas": 2,
                    "max_restarts": 1,
                    "autoscaling": {"min_replicas": 2, "max_replicas": 4, "upscale_delay_s": 0},
                },
                {"name": "p", "role": "prefill", "replicas": 1},
            ],
        }
    )
    views = {i: InstanceView(i, "decode", 16, True) for i in ("d-0", "d-1")}
    views["d-1"].alive = False  # failed: its workers restart
    resized: list[tuple[str, int]] = []

    async def scale_pool(pool: str, replicas: int, wait: bool) -> None:
        resized.append((pool, replicas))

    actor: Any = type("Actor", (), {})()  # the central actor's parts the autoscaler reads
    actor.config, actor.views, actor._resizing = config, views, asyncio.Lock()
    actor.engines = {i: SimpleNamespace(dead=None) for i in views}
    actor._pool_instances = lambda pool, alive=True: [
        i for i in views if i[0] == pool and (views[i].alive or not alive)
    ]
    actor._pool_draining = lambda pool: False
    actor.scale_pool = scale_pool
    autoscaler = module.Autoscaler(actor)
    for _ in range(30):  # 30 s of its restart: the pool has its size
        asyncio.run(autoscaler.step())
        clock[0] += 1.0
    assert resized == []
    clock[0] += 60.0  # past startup_timeout_s (and the grace): no restart brought it back
    asyncio.run(autoscaler.step())
    assert resized == [("d", 2)]
    resized.clear()
    actor.engines["d-1"].dead = "its engine actor died"  # nothing brings it back
    asyncio.run(module.Autoscaler(actor).step())
    assert resized == [("d", 2)]


def test_a_pool_does_not_shrink_again_while_an_instance_of_it_drains() -> None:
    """The load a draining instance still holds is in no signal of its pool: a second shrink
    before its drain ends would size the pool without it (and what is left at the drain
    timeout moves onto the smaller pool)."""
    from cluster.control import autoscaler as module

    config = ClusterConfig.model_validate(
        {
            "model": "m",
            "pools": [
                {
                    "name": "d",
                    "role": "decode",
                    "replicas": 3,
                    "autoscaling": {"min_replicas": 1, "max_replicas": 4, "downscale_delay_s": 0},
                },
                {"name": "p", "role": "prefill", "replicas": 1},
            ],
        }
    )
    resized: list[tuple[str, int]] = []
    draining = {"d": True}

    async def scale_pool(pool: str, replicas: int, wait: bool) -> None:
        resized.append((pool, replicas))

    views = {f"d-{i}": InstanceView(f"d-{i}", "decode", 16, True) for i in range(2)}
    actor = type("Actor", (), {})()  # the central actor's parts the autoscaler reads
    actor.config, actor.views, actor._resizing = config, views, asyncio.Lock()
    actor._pool_instances = lambda pool: list(views) if pool == "d" else []
    actor._pool_draining = lambda pool: draining.get(pool, False)
    actor.scale_pool = scale_pool
    autoscaler = module.Autoscaler(actor)
    assert asyncio.run(autoscaler.step()) == [] and resized == []  # idle, but d-2 drains
    draining["d"] = False  # its drain ended
    asyncio.run(autoscaler.step())
    assert resized == [("d", 1)]


def test_min_above_max_and_replicas_outside_the_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="min_replicas"):
        AutoscalingConfig(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="within autoscaling"):
        ClusterConfig.model_validate(
            {"pools": [{"name": "d", "replicas": 5, "autoscaling": {"max_replicas": 4}}]}
        )


COST = LinearCostModel(
    "test", {"const": 2e-3, "prefill_tokens": 5e-5, "num_decodes": 2e-4}, kv_bytes_token=1000
)


def _step_load(
    base_rate: float, factor: float, seconds: tuple[float, float, float]
) -> list[WorkItem]:
    """Poisson arrivals at ``base_rate``, then ``factor`` times that, then ``base_rate``
    again, for ``seconds`` each."""
    items: list[WorkItem] = []
    start = 0.0
    for i, (rate, span) in enumerate(
        zip((base_rate, base_rate * factor, base_rate), seconds, strict=True)
    ):
        phase = poisson(rate, int(rate * span), "fixed", seed=i)
        items += [
            dataclasses.replace(w, arrival_s=start + w.arrival_s, output_len=200) for w in phase
        ]
        start += span
    return items


def test_a_load_step_grows_the_decode_pool_and_its_end_shrinks_it_back() -> None:
    autoscaling = {
        "min_replicas": 1,
        "max_replicas": 3,
        "target_ongoing_requests": 12,
        "upscale_delay_s": 2.0,
        "downscale_delay_s": 8.0,
        "interval_s": 0.5,
    }
    config = ClusterConfig.model_validate(
        {
            "block_size": 16,
            "admission_window_s": 0.0,
            "drain_timeout_s": 30.0,
            "router": {"disaggregation": "always"},
            "pools": [
                {"name": "p", "role": "prefill", "num_blocks": 4096},
                {"name": "d", "role": "decode", "num_blocks": 4096, "autoscaling": autoscaling},
            ],
        }
    )
    # One instance holds about 2.5 requests at the base rate, 15 at three times it.
    work = _step_load(base_rate=5.0, factor=3.0, seconds=(20.0, 30.0, 40.0))
    result = Simulation(config, COST).run(work)
    assert all(r.error is None and r.num_tokens == 200 for r in result.records)  # nothing lost
    ups = [d for d in result.decisions if d["desired"] > d["replicas"]]
    downs = [d for d in result.decisions if d["desired"] < d["replicas"]]
    assert ups and downs, result.decisions
    assert 20.0 < ups[0]["time"] < 50.0  # during the step (after its delay)
    assert downs[-1]["time"] > ups[-1]["time"]
    assert all(d["pool"] == "d" for d in result.decisions)  # the prefill pool has no section
    serving = [
        i for i, s in result.instances.items() if s["role"] == "decode" and "num_blocks" in s
    ]
    assert serving == ["d-0"]  # back to one instance at the end (the first kept)
    assert len([i for i in result.instances if i.startswith("d-")]) > 1  # others came and went
    for iid in [*serving, "p-0"]:
        stats = result.instances[iid]
        assert stats["num_free_blocks"] == stats["num_blocks"], iid  # every block back
    # /metrics: the pool's size, its wish and the decisions.
    text, _ = render_stats({"autoscaling": result.autoscaling}, "m")
    assert 'tandem:pool_replicas{model_name="m",pool="d"} 1.0' in text
    assert (
        'tandem:autoscaler_decisions_total{direction="up",model_name="m",pool="d",reason="ongoing"}'
        in text
    )


def test_a_drain_holds_up_no_other_resize() -> None:
    """``scale_pool(..., wait=False)`` (the autoscaler's call) returns once the removed
    instance drains: another pool grows meanwhile, and the drained instance retires after
    its request finished. (The drain used to hold the one resize lock for up to
    ``drain_timeout_s``: no pool could grow while a long request finished elsewhere.)"""
    from cluster.control.scheduler_actor import SchedulerActor
    from cluster.sim.clock import run_virtual
    from scheduler import Request, SamplingParams

    config = ClusterConfig.model_validate(
        {
            "block_size": 16,
            "drain_timeout_s": 600.0,
            "router": {"disaggregation": "never"},
            "pools": [
                {"name": "a", "role": "both", "num_blocks": 1024},
                {"name": "b", "role": "both", "num_blocks": 1024, "replicas": 2},
            ],
        }
    )
    sim = Simulation(config, COST)
    long = SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0.0)

    async def main() -> tuple[list[str], list[str], bool, float, list[str]]:
        loop = asyncio.get_running_loop()
        actor = SchedulerActor(sim.config, sim._specs(), sim._start_instances)
        await actor.start()
        stream = actor.subscribe("c")
        reader = asyncio.ensure_future(_read_all(stream))
        for i in range(3):  # one on each instance (the idle one first)
            await actor.submit(Request(f"r{i}", [5, 6, 7], long, eos_token_id=2), "c", None, i)
        while not all(actor.views[i].num_active for i in ("a-0", "b-0", "b-1")):
            await asyncio.sleep(0.01)
        start = loop.time()
        shrunk = (await actor.scale_pool("b", 1, wait=False))["instances"]
        grown = (await actor.scale_pool("a", 2))["instances"]
        draining = "b-1" in actor.engines and actor.views["b-1"].draining
        waited = loop.time() - start
        while "b-1" in actor.engines:
            await asyncio.sleep(0.1)
        reader.cancel()
        left = sorted(actor.engines)
        await actor.shutdown()
        return shrunk, grown, draining, waited, left

    shrunk, grown, draining, waited, left = run_virtual(main())
    assert shrunk == ["b-0"] and grown == ["a-0", "a-1"]
    assert draining and waited < 1.0  # b-1's request had most of its 3,000 tokens to go
    assert left == ["a-0", "a-1", "b-0"]


async def _read_all(stream: Any) -> None:
    async for _ in stream:
        pass


def test_an_instance_added_to_a_simulated_cluster_serves_after_its_start_time() -> None:
    """A simulated pool grows after ``instance_start_s`` (the workers placed and the model
    loaded), not at once: the autoscaler's reaction includes it, as on a real cluster."""
    import time

    from cluster.sim.clock import run_virtual

    config = ClusterConfig.model_validate(
        {"block_size": 16, "pools": [{"name": "d", "role": "both", "num_blocks": 64}]}
    )
    sim = Simulation(config, COST, instance_start_s=30.0)
    sim._specs()

    async def grow() -> tuple[float, list[str]]:
        started = time.monotonic()
        specs = await sim._start_instances(config, [("d-1", config.pools[0])], 600.0, None)
        return time.monotonic() - started, [s.instance_id for s in specs]

    took, ids = run_virtual(grow())
    assert took == pytest.approx(30.0) and ids == ["d-1"]


def test_an_instance_whose_retire_failed_holds_up_no_shrink() -> None:
    """An instance counts as draining for its pool's shrinks only while its drain and retire
    run: one whose retire failed (logged) stays marked draining, but the pool may shrink
    again."""
    from types import SimpleNamespace

    from cluster.control.operations import ClusterOperations

    class Ops(ClusterOperations):
        def __init__(self) -> None:
            self.config: Any = SimpleNamespace(drain_timeout_s=1.0)
            self.started = True
            self._membership = asyncio.Lock()
            self._shrinking: set[str] = set()
            self.specs: Any = {"d-1": SimpleNamespace(pool=SimpleNamespace(name="d"))}
            self.engines: Any = {"d-1": object()}
            self.seen: list[bool] = []

        async def _holds_requests(self, iid: str) -> bool:
            self.seen.append(self._pool_draining("d"))
            return False

        async def _retire(self, iid: str) -> None:
            raise RuntimeError("its workers did not stop")

    ops = Ops()
    with pytest.raises(RuntimeError, match="did not stop"):
        asyncio.run(ops._shrink(["d-1"], None))
    assert ops.seen == [True]  # draining while its shrink ran
    assert not ops._pool_draining("d")  # not after it failed


def test_a_retire_that_fails_does_not_keep_the_others_of_its_shrink() -> None:
    """A shrink of d-1 and d-2 (a resize retires the dead with the removed ones): d-1's
    retire fails, d-2 still leaves -- it was left marked draining, out of routing with its
    workers (a GPU) held for good, since no resize counts or retires a draining instance --
    and the failure is still raised (logged by the caller)."""
    from types import SimpleNamespace

    from cluster.control.operations import ClusterOperations

    class Ops(ClusterOperations):
        def __init__(self) -> None:
            self.config: Any = SimpleNamespace(drain_timeout_s=1.0)
            self.started = True
            self._membership = asyncio.Lock()
            self._shrinking: set[str] = set()
            pool = SimpleNamespace(name="d")
            self.specs: Any = {i: SimpleNamespace(pool=pool) for i in ("d-1", "d-2")}
            self.engines: Any = {i: object() for i in ("d-1", "d-2")}
            self.retired: list[str] = []

        async def _holds_requests(self, iid: str) -> bool:
            return False

        async def _retire(self, iid: str) -> None:
            if iid == "d-1":
                raise RuntimeError("its workers did not stop")
            self.retired.append(iid)
            del self.engines[iid]

    ops = Ops()
    with pytest.raises(RuntimeError, match="did not stop"):
        asyncio.run(ops._shrink(["d-1", "d-2"], None))
    assert ops.retired == ["d-2"]
    assert not ops._pool_draining("d")


def test_a_wish_timed_before_a_resize_held_the_rounds_up_is_timed_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pool b (idle, 2 instances) wants to shrink while pool a grows, and a's new instance
    takes 120 s to load: no round reads b meanwhile. Read again, b times its wish afresh --
    it shrank at once, on two readings 121 s apart (its downscale_delay_s is 60)."""
    from cluster.control import autoscaler as module

    clock = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    scaling = {"max_replicas": 4, "target_ongoing_requests": 10}
    config = ClusterConfig.model_validate(
        {
            "model": "m",
            "pools": [
                {
                    "name": "b",
                    "role": "decode",
                    "replicas": 2,
                    "autoscaling": {**scaling, "downscale_delay_s": 60},
                },
                {
                    "name": "a",
                    "role": "prefill",
                    "replicas": 1,
                    "autoscaling": {**scaling, "upscale_delay_s": 0},
                },
            ],
        }
    )
    views = {
        i: InstanceView(i, "decode" if i[0] == "b" else "prefill", 16, True)
        for i in ("b-0", "b-1", "a-0")
    }
    views["a-0"]._num_active = 30
    resized: list[tuple[str, int]] = []

    async def scale_pool(pool: str, replicas: int, wait: bool) -> None:
        resized.append((pool, replicas))
        if pool == "a":  # its new instance's workers placed, its model loaded
            clock[0] += 120.0
            views["a-0"]._num_active = 0

    actor: Any = type("Actor", (), {})()
    actor.config, actor.views, actor._resizing = config, views, asyncio.Lock()
    actor._pool_instances = lambda pool: [i for i in views if i[0] == pool]
    actor._pool_draining = lambda pool: False
    actor.scale_pool = scale_pool
    autoscaler = module.Autoscaler(actor)
    asyncio.run(autoscaler.step())  # b's wish starts; a grows for 120 s
    clock[0] += 1.0
    asyncio.run(autoscaler.step())
    assert resized == [("a", 3)]  # b not shrunk on two readings 121 s apart
    for _ in range(61):  # watched idle for its delay: now it shrinks
        clock[0] += 1.0
        asyncio.run(autoscaler.step())
    assert resized == [("a", 3), ("b", 1)]


def test_an_instance_that_rejoins_voids_its_pools_latencies_and_wish() -> None:
    """An instance back from a failure: its pool has its size again, so the latencies of the
    outage (a smaller pool's, slower) and a grow timed on them are void -- as after a resize.
    They still counted: the pool grew after the rejoin, on a load it then served."""
    from types import SimpleNamespace

    from cluster.control.scheduler_actor import SchedulerActor

    voided: list[str] = []
    actor = SchedulerActor.__new__(SchedulerActor)
    actor.specs = {"d-1": SimpleNamespace(pool=SimpleNamespace(name="d"))}  # type: ignore[dict-item]
    actor.failures = []
    actor.autoscaler = SimpleNamespace(resized=voided.append)  # type: ignore[assignment]
    actor._serves_again("d-1")
    assert voided == ["d"] and actor.failures[-1]["event"] == "rejoined"


def test_a_restarted_central_actor_resumes_a_grow_and_keeps_what_its_pools_learned() -> None:
    """The central actor dies while a grow it decided loads its new instance (the new
    workers die with it), its pool having learned the load that broke its SLO. The engine
    actors keep the autoscaler's memo; the restarted actor's autoscaler asks for the grow
    again at once -- not after a new upscale delay on empty latency windows, then a model
    load -- and keeps the capacity, so the pool does not shrink back under that load."""
    from cluster.control import autoscaler as module

    config = ClusterConfig.model_validate(
        {
            "model": "m",
            "pools": [
                {
                    "name": "d",
                    "role": "decode",
                    "autoscaling": {
                        "min_replicas": 1,
                        "max_replicas": 4,
                        "target_ongoing_requests": 10,
                        "upscale_delay_s": 0,
                    },
                },
                {"name": "p", "role": "prefill"},
            ],
        }
    )
    pool = ["d-0"]
    resized: list[tuple[str, int]] = []
    shared: list[dict[str, Any]] = []

    def central() -> Any:
        actor: Any = type("Actor", (), {})()  # the central actor's parts the autoscaler reads
        actor.config, actor.views, actor.engines = config, {}, {}
        actor._resizing = asyncio.Lock()
        actor._pool_instances = lambda name, alive=True: list(pool) if name == "d" else []
        actor._pool_draining = lambda name: False
        actor._share_autoscaler = lambda memo: shared.append(memo)
        return actor

    async def before_the_restart() -> None:
        actor = central()
        loading = asyncio.Event()

        async def scale_pool(name: str, replicas: int, wait: bool) -> None:
            resized.append((name, replicas))
            loading.set()
            await asyncio.Event().wait()  # the process dies during the model load

        actor.scale_pool = scale_pool
        autoscaler = module.Autoscaler(actor)
        autoscaler.policies["d"].capacity = 12.0  # (a TPOT breach taught it)
        autoscaler.signals = lambda name, now: PoolSignals(1, 30, 0.1)  # type: ignore[method-assign]
        step = asyncio.ensure_future(autoscaler.step())
        await asyncio.wait_for(loading.wait(), 10)
        kept.update(shared[-1])  # what the engines hold when the process dies
        step.cancel()

    kept: dict[str, Any] = {}
    asyncio.run(before_the_restart())
    assert resized == [("d", 3)]
    assert kept["growing"] == {"d": 3} and kept["capacity"] == {"d": 12.0}
    older = {**kept, "time": kept["time"] - 60.0, "growing": {}}

    actor = central()

    async def scale_pool(name: str, replicas: int, wait: bool) -> None:
        resized.append((name, replicas))

    actor.scale_pool = scale_pool
    restarted = module.Autoscaler(actor)
    restarted.restore([older, None, kept])  # the newest of the engines' memos
    assert restarted.policies["d"].capacity == 12.0
    asyncio.run(restarted._resume_growth())
    assert resized == [("d", 3), ("d", 3)]  # at once: it was timed before the restart
    assert shared[-1]["growing"] == {}
    busy = module.Autoscaler(actor)  # an operator's resize under way: its size is newer
    busy.restore([kept])
    actor._resizing = asyncio.Lock()

    async def while_resizing() -> None:
        async with actor._resizing:
            await busy._resume_growth()

    asyncio.run(while_resizing())
    assert resized == [("d", 3), ("d", 3)]
    pool[:] = ["d-0", "d-1", "d-2"]  # had it grown before the actor died: nothing to do
    again = module.Autoscaler(actor)
    again.restore([{**older, "time": older["time"] + 120.0, "growing": {"d": 3}}])
    asyncio.run(again._resume_growth())
    assert resized == [("d", 3), ("d", 3)]
