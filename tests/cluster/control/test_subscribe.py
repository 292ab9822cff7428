"""A client's batched stream (``SchedulerActor.submit`` / ``subscribe``), in one process on
the tiny model: the outputs of all of a client's requests come one batch per step, with the
same tokens as a stream per request; a refused request raises at ``submit``; a client that
leaves has its unfinished requests aborted and their blocks freed; shutdown ends the stream
after the last outputs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.worker import ModelWorker
from cluster.config import ClusterConfig, InstancePool
from cluster.control.executors import LocalExecutor
from cluster.control.flights import unpack_batch
from cluster.control.placement import InstanceSpec
from cluster.control.scheduler_actor import SchedulerActor
from cluster.errors import UnavailableError
from scheduler import Request, SamplingParams
from scheduler.outputs import EngineCoreOutput

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def _actor(model: Path) -> SchedulerActor:
    config = ClusterConfig(
        model=str(model), block_size=4, pools=[InstancePool(name="c", num_blocks=256)]
    )
    worker = ModelWorker(str(model), block_size=4, progress=False)
    worker.load_model()
    worker.init_kv_cache(256)
    spec = InstanceSpec("c-0", config.pools[0], LocalExecutor(worker), None, worker.info())
    return SchedulerActor(config, [spec])


def _prompt(i: int) -> list[int]:
    return [3 + i, 4, 5, 6 + i, 7]


async def _idle(actor: SchedulerActor) -> None:
    """Wait for every request and block to be gone; then check the schedulers."""
    for _ in range(500):
        stats = await actor.stats()
        if not stats["num_flights"] and all(
            i["num_requests"] == 0 and i["kv_cache_usage"] == 0.0
            for i in stats["instances"].values()
        ):
            await actor.check_integrity()
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not idle: {await actor.stats()}")


def test_a_clients_requests_come_one_batch_per_step(tiny_model: Path) -> None:
    actor = _actor(tiny_model)

    async def run() -> tuple[list[list[EngineCoreOutput]], dict[str, list[int]], dict[str, Any]]:
        await actor.start()
        batches: list[list[EngineCoreOutput]] = []
        done: set[str] = set()

        async def consume() -> None:
            async for tagged in actor.subscribe("client-1"):
                batch = [out for _, out in unpack_batch(tagged)]
                batches.append(batch)
                done.update(o.request_id for o in batch if o.finished)
                if len(done) == 8:
                    return

        consumer = asyncio.ensure_future(consume())
        await asyncio.gather(
            *(actor.submit(Request(f"r{i}", _prompt(i), GREEDY), "client-1") for i in range(8))
        )
        await asyncio.wait_for(consumer, 60)
        streamed = {}
        for i in range(8):  # the same prompts, one stream each
            outs = [o async for o in actor.generate(Request(f"s{i}", _prompt(i), GREEDY))]
            streamed[f"r{i}"] = [t for o in outs for t in o.new_token_ids]
        stats = (await actor.stats())["instances"]["c-0"]
        await _idle(actor)
        await actor.shutdown()
        return batches, streamed, stats

    batches, streamed, stats = asyncio.run(run())
    tokens: dict[str, list[int]] = {}
    for batch in batches:
        ids = [o.request_id for o in batch]
        assert len(ids) == len(set(ids)), "one merged output per request per batch"
        for out in batch:
            assert out.kv_transfer_params is None  # handles never leave the actor
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert tokens == streamed and all(len(t) == 12 for t in tokens.values())
    # 8 requests x 12 tokens = 96 outputs, carried in about one batch per step.
    assert sum(len(b) for b in batches) >= 8 * 12 / 2
    assert len(batches) <= stats["num_steps"] + 1
    assert any(len(b) > 1 for b in batches)


def test_a_refused_request_raises_at_submit(tiny_model: Path) -> None:
    actor = _actor(tiny_model)

    async def run() -> None:
        await actor.start()
        with pytest.raises(ValueError, match="max_model_len"):
            await actor.submit(Request("long", [5] * 2000, GREEDY), "client-1")
        await actor.submit(Request("a", _prompt(0), LONG), "client-1")
        with pytest.raises(ValueError, match="already in use"):
            await actor.submit(Request("a", _prompt(1), GREEDY), "client-2")
        assert actor.abort("a")
        batch = [out for _, out in unpack_batch(await actor.subscribe("client-1").__anext__())]
        assert batch[-1].request_id == "a" and batch[-1].finish_reason is not None
        assert batch[-1].finish_reason.value == "abort"
        await _idle(actor)
        await actor.shutdown()

    asyncio.run(asyncio.wait_for(run(), 60))


def test_a_client_that_leaves_has_its_requests_aborted(tiny_model: Path) -> None:
    actor = _actor(tiny_model)

    async def run() -> None:
        await actor.start()
        stream = actor.subscribe("leaver")
        for i in range(3):
            await actor.submit(Request(f"l{i}", _prompt(i), LONG), "leaver")
        await actor.submit(Request("other", _prompt(5), GREEDY), "stayer")
        first = [out for _, out in unpack_batch(await stream.__anext__())]  # tokens flow
        assert first and {o.request_id for o in first} <= {"l0", "l1", "l2"}
        await stream.aclose()  # the client is gone (Ray cancels its stream the same way)
        assert not any(rid.startswith("l") for rid in actor.live_request_ids())
        other: list[EngineCoreOutput] = []  # another client's request is untouched
        async for tagged in actor.subscribe("stayer"):
            other += [out for _, out in unpack_batch(tagged)]
            if other[-1].finished:
                break
        assert other[-1].finish_reason is not None and other[-1].finish_reason.value == "length"
        assert sum(len(o.new_token_ids) for o in other) == GREEDY.max_tokens
        await _idle(actor)
        await actor.shutdown()

    asyncio.run(asyncio.wait_for(run(), 60))


def test_shutdown_ends_the_stream_after_the_last_outputs(tiny_model: Path) -> None:
    actor = _actor(tiny_model)

    async def run() -> list[EngineCoreOutput]:
        await actor.start()
        await actor.submit(Request("a", _prompt(0), LONG), "client-1")
        stream = actor.subscribe("client-1")
        seen = [out for _, out in unpack_batch(await stream.__anext__())]
        await actor.shutdown()
        seen += [o async for tagged in stream for _, o in unpack_batch(tagged)]  # ends: no hang
        # A request sent meanwhile (``tandem down`` takes a while) may be sent again: a 503.
        with pytest.raises(UnavailableError, match="shutting down"):
            await actor.submit(Request("b", _prompt(1), LONG), "client-1")
        return seen

    seen = asyncio.run(asyncio.wait_for(run(), 60))
    assert seen[-1].finish_reason is not None and seen[-1].finish_reason.value == "abort"
    assert seen[-1].error == "shutdown"
    assert sum(o.finished for o in seen) == 1  # one last output, not one per party


def test_a_request_the_scheduler_refuses_ends_once(tiny_model: Path) -> None:
    """A request refused when its instance admits it (an empty prompt) ends with one error
    output, and the actor forgets it at once -- not at a next step that may never come (the
    instance is idle): its id is free again, and no second final (an abort) follows."""
    actor = _actor(tiny_model)

    async def run() -> list[EngineCoreOutput]:
        await actor.start()
        outs = [out async for out in actor.generate(Request("empty", [], GREEDY))]
        assert actor.live_request_ids() == []
        again = [out async for out in actor.generate(Request("empty", _prompt(0), GREEDY))]
        assert again[-1].finish_reason is not None and again[-1].finish_reason.value == "length"
        text = await actor.metrics_text()
        await _idle(actor)
        await actor.shutdown()
        ended = {
            sample.labels["finished_reason"]: sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "tandem:request_success_total"
        }
        assert ended["error"] == 1 and ended["abort"] == 0  # counted once, as what it was
        return outs

    outs = asyncio.run(asyncio.wait_for(run(), 60))
    assert len(outs) == 1 and outs[0].finish_reason is not None
    assert outs[0].finish_reason.value == "error" and "must not be empty" in (outs[0].error or "")


def test_submits_and_aborts_of_one_call_run_in_order(tiny_model: Path) -> None:
    """``submit_many`` runs a client's submits and aborts in the order given (a client sends
    its aborts the same way, one call at a time, so an id reused right after its abort is
    never refused nor ended by it): submit "a", abort "a", submit "a" again -- the first ends
    with abort, the second runs to its end."""
    actor = _actor(tiny_model)

    async def run() -> list[EngineCoreOutput]:
        await actor.start()
        stream = actor.subscribe("client-1")
        outcomes = await actor.submit_many(
            "client-1",
            [
                (Request("a", _prompt(0), LONG), None, 0),
                "a",
                (Request("a", _prompt(1), GREEDY), None, 1),
            ],
        )
        assert outcomes == [None, None, None]
        by_tag: dict[object, list[EngineCoreOutput]] = {0: [], 1: []}
        async for tagged in stream:
            for tag, out in unpack_batch(tagged):
                by_tag[tag].append(out)
            if by_tag[1] and by_tag[1][-1].finished:
                break
        await stream.aclose()
        await _idle(actor)
        await actor.shutdown()
        assert [o.finish_reason.value for o in by_tag[0] if o.finish_reason] == ["abort"]
        return by_tag[1]

    second = asyncio.run(asyncio.wait_for(run(), 60))
    assert second[-1].finish_reason is not None and second[-1].finish_reason.value == "length"
    assert sum(len(o.new_token_ids) for o in second) == GREEDY.max_tokens


def test_an_adapter_missing_on_one_instances_node_runs_on_another(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The router knows nothing of adapters: a request naming one whose files are not on
    the node of the instance it was routed to is routed again without it (another node may
    have them), and is a 404 only when no live instance could load it -- not when the one
    that had them failed while it loaded (a 503 then: it may come back)."""
    from cluster.errors import AdapterLoadError, UnavailableError
    from scheduler import LoRAConfig
    from tests.cluster.conftest import make_adapter

    lora = LoRAConfig(max_loras=1, max_lora_rank=8)
    config = ClusterConfig(
        model=str(tiny_model),
        block_size=4,
        lora=lora,
        pools=[InstancePool(name="c", num_blocks=128, replicas=2)],
    )
    specs = []
    for i in range(2):
        worker = ModelWorker(str(tiny_model), block_size=4, lora_config=lora, progress=False)
        worker.load_model()
        worker.init_kv_cache(128)
        executor = LocalExecutor(worker)
        specs.append(InstanceSpec(f"c-{i}", config.pools[0], executor, None, worker.info()))
    actor = SchedulerActor(config, specs)
    lacking = {"c-0"}  # the instances whose node lacks the adapter's files
    failing: set[str] = set()  # the instances that fail while the adapter loads there
    tried: list[str] = []
    ensure = actor.lora.ensure

    async def ensure_on_its_node(instance_id: str, request: Any) -> None:
        tried.append(instance_id)
        if instance_id in lacking:
            raise FileNotFoundError(f"{request.lora_path}: no adapter_config.json there")
        await ensure(instance_id, request)
        if instance_id in failing:
            actor.views[instance_id].alive = False

    path = make_adapter(tiny_model, tmp_path / "a", seed=5)

    async def run() -> tuple[list[EngineCoreOutput], BaseException]:
        await actor.start()
        adapter = await actor.load_lora_adapter("a", path)  # (tried on the node that has it)
        actor.lora.ensure = ensure_on_its_node  # type: ignore[method-assign]
        actor.lora.reset("c-0")  # (no copy there: the files are not on its node)
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        outs = []
        for i in range(3):  # wherever the router sends them first
            request = Request(f"r{i}", _prompt(i), params, lora_request=adapter)
            outs += [out async for out in actor.generate(request)]
        assert "c-0" in tried  # (at least once routed there first)
        failing.add("c-1")
        with pytest.raises(UnavailableError, match="kept failing"):
            await actor.submit(Request("r8", _prompt(8), params, lora_request=adapter), "x")
        actor.views["c-1"].alive = True
        failing.clear()
        lacking.add("c-1")
        with pytest.raises(AdapterLoadError) as missing:
            await actor.submit(Request("r9", _prompt(9), params, lora_request=adapter), "x")
        await _idle(actor)
        await actor.shutdown()
        return outs, missing.value

    outs, missing = asyncio.run(asyncio.wait_for(run(), 120))
    finals = [o for o in outs if o.finish_reason is not None]
    assert [o.finish_reason.value for o in finals] == ["length"] * 3  # type: ignore[union-attr]
    assert missing.missing and missing.name == "a"
