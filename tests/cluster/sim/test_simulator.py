"""The simulator runs Tandem's own control plane in virtual time: deterministic for a seed,
the real ``Scheduler`` (no copy), and the cluster's behaviours -- chunked prefill, preemption
under KV pressure, prefix caching, the P/D hand-off priced by the cost model, the waiting
bound -- show in its results."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from cluster.config import ClusterConfig
from cluster.sim.clock import SimulationStalled, run_virtual
from cluster.sim.cost import LinearCostModel, StepShape, gpu_model
from cluster.sim.simulator import SLO, RequestRecord, SimResult, Simulation, percentile
from cluster.sim.workload import WorkItem, poisson
from scheduler import Scheduler

# 1 ms a step, 0.1 ms a prefill token, 0.01 ms a decode, 0.1 GB/s of KV hand-off.
COST = LinearCostModel(
    "test",
    {"const": 1e-3, "prefill_tokens": 1e-4, "num_decodes": 1e-5},
    kv_bytes_token=1000,
    transfer_latency_s=1e-3,
    transfer_bytes_per_s=1e8,
)


@pytest.fixture(autouse=True)
def _every_block_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every simulated run here (the planner's included) ends with each instance's KV
    blocks all free."""
    run = Simulation.run

    def checked(self: Simulation, *args: Any, **kwargs: Any) -> Any:
        result = run(self, *args, **kwargs)
        for iid, stats in result.instances.items():
            assert stats["num_free_blocks"] == stats["num_blocks"], (iid, stats)
        return result

    monkeypatch.setattr(Simulation, "run", checked)


def _config(pools: list[dict[str, Any]], **extra: Any) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {"block_size": 16, "pools": pools, "admission_window_s": 0.0, **extra}
    )


BOTH = {"name": "c", "role": "both", "num_blocks": 512}
PD = [
    {"name": "p", "role": "prefill", "num_blocks": 512},
    {"name": "d", "role": "decode", "num_blocks": 512},
]


def test_the_clock_jumps_to_each_timer_and_a_wait_for_nothing_is_an_error() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(3600)
        event = asyncio.Event()
        loop.call_later(5, event.set)
        await asyncio.wait_for(event.wait(), 10)
        return loop.time()

    assert run_virtual(main()) == 3605.0
    with pytest.raises(SimulationStalled):
        run_virtual(asyncio.Event().wait())


def test_the_same_seed_gives_the_same_run_and_another_seed_another() -> None:
    config = _config(PD, router={"disaggregation": "always"})
    work = poisson(rate=50, num_requests=60, shape="chat", seed=1)

    def run(seed: int) -> list[tuple[Any, ...]]:
        result = Simulation(config, COST).run(work, seed=seed)
        return [(r.first_token_s, r.end_s, r.num_tokens) for r in result.records]

    first = run(0)
    assert len(first) == 60 and all(end is not None for _, end, _ in first)
    assert run(0) == first  # the same run, to the last virtual nanosecond
    assert poisson(rate=50, num_requests=60, shape="chat", seed=1) == work
    other = poisson(rate=50, num_requests=60, shape="chat", seed=2)
    assert other != work
    assert Simulation(config, COST).run(other).records != Simulation(config, COST).run(work).records


def test_it_runs_the_real_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = {"schedule": 0, "update": 0}
    schedule, update = Scheduler.schedule, Scheduler.update_from_output

    def counted_schedule(self: Scheduler, *args: Any) -> Any:
        calls["schedule"] += 1
        return schedule(self, *args)

    def counted_update(self: Scheduler, *args: Any) -> Any:
        calls["update"] += 1
        return update(self, *args)

    monkeypatch.setattr(Scheduler, "schedule", counted_schedule)
    monkeypatch.setattr(Scheduler, "update_from_output", counted_update)
    result = Simulation(_config([BOTH]), COST).run(poisson(20, 20, "fixed", seed=3))
    steps = sum(i["num_steps"] for i in result.instances.values())
    assert steps > 0 and calls == {"schedule": steps, "update": steps}


def test_times_follow_the_cost_model_exactly() -> None:
    """One request alone: a 32-token prompt in one step, then a step per token."""
    config = _config([BOTH])
    result = Simulation(config, COST).run([WorkItem(0.0, 32, 5)])
    (record,) = result.records
    prefill = COST.step_time(StepShape(prefill_tokens=32, num_sampled=1))
    decode = COST.step_time(StepShape(num_decodes=1, num_sampled=1))
    assert record.num_tokens == 5 and record.error is None
    assert record.ttft == pytest.approx(prefill)
    assert record.tpot == pytest.approx(decode)
    assert record.end_s == pytest.approx(prefill + 4 * decode)


def test_a_worker_that_shares_the_cores_steps_faster_with_a_core_to_spare() -> None:
    """Two instances on a 2-core machine (a CPU cost model): a lone worker of ``num_threads:
    auto`` has both cores and steps ``spare_core_speedup`` times faster than the one-thread
    fit, for steps of 64 tokens or more (smaller ones run one thread, as the real core
    sharing does); a one-thread worker does not; two busy workers have a core each."""
    from actors.cores import MIN_STEP_TOKENS
    from cluster.sim.executor import MIN_SHARED_STEP_TOKENS, Machine

    assert MIN_SHARED_STEP_TOKENS == MIN_STEP_TOKENS

    shared = LinearCostModel(
        **{
            **COST.__dict__,
            "machine_cores": 2.0,
            "instances_per_machine": 2,
            "spare_core_speedup": 1.5,
        }
    )
    prefill = COST.step_time(StepShape(prefill_tokens=96, num_sampled=1))
    decode = COST.step_time(StepShape(num_decodes=1, num_sampled=1))
    for threads, speed in (("auto", 1.5), (1, 1.0)):
        config = _config([{**BOTH, "num_threads": threads}])
        (record,) = Simulation(config, shared).run([WorkItem(0.0, 96, 3)]).records
        assert record.ttft == pytest.approx(prefill / speed), threads
        assert record.tpot == pytest.approx(decode), threads  # a 1-token step: one thread
    machine = Machine(2.0, background=0.5)
    machine._busy = 1  # one busy worker: 2 / 1.5 cores, a third of a core to spare
    assert machine.speed(1.5) == pytest.approx(1.0 + 0.5 / 3) and machine.speed() == 1.0
    machine._busy = 2  # two: 0.8 of a core each, whatever their threads
    assert machine.speed(1.5) == machine.speed() == pytest.approx(0.8)


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget() -> None:
    pool = {**BOTH, "scheduler": {"max_num_batched_tokens": 64, "max_num_seqs": 8}}
    result = Simulation(_config([pool]), COST).run([WorkItem(0.0, 256, 2)])
    (record,) = result.records
    chunk = COST.step_time(StepShape(prefill_tokens=64))
    assert record.ttft == pytest.approx(4 * chunk, rel=1e-6)
    assert result.instances["c-0"]["num_prompt_tokens_computed"] == 256


def test_kv_pressure_preempts_and_everything_still_finishes() -> None:
    pool = {**BOTH, "num_blocks": 24}  # 384 tokens of KV for 8 requests of up to 160
    work = [WorkItem(0.001 * i, 64, 96) for i in range(8)]
    result = Simulation(_config([pool]), COST).run(work)
    assert result.instances["c-0"]["num_preemptions"] > 0
    assert all(r.num_tokens == 96 and r.error is None for r in result.records)
    assert result.instances["c-0"]["num_free_blocks"] == 24  # every block back


def test_a_shared_prefix_is_computed_once() -> None:
    work = [WorkItem(0.5 * i, 600, 4, prefix_group=0, prefix_len=512) for i in range(6)]
    cached = Simulation(_config([BOTH]), COST).run(work)
    pool = {**BOTH, "cache": {"enable_prefix_caching": False}}
    uncached = Simulation(_config([pool]), COST).run(work)
    computed = cached.instances["c-0"]["num_prompt_tokens_computed"]
    assert computed == 600 + 5 * (600 - 512)
    assert uncached.instances["c-0"]["num_prompt_tokens_computed"] == 6 * 600
    ttft = [r.ttft or 0 for r in cached.records[1:]]
    assert max(ttft) < min(r.ttft or 0 for r in uncached.records[1:])


def test_the_hand_off_costs_its_transfer_time() -> None:
    """Disaggregated: the first token comes from the prefill instance, the second after the
    KV crossed at the cost model's bandwidth; a slower link delays only what follows."""
    config = _config(PD, router={"disaggregation": "always"})
    work = [WorkItem(0.0, 1024, 3)]
    slow = LinearCostModel(**{**COST.__dict__, "transfer_bytes_per_s": 1e7})
    fast_run, slow_run = (Simulation(config, c).run(work) for c in (COST, slow))
    (fast,), (slower,) = fast_run.records, slow_run.records
    assert fast.ttft == pytest.approx(slower.ttft or 0)
    extra = slow.transfer_time(1024 * 1000) - COST.transfer_time(1024 * 1000)
    assert (slower.e2e or 0) - (fast.e2e or 0) == pytest.approx(extra, abs=0.02)
    assert fast_run.instances["d-0"]["kv_bytes_loaded"] == 1024 * 1000
    assert fast_run.instances["p-0"]["num_kv_saves_started"] == 1


def test_hand_offs_into_one_instance_share_its_link() -> None:
    """Two prompts prefilled at once on two prefill instances load into one decode instance
    over a 10 MB/s link: the second's bytes come after the first's (each load was priced
    alone, as if the link were the first's only)."""
    pools = [{**PD[0], "replicas": 2}, PD[1]]
    config = _config(pools, router={"disaggregation": "always"})
    slow = LinearCostModel(**{**COST.__dict__, "transfer_bytes_per_s": 1e7})
    run = Simulation(config, slow).run([WorkItem(0.0, 1024, 3), WorkItem(0.0, 1024, 3)])
    assert {r.ttft for r in run.records} == {run.records[0].ttft}  # prefilled side by side
    first, second = sorted(r.e2e or 0 for r in run.records)
    bytes_s = slow.transfer_time(1024 * 1000) - slow.transfer_time(0)  # 0.1 s
    assert second - first == pytest.approx(bytes_s, abs=0.01)


def test_a_step_waiting_for_kv_costs_no_compute() -> None:
    """A decode instance whose only request waits for its KV steps with nothing to compute:
    like the worker, it waits for the load to land (no core, no step cost), and the next step
    decodes. Such a step was priced as a whole step (50 ms here) before the load was seen."""
    config = _config(PD, router={"disaggregation": "always"})
    slow_steps = LinearCostModel(**{**COST.__dict__, "coefficients": {"const": 0.05}})
    run = Simulation(config, slow_steps).run([WorkItem(0.0, 64, 2)])
    (record,) = run.records
    assert record.first_token_s is not None and record.end_s is not None
    load = slow_steps.transfer_time(64 * 1000)
    # the hand-off, the load, and one decode step (plus the loop's turns: well under a step)
    assert record.end_s - record.first_token_s == pytest.approx(load + 0.05, abs=0.01)


def test_the_waiting_bound_refuses_a_burst_with_a_clear_error() -> None:
    config = _config([BOTH], serve={"max_waiting_requests": 4})
    work = [WorkItem(0.0, 512, 8) for _ in range(40)]
    result = Simulation(config, COST).run(work, SLO(10.0, 1.0))
    refused = [r for r in result.records if r.error is not None]
    assert refused and all("waiting" in (r.error or "") for r in refused)
    summary = result.summary()
    assert summary["errors"] == len(refused)
    assert summary["finished"] + summary["errors"] == 40
    assert summary["slo_attainment"] == pytest.approx(summary["finished"] / 40)


def test_slo_attainment_and_percentiles() -> None:
    good = RequestRecord(0.0, 10, 3, first_token_s=0.1, end_s=0.3, num_tokens=3)
    slow_first = RequestRecord(0.0, 10, 3, first_token_s=2.0, end_s=2.2, num_tokens=3)
    slow_after = RequestRecord(0.0, 10, 3, first_token_s=0.1, end_s=5.1, num_tokens=3)
    failed = RequestRecord(0.0, 10, 3, end_s=0.0, error="refused")
    slo = SLO(ttft_s=1.0, tpot_s=0.5)
    assert [r.meets(slo) for r in (good, slow_first, slow_after, failed)] == [
        True,
        False,
        False,
        False,
    ]
    assert good.tpot == pytest.approx(0.1)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert math.isnan(percentile([], 0.9))


def test_goodput_against_the_offered_rate_is_at_most_that_rate() -> None:
    """Five requests that met the SLO, arriving 0.8 s apart -- a sample of a 1 req/s Poisson
    workload that came out short: per second of its own span the goodput reads 1.25 req/s,
    above the rate offered; against the offered rate it is attainment x 1.0."""
    slo = SLO(ttft_s=1.0, tpot_s=1.0)
    records = [RequestRecord(0.8 * i, 8, 2, 0.8 * i + 0.1, 0.8 * i + 0.2, 2) for i in range(5)]
    result = SimResult(records, 3.4, 0.1, slo)
    assert result.summary()["goodput_requests_s"] == pytest.approx(1.25)  # 5 x 4/5 / 3.2 s
    assert result.summary(offered_rate=1.0)["goodput_requests_s"] == pytest.approx(1.0)
    refused = RequestRecord(4.0, 8, 2, end_s=4.0, error="refused")
    summary = SimResult([*records, refused], 4.2, 0.1, slo).summary(offered_rate=1.0)
    assert summary["slo_attainment"] == pytest.approx(5 / 6)
    assert summary["goodput_requests_s"] == pytest.approx(5 / 6)
    nothing = SimResult([refused], 0.0, 0.1, slo).summary(offered_rate=1.0)
    assert nothing["goodput_requests_s"] == 0.0


def test_gpu_roofline_is_memory_bound_for_decode_and_compute_bound_for_prefill() -> None:
    model = gpu_model("llama-3-8b@h100-sxm")
    assert model.model.num_params == pytest.approx(8.03e9, rel=0.01)
    assert model.kv_bytes_per_token() == 128 * 1024
    one = model.step_time(StepShape(num_decodes=1, decode_context=512, num_sampled=1))
    many = model.step_time(StepShape(num_decodes=32, decode_context=32 * 512, num_sampled=32))
    assert many < 1.5 * one  # decode reads the weights once for the whole batch
    # What a batch-1 decode reads: the layers and the LM head (7.5 B parameters, bf16), not
    # the embedding table (0.5 B) of which it looks up one row; plus 512 tokens of KV.
    read = (8.03e9 - 128256 * 4096) * 2 + 513 * 128 * 1024
    assert one == pytest.approx(read / (3.35e12 * 0.8) + 0.002, rel=0.01)
    short = model.step_time(StepShape(prefill_tokens=512, prefill_pairs=512 * 256))
    long = model.step_time(StepShape(prefill_tokens=4096, prefill_pairs=4096 * 2048))
    assert long > 6 * short  # prefill grows with its tokens
    tp4 = gpu_model("llama-3-70b@h100-sxmx4")
    assert tp4.tp == 4 and (tp4.kv_capacity_tokens() or 0) > 0
    with pytest.raises(ValueError, match="MODEL@GPU"):
        gpu_model("llama-3-8b@tpu")
    with pytest.raises(ValueError, match="does not fit"):
        gpu_model("llama-3-70b@a100-80gb").kv_capacity_tokens()
    # A small chunk after a long context reads that context's KV (3.9 GB at 30k tokens: the
    # step was priced as if the chunk started the sequence).
    pairs = 16 * (30_000 + 8.5)
    late = StepShape(prefill_tokens=16, prefill_pairs=pairs, prefill_context=30_000)
    early = StepShape(prefill_tokens=16, prefill_pairs=pairs)
    extra = 30_000 * 128 * 1024 / (3.35e12 * 0.8)
    assert model.step_time(late) - model.step_time(early) == pytest.approx(extra, rel=0.01)
    from cluster.sim.executor import step_shape

    shape = step_shape({"a": 16, "b": 1}, {"a": 30_000, "b": 99}, set(), 2)
    assert shape.prefill_context == 30_000 and shape.decode_context == 100


def test_pipeline_stages_overlap_their_steps_and_hold_more_kv() -> None:
    """A pool of two pipeline stages runs two steps at once (each stage a share of the layers
    of one step), so it serves the same requests sooner than one stage, and its GPUs hold
    the weights once between them, so more KV fits. (Each step used to be priced as the
    whole model, one after another: twice the GPUs looked 1.5x slower.)"""
    cost = gpu_model("llama-3-8b@h100-sxm")
    work = [WorkItem(0.001 * i, 512, 64) for i in range(64)]
    results = {}
    for pp in (1, 2):
        pools = [{"name": "c", "role": "both", "pp_size": pp}]  # KV: as much as fits
        config = ClusterConfig.model_validate(
            {"block_size": 16, "admission_window_s": 0.0, "pools": pools}
        )
        result = Simulation(config, cost).run(work)
        (stats,) = result.instances.values()
        results[pp] = (result.summary(), stats)
    (one, one_stats), (two, two_stats) = results[1], results[2]
    assert two["finished"] == one["finished"] == 64
    assert two["duration_s"] < 0.8 * one["duration_s"]
    assert two["tpot_p50_s"] < one["tpot_p50_s"] and two["ttft_p50_s"] < one["ttft_p50_s"]
    assert two_stats["num_blocks"] > 2 * one_stats["num_blocks"]
    assert two_stats["max_in_flight"] == 2  # two steps at once, one per stage
    # A stage's blocks hold its own layers: the same kv_cache_memory_bytes, twice the blocks
    # (as the workers size them; the whole model's bytes per token were used).
    sized = {}
    for pp in (1, 2):
        pools = [{"name": "c", "role": "both", "pp_size": pp, "kv_cache_memory_bytes": 2**30}]
        config = ClusterConfig.model_validate({"block_size": 16, "pools": pools})
        (stats,) = Simulation(config, cost).run(work[:1]).instances.values()
        sized[pp] = stats["num_blocks"]
    assert sized[2] == 2 * sized[1] == 2 * (2**30 // (16 * 128 * 1024))


def test_a_pipelined_decode_pool_loads_each_stages_layers_over_its_own_link() -> None:
    """Each stage fetches its own layers, side by side: a hand-off into a two-stage pool
    takes half the bytes' time of a one-stage pool's (it was priced as all the bytes over
    one link)."""
    slow = LinearCostModel(**{**COST.__dict__, "transfer_bytes_per_s": 1e7})
    ends = {}
    for pp in (1, 2):
        pools = [PD[0], {**PD[1], "pp_size": pp}]
        config = _config(pools, router={"disaggregation": "always"})
        (record,) = Simulation(config, slow).run([WorkItem(0.0, 1024, 3)]).records
        ends[pp] = record.e2e or 0
    bytes_s = slow.transfer_time(1024 * 1000) - slow.transfer_time(0)  # 0.1 s over one link
    assert ends[1] - ends[2] == pytest.approx(bytes_s / 2, abs=0.01)


def test_a_memory_budget_sizes_the_kv_and_a_burst_has_a_goodput() -> None:
    """A pool's ``memory_budget_bytes`` (per GPU: the weights' share, then KV) sizes its KV
    cache as the workers do (it was ignored: the whole GPU went to KV); a cost model that
    does not know the weights says so. Requests that all arrive at once have a goodput per
    second of the run (it read 0)."""
    cost = gpu_model("llama-3-8b@h100-sxm")
    pools = [{"name": "c", "role": "both", "memory_budget_bytes": 20 * 10**9}]
    config = ClusterConfig.model_validate({"block_size": 16, "pools": pools})
    result = Simulation(config, cost).run([WorkItem(0.0, 64, 4)] * 4, SLO(1.0, 0.1))
    (stats,) = result.instances.values()
    weights = cost.model.num_params * 2
    assert stats["num_blocks"] == (20 * 10**9 - weights) // (16 * 128 * 1024)
    summary = result.summary()
    assert summary["slo_attainment"] == 1.0
    assert summary["goodput_requests_s"] == pytest.approx(4 / summary["duration_s"])
    with pytest.raises(ValueError, match="knows the weights"):
        linear = _config([{"name": "c", "role": "both", "memory_budget_bytes": 10**9}])
        Simulation(linear, COST).run([WorkItem(0.0, 8, 2)])


def test_a_linear_model_fits_what_it_was_made_from(tmp_path: Any) -> None:
    samples = [
        (StepShape(prefill_tokens=n, num_sampled=1), COST.step_time(StepShape(prefill_tokens=n)))
        for n in (16, 64, 256)
    ]
    samples += [
        (StepShape(num_decodes=b, num_sampled=b), COST.step_time(StepShape(num_decodes=b)))
        for b in (1, 8, 32)
    ]
    fitted = LinearCostModel.fit("fit", samples, kv_bytes_token=1000)
    for shape, seconds in samples:
        assert fitted.step_time(shape) == pytest.approx(seconds, rel=1e-6)
    fitted.save(tmp_path / "m.json")
    assert LinearCostModel.load(tmp_path / "m.json") == fitted


def test_the_plan_meets_the_slo_and_one_instance_fewer_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cluster.sim import planner
    from cluster.sim.planner import Candidate, plan

    # (The test's time: the two points it checks, of 6; each is the workload 3 times over.)
    monkeypatch.setattr(planner, "CURVE", (0.5, 2.0))
    base = _config([BOTH])
    slo = SLO(ttft_s=0.25, tpot_s=0.05)

    def work(rate: float) -> list[WorkItem]:
        return poisson(rate, 120, "chat", seed=5)

    result = plan(base, COST, work, 60.0, slo, target=0.9, max_instances=6)
    assert result.chosen is not None and result.config is not None
    chosen = result.chosen.candidate
    assert chosen.instances > 1  # the rate needs more than one instance
    again = Simulation(result.config, COST).run(work(60.0), slo).summary()
    assert again["slo_attainment"] >= 0.9  # the printed config does what the plan says
    # Every shape one instance smaller was tried, and none met the target.
    smaller = [t for t in result.trials if t.candidate.instances == chosen.instances - 1]
    # (or met it only while its queue was short: not over the workload three times over)
    assert smaller and all(not (t.meets(0.9) and t.keeps_up(0.9)) for t in smaller)
    assert {t.candidate for t in smaller} >= {Candidate(both=chosen.instances - 1)}
    # The curve: attainment falls as the rate grows past the plan's.
    attainment = [point["attainment"] for point in result.curve]
    assert attainment[0] >= attainment[-1] and attainment[-1] < 0.9


def test_the_plan_refuses_a_cluster_that_meets_the_slo_only_while_its_queue_is_short(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One instance (KV for everything) serves 200 requests at 90/s within the SLO, but
    completes about 66/s: its queue grows while the load lasts, and the same requests three
    times over break the SLO. The plan takes two instances."""
    from cluster.sim import planner
    from cluster.sim.planner import LONGER, plan, repeated

    # The goodput curve is not what this test checks (the test above does): one point, not
    # 6 (600 requests each, up to twice the rate two instances complete).
    monkeypatch.setattr(planner, "CURVE", (1.0,))

    slo = SLO(ttft_s=1.0, tpot_s=0.05)
    base = _config([{**BOTH, "num_blocks": 4096}])

    def work(rate: float) -> list[WorkItem]:
        return poisson(rate, 200, "fixed", seed=0)

    result = plan(base, COST, work, 90.0, slo, max_instances=2, disaggregated=False)
    assert result.chosen is not None and result.chosen.candidate.instances == 2
    [one] = [t for t in result.trials if t.candidate.instances == 1]
    assert one.meets(0.9)  # its short run met the SLO ...
    assert one.sustained is not None and one.sustained["slo_attainment"] < 0.9  # not longer
    assert one.sustained["throughput_requests_s"] < 70
    assert result.chosen.keeps_up(0.9)
    longer = repeated(work(90.0), LONGER)
    assert len(longer) == 600 and len({w.arrival_s for w in longer}) == 600
    assert max(w.arrival_s for w in longer) < 3.1 * max(w.arrival_s for w in work(90.0))
    burst = [WorkItem(0.0, 8, 2)] * 5  # no rate to keep up with: served as it is
    assert repeated(burst, LONGER) == burst


def test_a_bursts_goodput_curve_is_per_second_of_the_run_not_of_a_stand_in_rate(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``tandem plan --trace`` of a burst (every arrival at once) plans at a stand-in rate of
    1 request/s: its curve serves the same burst at each point. Its goodput is per second of
    the run, one value (``test_a_memory_budget_sizes_the_kv_and_a_burst_has_a_goodput``); as
    attainment x the stand-in rate it read 0.5 and 2.0 requests/s, as if it scaled."""
    from cluster.sim import planner
    from cluster.sim.planner import plan

    monkeypatch.setattr(planner, "CURVE", (0.5, 2.0))
    burst = [WorkItem(0.0, 8, 2)] * 5
    result = plan(_config([BOTH]), COST, lambda rate: list(burst), 1.0, SLO(1.0, 1.0))
    assert result.chosen is not None and result.chosen.candidate.instances == 1
    first, last = (point["goodput"] for point in result.curve)
    assert first == last > 0
    assert first == pytest.approx(result.chosen.summary["goodput_requests_s"])


def test_the_planner_tries_each_pools_token_budget_on_its_own() -> None:
    from cluster.sim.planner import Candidate, candidates

    shapes = list(candidates(3, (512, 4096), colocated=True, disaggregated=True))
    colocated = [c for c in shapes if c.both]
    split = {(c.prefill, c.budget("prefill"), c.budget("decode")) for c in shapes if not c.both}
    assert [c.max_num_batched_tokens for c in colocated] == [512, 4096]
    assert split == {(p, a, b) for p in (1, 2) for a in (512, 4096) for b in (512, 4096)}
    shape = Candidate(1, 2, max_num_batched_tokens=4096, decode_batched_tokens=512)
    pools = {pool.role: pool for pool in shape.config(_config([BOTH])).pools}
    assert pools["prefill"].scheduler["max_num_batched_tokens"] == 4096
    assert pools["decode"].scheduler["max_num_batched_tokens"] == 512
    assert pools["decode"].scheduler["max_num_seqs"] <= 512
    assert shape.label() == "1P + 2D, max_num_batched_tokens P 4096 / D 512"


def test_a_gpu_plan_prints_a_config_that_runs_the_model_on_gpus() -> None:
    """``tandem plan --model M`` with a GPU cost model: the printed ClusterConfig serves M on
    CUDA with the cost model's GPUs per instance (not the built-in model on CPU)."""
    from cluster.config import default_cluster_config
    from cluster.sim.cost import gpu_model
    from cluster.tools.sim_cli import for_cost_model

    base = default_cluster_config()
    config, note = for_cost_model(base, gpu_model("llama-3-8b@h100-sxm"), "/models/llama-3-8b")
    assert config.model == "/models/llama-3-8b" and note is None
    assert all(p.device == "cuda" and p.num_gpus == 1.0 for p in config.pools)
    # Each worker gets the KV cache the simulation gave it (unsized, a worker takes 1 GiB).
    cost = gpu_model("llama-3-8b@h100-sxm")
    capacity = cost.kv_capacity_tokens()
    assert capacity is not None
    weights = cost.model.num_params * cost.model.bytes_per_param
    for pool in config.pools:
        assert pool.memory_budget_bytes == int(80e9 * 0.9)
        assert (
            abs((pool.memory_budget_bytes - weights) // cost.kv_bytes_per_token() - capacity) <= 1
        )
    # A plan that assumed tensor parallelism says that Tandem's workers do not have it.
    _, note = for_cost_model(base, gpu_model("llama-3-70b@h100-sxmx4"), None)
    assert note is not None and "4-way tensor parallelism" in note
    cpu, note = for_cost_model(base, COST, None)  # a CPU model leaves the pools as they are
    assert cpu == base and note is None


def test_a_load_that_lands_during_a_step_is_reported_at_the_end_of_the_next() -> None:
    """A worker writes the loads that landed before a step starts and reports them at its
    end: one landing 10 ms into a 50 ms step comes with the next step's output (the
    simulator reported it with this one, a decode step early)."""
    from cluster.sim.executor import SimExecutor, _Load
    from scheduler import CacheConfig, Request, SamplingParams, SchedulerConfig

    cost = LinearCostModel(**{**COST.__dict__, "coefficients": {"const": 0.05}})
    executor = SimExecutor("d-0", cost, block_size=16)
    s = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(block_size=16, num_blocks=16),
    )
    s.add_request(Request("a", [5] * 8, SamplingParams(max_tokens=4), eos_token_id=2))

    async def main() -> list[set[str] | None]:
        now = asyncio.get_running_loop().time()
        executor._loads.append(_Load("b", now, now + 0.01, 100, True))
        reported = []
        for _ in range(2):
            out = s.schedule()
            result = await executor.execute_model(out)
            reported.append(result.finished_recving)
            s.update_from_output(out, result)
        return reported

    assert run_virtual(main()) == [None, {"b"}]


def test_an_instance_going_idle_takes_a_step_of_nothing_at_no_cost() -> None:
    """The step that tells the workers a finished request is gone computes nothing: the
    worker returns at once, and the loop waits for the next arrival, which starts at once
    (the step was priced as a whole one, 50 ms here, and the loop slept 2 ms after it)."""
    cost = LinearCostModel(**{**COST.__dict__, "coefficients": {"const": 0.05}})
    config = _config([BOTH])
    work = [WorkItem(0.0, 32, 1), WorkItem(0.051, 32, 1)]
    first, second = sorted(Simulation(config, cost).run(work).records, key=lambda r: r.arrival_s)
    assert first.ttft == pytest.approx(0.05)
    assert second.ttft == pytest.approx(0.05)  # not 0.099


def test_a_pipelines_first_stage_writes_the_loads_that_landed_before_it_starts() -> None:
    """With two stages, a step waits for the first stage to be free; a load that lands
    while it waits is written by that step and reported at its end (it was taken as of the
    step's call, and waited a step more)."""
    from cluster.sim.executor import SimExecutor, _Load
    from scheduler import CacheConfig, Request, SamplingParams, SchedulerConfig

    cost = LinearCostModel(**{**COST.__dict__, "coefficients": {"const": 0.05}})
    executor = SimExecutor("d-0", cost, block_size=16, stages=2)
    s = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
        CacheConfig(block_size=16, num_blocks=16),
    )
    s.add_request(Request("a", [5] * 8, SamplingParams(max_tokens=4), eos_token_id=2))

    async def main() -> list[set[str] | None]:
        loop = asyncio.get_running_loop()
        first = s.schedule()  # holds the first stage for 25 ms
        busy = asyncio.ensure_future(executor.execute_model(first))
        await asyncio.sleep(0)
        s.add_request(Request("c", [6] * 8, SamplingParams(max_tokens=4), eos_token_id=2))
        second = s.schedule()
        assert list(second.num_scheduled_tokens) == ["c"]
        now = loop.time()
        executor._loads.append(_Load("b", now, now + 0.01, 100, True))  # lands meanwhile
        outputs = await asyncio.gather(busy, executor.execute_model(second))
        return [output.finished_recving for output in outputs]

    assert run_virtual(main()) == [None, {"b"}]


def test_a_file_the_tools_cannot_read_or_write_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tandem plan --trace`` of a missing file (or ``--out`` where nothing can be
    written): the caller's error in a line and exit status 2 (they were tracebacks)."""
    from cluster.tools.cli import main

    missing = tmp_path / "none.jsonl"
    assert main(["plan", "--trace", str(missing), "--slo-ttft-ms", "1000"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"tandem plan: [Errno 2] No such file or directory: '{missing}'"
    )


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["sim", "run", "--num-requests", "0"], "--num-requests"),
        (["sim", "run", "--rate", "0"], "--rate"),
        (["sim", "run", "--rate", "nan"], "--rate"),
        (["sim", "run", "--rate", "inf"], "--rate"),
        (["sim", "run", "--prefill", "-1"], "--prefill"),
        (["sim", "run", "--slo-tpot-ms", "-5"], "--slo-tpot-ms"),
        (["sim", "calibrate", "--repeats", "0"], "--repeats"),
        (["plan", "--target", "0"], "--target"),
        (["plan", "--target", "1.5"], "--target"),
        (["plan", "--max-instances", "0"], "--max-instances"),
        (["plan", "--batched-tokens", "2048,0"], "--batched-tokens"),
        (["plan", "--batched-tokens", "2048,x"], "--batched-tokens"),
        # An unknown shape was a KeyError traceback (sim run and plan alike).
        (["sim", "run", "--shape", "chatt"], "--shape"),
        (["plan", "--shape", "chatt", "--slo-ttft-ms", "500"], "--shape"),
    ],
)
def test_a_count_rate_or_target_out_of_range_is_a_usage_error(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A value out of range names its flag, as argparse says any usage error: ``sim run
    --num-requests 0`` printed NaN latencies, ``plan --target 0`` printed the smallest
    cluster (every shape meets it), ``--max-instances 0`` searched nothing."""
    from cluster.tools.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err


def test_calibrate_with_a_model_it_cannot_load_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tandem sim calibrate --model`` of a file that is not a model: a line naming it, not
    a traceback (``tandem generate`` said it so; calibrate did not)."""
    from cluster.tools.cli import main

    bad = tmp_path / "model.gguf"
    bad.write_text("not weights")
    assert main(["sim", "calibrate", "--model", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem sim calibrate: ") and "not a GGUF file" in err, err
    assert "\n" not in err
    assert main(["sim", "calibrate", "--model", str(tmp_path / "missing.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tandem sim calibrate: ") and "\n" not in err, err


def test_calibrate_reports_an_error_after_the_model_loaded_as_a_bug(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only a model it cannot load is a one-line usage error: a ValueError of the measurement
    itself (here the cache's set-up) was printed as one too, hiding where it came from."""
    from actors.worker import ModelWorker
    from cluster.tools.cli import main

    def broken(self: ModelWorker, num_blocks: int) -> None:
        raise ValueError("a bug of the measurement")

    monkeypatch.setattr(ModelWorker, "init_kv_cache", broken)
    with pytest.raises(ValueError, match="a bug of the measurement"):
        main(["sim", "calibrate"])


def test_a_planned_pool_runs_as_many_requests_as_its_base_unless_its_budget_is_smaller() -> None:
    """``tandem plan`` judged (and printed) every shape with max_num_seqs 256 where the base
    left it unset -- the scheduler's default is 128, and the base's pools run that."""
    from cluster.sim.planner import Candidate
    from scheduler import SchedulerConfig

    default = SchedulerConfig.model_fields["max_num_seqs"].default
    [both] = Candidate(both=1).config(_config([BOTH])).pools
    assert both.scheduler_config(None).max_num_seqs == default
    small = Candidate(1, 1, max_num_batched_tokens=4096, decode_batched_tokens=64)
    seqs = {p.role: p.scheduler["max_num_seqs"] for p in small.config(_config(PD)).pools}
    assert seqs == {"prefill": default, "decode": 64}  # lowered to the budget only
    given = {**BOTH, "scheduler": {"max_num_seqs": 512}}
    [pool] = Candidate(both=1, max_num_batched_tokens=4096).config(_config([given])).pools
    assert pool.scheduler["max_num_seqs"] == 512  # the base's own, kept


def test_a_trace_is_scaled_to_rate_and_refuses_the_generators_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--rate`` with ``--trace`` scales the trace's arrivals (it was silently ignored:
    ``sim run`` served the trace as recorded, ``plan`` sized for the trace's own rate);
    ``--num-requests`` / ``--shape`` with a trace are refused, not ignored; a trace line
    that is no work item is a one-line error in ``plan`` too (it was a traceback)."""
    import argparse

    from cluster.sim.workload import write_trace
    from cluster.tools.cli import main
    from cluster.tools.sim_cli import workload

    trace = tmp_path / "t.jsonl"
    write_trace([WorkItem(1.0 * i, 64, 8) for i in range(11)], trace)  # 1 request/s
    args = argparse.Namespace(trace=str(trace), rate=4.0, num_requests=None, shape=None, seed=0)
    items = workload(args)
    assert items[-1].arrival_s - items[0].arrival_s == pytest.approx(10 / 4)
    args.rate = None
    assert workload(args)[-1].arrival_s == 10.0  # as recorded
    assert main(["sim", "run", "--trace", str(trace), "--num-requests", "5"]) == 2
    assert "--num-requests and --shape" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"arrival_s": 0, "prompt_len": 4}\n')  # no output_len
    assert main(["plan", "--trace", str(bad), "--slo-ttft-ms", "500"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tandem plan: {bad}:1: not a work item") and "Traceback" not in err


def test_a_cost_model_that_is_not_one_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--cost`` of a JSON file that is no fitted model (a bench result, a list) and a GPU
    spec of 0 GPUs: one line naming it, exit 2 (they were TypeError / AttributeError /
    ZeroDivisionError tracebacks)."""
    from cluster.tools.cli import main

    results = tmp_path / "results.json"
    results.write_text('{"config": {}, "runs": []}')
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    for cost in (str(results), str(listed)):
        assert main(["sim", "run", "--cost", cost, "--num-requests", "2"]) == 2
        assert "not a fitted cost model" in capsys.readouterr().err
    argv = ["plan", "--cost", "llama-3-8b@h100-sxmx0", "--slo-ttft-ms", "500"]
    assert main(argv) == 2
    assert "unknown GPU cost model" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown GPU cost model"):
        gpu_model("llama-3-8b@h100-sxmx0")


def test_of_two_qualifying_splits_the_plan_takes_the_one_that_holds_up_longer() -> None:
    """Both splits meet the SLO and keep up: the one with the higher attainment over the
    longer run is the plan, not the one a little higher over the single run (the margin
    under sustained load is what the plan is for)."""
    from cluster.sim.planner import Candidate, Trial

    def summary(attainment: float) -> dict[str, Any]:
        return {"slo_attainment": attainment, "goodput_requests_s": 1.0}

    thin = Trial(Candidate(prefill=1, decode=2), summary(0.99), sustained=summary(0.91))
    wide = Trial(Candidate(prefill=2, decode=1), summary(0.98), sustained=summary(0.99))
    assert thin.keeps_up(0.9) and wide.keeps_up(0.9)
    assert max([thin, wide], key=Trial.rank) is wide
    burst = Trial(Candidate(both=2), summary(0.95))  # (no longer run: its single run decides)
    assert max([burst, thin], key=Trial.rank) is burst
