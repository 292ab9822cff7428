"""The SchedulerActor's hand-off when something breaks, in one process: workers are in-process
``ModelWorker``s behind ``LocalExecutor`` with the real ``ray`` KV transport (the session's Ray
cluster holds the objects). Requests end -- with the right tokens or a clear error -- and leave
nothing behind."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import RayCluster, plasma_objects, wait_until

pytest.importorskip("ray")

from actors.worker import ModelWorker
from cluster.config import ClusterConfig, InstancePool
from cluster.control.executors import LocalExecutor
from cluster.control.placement import InstanceSpec
from cluster.control.scheduler_actor import SchedulerActor
from scheduler import ModelRunnerOutput, Request, SamplingParams, SchedulerOutput

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [(7 * i + 3) % 250 + 3 for i in range(21)]


class BreakableExecutor(LocalExecutor):
    broken = False

    async def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.broken:
            raise ConnectionError("worker died")
        return await super().execute_model(scheduler_output)


def _actor(model: Path) -> tuple[SchedulerActor, dict[str, Any]]:
    config = ClusterConfig(
        model=str(model),
        block_size=4,
        pools=[
            InstancePool(name="p", role="prefill", num_blocks=64),
            InstancePool(name="d", role="decode", num_blocks=64),
        ],
        router={"disaggregation": "always"},
    )
    specs, workers = [], {}
    for pool in config.pools:
        worker = ModelWorker(str(model), block_size=4, progress=False, kv_transfer="ray")
        worker.load_model()
        worker.init_kv_cache(64)
        iid = f"{pool.name}-0"
        workers[iid] = worker
        specs.append(InstanceSpec(iid, pool, BreakableExecutor(worker), None, worker.info()))
    return SchedulerActor(config, specs), workers


async def _collect(actor: SchedulerActor, request_id: str) -> list[Any]:
    return [o async for o in actor.generate(Request(request_id, PROMPT, PARAMS, eos_token_id=2))]


def test_decode_instance_gone_at_hand_off(ray_cluster: RayCluster, tiny_model: Path) -> None:
    actor, workers = _actor(tiny_model)

    async def run() -> list[Any]:
        await actor.start()
        workers["p-0"].set_fault_injection(step_delay_s=0.3)
        task = asyncio.ensure_future(_collect(actor, "x"))
        await asyncio.sleep(0.1)  # the prefill step is running; now the decode worker dies
        executor = actor.specs["d-0"].executor
        assert isinstance(executor, BreakableExecutor)
        executor.broken = True
        probe = Request("probe", [5, 6], PARAMS)
        actor.engines["d-0"].loop.add_request(probe)  # its next step fails
        outs = await task
        await actor.shutdown()
        return outs

    outs = asyncio.run(asyncio.wait_for(run(), 60))
    tokens = [t for o in outs for t in o.new_token_ids]
    assert len(tokens) == 1  # the prefill instance's token, then a clear error
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == "error"
    assert outs[-1].error and "decode" in outs[-1].error
    assert asyncio.run(actor.stats())["instances"]["p-0"]["kv_cache_usage"] == 0.0
    wait_until(lambda: plasma_objects() == 0, 10, "the KV object to be released")


def test_failed_save_is_recomputed_on_decode(ray_cluster: RayCluster, tiny_model: Path) -> None:
    actor, workers = _actor(tiny_model)

    async def run() -> tuple[list[int], list[int]]:
        await actor.start()
        good = [t for o in await _collect(actor, "a") for t in o.new_token_ids]
        await actor.reset_prefix_cache()
        connector = workers["p-0"].connector
        assert connector is not None

        def full(req_id: str, data: Any) -> Any:
            raise MemoryError("object store full")

        connector._save = full  # type: ignore[method-assign]
        before = (await actor.stats())["instances"]["d-0"]["num_prompt_tokens_computed"]
        again = [t for o in await _collect(actor, "b") for t in o.new_token_ids]
        after = (await actor.stats())["instances"]["d-0"]["num_prompt_tokens_computed"]
        assert after - before == len(PROMPT)  # no KV arrived: the decode side recomputed
        await actor.shutdown()
        return good, again

    good, again = asyncio.run(asyncio.wait_for(run(), 60))
    assert len(good) == PARAMS.max_tokens and again == good
    assert not workers["p-0"].connector.history[-1].ok  # type: ignore[union-attr]


class SlowBreakableExecutor(LocalExecutor):
    """Each step takes 0.1 s, and fails once ``broken`` (its worker died meanwhile)."""

    broken = False

    async def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        await asyncio.sleep(0.1)
        if self.broken:
            raise ConnectionError("worker died")
        return await super().execute_model(scheduler_output)


def test_a_step_failing_as_its_instance_is_retired_moves_its_requests(
    ray_cluster: RayCluster, tiny_model: Path
) -> None:
    """A retire stops the engine, then moves what it still holds. A step that fails while it
    stops (the worker died in the drain's last moment) ended those requests with an error
    instead: the very ones the retire was to move. They move, and finish with the tokens of
    an undisturbed run."""
    from cluster.control.scheduler_actor import SchedulerActor

    config = ClusterConfig(
        model=str(tiny_model),
        block_size=4,
        pools=[InstancePool(name="c", role="both", replicas=2, num_blocks=64)],
    )
    specs = []
    for k in range(2):
        worker = ModelWorker(str(tiny_model), block_size=4, progress=False)
        worker.load_model()
        worker.init_kv_cache(64)
        specs.append(
            InstanceSpec(
                f"c-{k}", config.pools[0], SlowBreakableExecutor(worker), None, worker.info()
            )
        )
    actor = SchedulerActor(config, specs)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    async def collect(request_id: str) -> list[Any]:
        request = Request(request_id, PROMPT, params, eos_token_id=2)
        return [o async for o in actor.generate(request)]

    async def run() -> tuple[list[Any], list[Any]]:
        await actor.start()
        undisturbed = await collect("a")
        task = asyncio.ensure_future(collect("b"))
        await asyncio.sleep(0.5)  # decoding
        (iid,) = {f.instance for f in actor.flights.values()}
        executor = actor.specs[iid].executor
        assert isinstance(executor, SlowBreakableExecutor)
        executor.broken = True  # the step running now fails as the engine stops
        actor.views[iid].draining = actor.engines[iid].draining = True
        await actor._retire(iid)
        outs = await task
        await actor.shutdown()
        return undisturbed, outs

    undisturbed, outs = asyncio.run(asyncio.wait_for(run(), 120))
    assert outs[-1].finish_reason is not None and outs[-1].finish_reason.value == "length"
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == [t for o in undisturbed for t in o.new_token_ids]
