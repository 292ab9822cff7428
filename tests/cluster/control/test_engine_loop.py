"""``EngineLoop`` and ``SchedulerActor`` in one process (no Ray): a real ``ModelWorker`` on the
tiny model behind ``LocalExecutor``. Arrivals sent together are admitted together, an idle loop
does not step, a failing worker fails its requests instead of hanging them."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from actors.worker import ModelWorker
from cluster.config import ClusterConfig, InstancePool
from cluster.control.engine_loop import EngineLoop
from cluster.control.executors import LocalExecutor
from cluster.control.placement import InstanceSpec
from cluster.control.scheduler_actor import SchedulerActor
from kv_transfer.connector import KVReadStuck
from scheduler import (
    CacheConfig,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from scheduler.outputs import EngineCoreOutput
from tests.scheduler.helpers import InMemoryConnector

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _worker(model: Path) -> ModelWorker:
    worker = ModelWorker(str(model), block_size=4, progress=False)
    worker.load_model()
    worker.init_kv_cache(128)
    return worker


class RecordingExecutor(LocalExecutor):
    def __init__(
        self,
        worker: Any,
        fail_at_step: int | None = None,
        hang_at_step: int | None = None,
        error: Exception | None = None,
    ) -> None:
        super().__init__(worker)
        self.outputs: list[SchedulerOutput] = []
        self.fail_at_step = fail_at_step
        self.hang_at_step = hang_at_step
        self.error = error or ConnectionError("worker died")

    async def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.outputs.append(scheduler_output)
        if self.fail_at_step is not None and len(self.outputs) > self.fail_at_step:
            raise self.error
        if self.hang_at_step is not None and len(self.outputs) > self.hang_at_step:
            await asyncio.Event().wait()  # never returns
        return await super().execute_model(scheduler_output)


def _loop(
    model: Path, step_timeout_s: float | None = None, **executor_args: Any
) -> tuple[EngineLoop, RecordingExecutor, list[Any]]:
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=256),
        CacheConfig(block_size=4, num_blocks=128),
    )
    executor = RecordingExecutor(_worker(model), **executor_args)
    seen: list[EngineCoreOutput] = []
    loop = EngineLoop(
        "i0",
        scheduler,
        executor,
        lambda _, outs: seen.extend(outs),
        step_timeout_s=step_timeout_s,
    )
    return loop, executor, seen


def _request(i: int) -> Request:
    return Request(f"r{i}", [3 + i, 4, 5, 6 + i], GREEDY, eos_token_id=2)


async def _start_and_finish(loop: EngineLoop, seen: list[EngineCoreOutput], n: int) -> None:
    """Start ``loop``, add requests r0 .. r<n-1> at once and wait for each one's last output."""
    loop.start()
    for i in range(n):
        loop.add_request(_request(i))
    while sum(o.finished for o in seen) < n:
        await asyncio.sleep(0.01)


def test_requests_sent_together_are_admitted_together(tiny_model: Path) -> None:
    loop, executor, seen = _loop(tiny_model)

    async def run() -> None:
        await _start_and_finish(loop, seen, 16)  # one burst, as 16 generate() calls at once
        await loop.stop()

    asyncio.run(run())
    assert len(executor.outputs[0].scheduled_new_reqs) == 16
    assert loop.scheduler.kv_cache_manager.usage == 0.0 and not loop.scheduler.requests


def test_idle_loop_does_not_step(tiny_model: Path) -> None:
    """Once idle, no steps -- after one that tells the workers of the last ends (they held
    the finished requests' state until the next arrival, for good on a drained instance)."""
    loop, executor, seen = _loop(tiny_model)

    async def run() -> int:
        loop.start()
        loop.add_request(_request(0))
        while not any(o.finished for o in seen):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert executor.worker.health()["num_requests"] == 0
        steps = loop.counters.num_steps
        await asyncio.sleep(0.3)  # idle: waits on its event, no steps
        idle_steps = loop.counters.num_steps - steps
        loop.add_request(_request(1))  # and wakes up for the next arrival
        while sum(o.finished for o in seen) < 2:
            await asyncio.sleep(0.01)
        await loop.stop()
        return idle_steps

    assert asyncio.run(run()) == 0
    assert len(executor.outputs) == loop.counters.num_steps


def test_failing_worker_fails_its_requests(tiny_model: Path) -> None:
    loop, _, seen = _loop(tiny_model, fail_at_step=2)

    asyncio.run(asyncio.wait_for(_start_and_finish(loop, seen, 3), 30))
    finals = [o for o in seen if o.finished]
    assert {o.request_id for o in finals} == {"r0", "r1", "r2"}
    assert all(o.error and "worker died" in o.error for o in finals)
    assert not loop.alive and loop.error is not None


def test_a_worker_lost_to_ray_fails_its_requests_naming_none_of_rays_internals(
    tiny_model: Path,
) -> None:
    """What a failed step ends its requests with reaches their clients (the 503 of a request
    that could not move: a one-instance pool, say). Ray's errors name the worker actor's id,
    process id and node address, a task's its traceback's files: the log has them; the
    requests get the kind of failure (a task's: its own exception, as the worker raised it)."""
    import ray.exceptions

    died = ray.exceptions.RayActorError(
        None,
        "The actor died unexpectedly before finishing this task.\n\tclass_name: ModelWorker"
        "\n\tactor_id: 5f3c\n\tpid: 4242\n\tnamespace: tandem\n\tip: 10.1.2.3",
    )
    raised = ray.exceptions.RayTaskError(
        "execute_model",
        'Traceback (most recent call last):\n  File "/srv/tandem/actors/worker.py", line 340, '
        "in execute_model\nRuntimeError: CUDA out of memory",
        RuntimeError("CUDA out of memory"),
        proctitle="ray::ModelWorker.execute_model",
        pid=4242,
        ip="10.1.2.3",
    ).as_instanceof_cause()
    for error, kind in ((died, "RayActorError"), (raised, "RuntimeError: CUDA out of memory")):
        loop, _, seen = _loop(tiny_model, fail_at_step=1, error=error)
        asyncio.run(asyncio.wait_for(_start_and_finish(loop, seen, 2), 30))
        finals = [o for o in seen if o.finished]
        assert len(finals) == 2 and all(o.error and kind in o.error for o in finals), finals
        for text in (str(o.error) for o in finals):
            assert "10.1.2.3" not in text and "4242" not in text, text
            assert "worker.py" not in text and "5f3c" not in text, text


@pytest.mark.parametrize("wrapped", [False, True], ids=["in-process", "through-ray"])
def test_a_stuck_kv_read_ends_the_worker_as_a_hung_step_does(
    tiny_model: Path, wrapped: bool
) -> None:
    """A worker whose KV read may still write into its cache (``KVReadStuck``) fails the
    instance, marked ``hung``: its owner ends the worker's process (recovery, then, as for a
    hung step), so no late write can land in blocks given to other requests. Another
    failure is not marked."""
    import ray.exceptions

    stuck: Exception = KVReadStuck("the KV read of r still runs")
    if wrapped:  # as a Ray actor's error reaches the engine
        stuck = ray.exceptions.RayTaskError("execute_model", "", stuck).as_instanceof_cause()
    for error, hung in ((stuck, True), (ConnectionError("worker died"), False)):
        loop, _, seen = _loop(tiny_model, fail_at_step=1, error=error)
        asyncio.run(asyncio.wait_for(_start_and_finish(loop, seen, 2), 30))
        assert not loop.alive and loop.hung == hung
        assert loop.scheduler.kv_cache_manager.usage == 0.0


def test_a_step_that_never_returns_fails_the_instance_after_the_timeout(
    tiny_model: Path,
) -> None:
    loop, executor, seen = _loop(tiny_model, step_timeout_s=0.3, hang_at_step=2)
    moved: list[tuple[list[str], str]] = []
    loop.on_failure = lambda _, ids, reason: moved.append((sorted(ids), reason))

    async def run() -> float:
        loop.start()
        for i in range(3):
            loop.add_request(_request(i))
        while len(executor.outputs) < 3:  # the third step hangs
            await asyncio.sleep(0.005)
        hung_at = asyncio.get_running_loop().time()
        while not moved:
            await asyncio.sleep(0.01)
        return asyncio.get_running_loop().time() - hung_at

    waited = asyncio.run(asyncio.wait_for(run(), 30))
    assert 0.2 <= waited < 10  # about step_timeout_s, not forever
    [(ids, reason)] = moved
    assert ids == ["r0", "r1", "r2"]  # every unfinished request goes to be moved
    assert "has not returned in 0.3 s" in reason
    assert loop.hung and not loop.alive
    assert not [o for o in seen if o.finished]  # none was failed: they move instead
    assert loop.scheduler.kv_cache_manager.block_pool.num_free_blocks == 128


def test_scheduler_actor_in_process(tiny_model: Path) -> None:
    """The actor's logic without Ray: a colocated instance, streaming, abort, duplicate ids,
    bad requests refused before the first output."""
    config = ClusterConfig(
        model=str(tiny_model), block_size=4, pools=[InstancePool(name="c", num_blocks=128)]
    )
    worker = _worker(tiny_model)
    spec = InstanceSpec("c-0", config.pools[0], LocalExecutor(worker), None, worker.info())
    actor = SchedulerActor(config, [spec])

    async def run() -> None:
        await actor.start()
        outs = [o async for o in actor.generate(_request(0))]
        assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 6
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in actor.generate(Request("long", [5] * 600, GREEDY)):
                pass
        long_run = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        stream = actor.generate(Request("a", [5, 6, 7], long_run))
        first = await stream.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await actor.generate(Request("a", [5], GREEDY)).__anext__()
        assert actor.abort("a") and not actor.abort("a")
        reused = [o async for o in actor.generate(Request("a", [5, 6], GREEDY))]
        assert reused[-1].finish_reason is not None and reused[-1].finish_reason.value == "length"
        rest = [o async for o in stream]
        assert rest[-1].finish_reason is not None and rest[-1].finish_reason.value == "abort"
        assert not first.finished
        await asyncio.sleep(0.05)  # the loop frees the aborted request's blocks
        stats = (await actor.stats())["instances"]["c-0"]
        assert stats["num_requests"] == 0 and stats["kv_cache_usage"] == 0.0
        await actor.check_integrity()
        await actor.shutdown()

    asyncio.run(run())


def test_a_bug_in_scheduling_fails_requests_instead_of_stranding_them(tiny_model: Path) -> None:
    loop, _, seen = _loop(tiny_model)
    real = loop.scheduler.update_from_output
    calls = []

    def broken(*args: Any) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("a scheduler bug")
        return real(*args)

    loop.scheduler.update_from_output = broken  # type: ignore[method-assign]

    async def run() -> None:
        await _start_and_finish(loop, seen, 2)
        loop.add_request(_request(5))  # a dead loop answers at once

    asyncio.run(asyncio.wait_for(run(), 30))
    finals = {o.request_id: o for o in seen if o.finished}
    assert set(finals) == {"r0", "r1", "r5"}
    assert all(o.error and "KeyError" in o.error for o in finals.values())
    assert not loop.alive
    assert not loop.scheduler.requests and loop.scheduler.kv_cache_manager.usage == 0.0


def test_a_hand_off_aborted_before_its_admission_lets_its_source_go(tiny_model: Path) -> None:
    """A decode request aborted while it still waits to be admitted (``pending``): its
    source's in-place lease is reported unread, so the source frees the prompt's blocks now
    rather than when the lease runs out."""
    from kv_transfer.connector import KVSegment, PDConnector

    connector = PDConnector("d-0", block_size=4, timeout_s=5.0)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
        CacheConfig(block_size=4, num_blocks=128),
        connector=connector,
    )
    loop = EngineLoop("d-0", scheduler, RecordingExecutor(_worker(tiny_model)), lambda *_: None)
    handle = [KVSegment(0, 2, "lease", in_place=True)]
    params = {"do_remote_prefill": True, "remote_num_tokens": 4, "remote_instance_id": "p-0"}
    request = Request("h", [3, 4, 5, 6], GREEDY, eos_token_id=2)
    request.kv_transfer_params = {**params, "handle": handle}
    loop.add_request(request)  # (the loop is not started: it stays pending)
    loop.add_request(_request(0))
    loop.abort(["h", "r0"])
    assert connector.take_unread() == [("h", "p-0")]  # the plain request had no source
    assert not loop.pending


def test_a_request_the_scheduler_refuses_ends_as_the_clients_fault(tiny_model: Path) -> None:
    """A prompt the instance's scheduler can never serve (here: past its max_model_len, which
    the ingress checks first unless its view differs) ends with an error marked as a
    rejection, which the API answers with a 400, not the 503 of a failure of the cluster."""
    from cluster.errors import is_rejection
    from cluster.serving.errors import generation_error

    loop, _, seen = _loop(tiny_model)

    async def run() -> None:
        loop.start()
        loop.add_request(Request("long", list(range(3, 300)), GREEDY, eos_token_id=2))
        loop.add_request(_request(0))
        # The cluster's own mistake, not the client's: a moved request already complete.
        done = [7] * GREEDY.max_tokens
        loop.add_request(Request("moved", [3, 4, 5], GREEDY, eos_token_id=2, output_token_ids=done))
        while sum(o.finished for o in seen) < 3:
            await asyncio.sleep(0.01)
        await loop.stop()

    asyncio.run(asyncio.wait_for(run(), 30))
    [refused] = [o for o in seen if o.request_id == "long"]
    assert refused.finish_reason is not None and refused.finish_reason.value == "error"
    assert is_rejection(refused.error) and "max_model_len is 256" in str(refused.error)
    error = generation_error(refused.error)
    assert error.status == 400 and "max_model_len" in error.message
    [moved] = [o for o in seen if o.request_id == "moved"]
    assert moved.error and not is_rejection(moved.error)
    assert generation_error(moved.error).status == 503
    [served] = [o for o in seen if o.request_id == "r0" and o.finished]
    assert served.error is None  # the other request of the same burst runs
    assert generation_error("worker died").status == 503  # a failure of the cluster
    assert generation_error(None).status == 503


def test_hand_offs_a_failed_loop_never_admitted_are_reported_unread(tiny_model: Path) -> None:
    """A decode instance fails with a hand-off still pending (sent, not admitted), and
    another arrives after the failure: both are reported unread, so their sources release
    the leased KV at once rather than at the lease's expiry."""
    from kv_transfer.connector import KVSegment, PDConnector

    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256),
        CacheConfig(block_size=4, num_blocks=64),
        connector=PDConnector("d-0", 4, 5.0),
    )
    loop = EngineLoop("d-0", scheduler, RecordingExecutor(_worker(tiny_model)), lambda *_: None)

    def hand_off(rid: str) -> Request:
        params = {
            "do_remote_prefill": True,
            "remote_instance_id": "p-0",
            "remote_num_tokens": 8,
            "handle": [KVSegment(0, 2, object(), in_place=True)],
        }
        return Request(rid, list(range(3, 11)), GREEDY, eos_token_id=2, kv_transfer_params=params)

    connector = scheduler.connector
    assert isinstance(connector, PDConnector)
    loop.add_request(hand_off("pending"))  # not admitted: the loop never ran
    loop.fail("worker died")
    loop.add_request(hand_off("late"))  # after the failure
    assert sorted(connector.take_unread()) == [("late", "p-0"), ("pending", "p-0")]


def _decode_loop(max_model_len: int) -> tuple[EngineLoop, Any, list[EngineCoreOutput], dict]:
    """A decode instance's loop (never stepped: no model) with a connector, the outputs it
    emits, and the kv_transfer_params of a 20-token hand-off read in place from p-0."""
    from kv_transfer.connector import KVSegment, PDConnector

    connector = PDConnector("d-0", 4, 5.0)
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=max_model_len),
        CacheConfig(block_size=4, num_blocks=64),
        connector=connector,
    )
    seen: list[EngineCoreOutput] = []
    executor: Any = None  # (never stepped)
    loop = EngineLoop("d-0", scheduler, executor, lambda _, outs: seen.extend(outs))
    params = {
        "do_remote_prefill": True,
        "remote_instance_id": "p-0",
        "remote_num_tokens": 20,
        "handle": [KVSegment(0, 2, object(), in_place=True)],
    }
    return loop, connector, seen, params


def test_a_hand_off_the_scheduler_refuses_lets_its_source_go() -> None:
    """A hand-off the decode scheduler refuses at admission (here: past its max_model_len)
    ends with an error and never loads: its source's in-place lease is reported unread, so
    the source frees the prompt's blocks now rather than when the lease runs out."""
    loop, connector, seen, params = _decode_loop(max_model_len=16)
    prompt = list(range(3, 23))
    loop.add_request(Request("long", prompt, GREEDY, eos_token_id=2, kv_transfer_params=params))
    loop._admit_pending()
    [refused] = seen
    assert refused.request_id == "long" and refused.error
    assert connector.take_unread() == [("long", "p-0")]


def test_a_second_copy_of_a_hand_off_refused_keeps_its_sources_kv() -> None:
    """A hand-off that arrives again under an id the decode scheduler holds is refused ("in
    use"), but the copy admitted under that id reads the same handle: reported unread, its
    source freed the prompt's blocks under that read."""
    loop, connector, seen, params = _decode_loop(max_model_len=64)
    scheduler = loop.scheduler
    prompt = list(range(3, 23))
    loop.add_request(Request("h", prompt, GREEDY, eos_token_id=2, kv_transfer_params=params))
    loop._admit_pending()
    assert not seen and "h" in scheduler.requests
    again = Request("h", prompt, GREEDY, eos_token_id=2, kv_transfer_params=dict(params))
    loop.add_request(again)
    loop._admit_pending()
    [refused] = seen
    assert refused.request_id == "h" and "already in use" in (refused.error or "")
    assert connector.take_unread() == []  # the admitted copy's source keeps its blocks


def test_requests_loading_their_kv_count_as_waiting(tiny_model: Path) -> None:
    """vLLM's num_requests_waiting counts the requests in WAITING_FOR_REMOTE_KVS (Tandem's
    ``holding``): a decode instance busy loading KV read as idle to a gateway."""
    loop, _, _ = _loop(tiny_model)
    request = _request(0)
    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    request.awaiting_remote_kvs = True
    loop.scheduler.state.holding.append(request)  # (as the connector's admission leaves it)
    loop.add_request(_request(1))
    stats = loop.stats()
    assert stats["num_waiting"] == 2 and stats["num_waiting_for_remote_kvs"] == 1


def test_async_last_decode_capped_by_max_model_len_overlaps_no_empty_step() -> None:
    """Async scheduling: once the decode that reaches max_model_len is in flight, nothing of
    a request whose max_tokens reaches further is left to compute; the loop must not start
    a second step beside it (it sent the workers an empty one)."""
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16, async_scheduling=True
        ),
        CacheConfig(block_size=4, num_blocks=16),
    )
    executor: Any = None  # (never stepped)
    loop = EngineLoop("i0", scheduler, executor, lambda _, outs: None, max_in_flight=2)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    scheduler.add_request(Request("r", list(range(3, 17)), params, eos_token_id=2))  # 14
    prompt_step = scheduler.schedule()  # samples output 1 (token 15)
    assert prompt_step.total_num_scheduled_tokens == 14
    assert loop._can_overlap()
    last = scheduler.schedule()  # samples output 2 (token 16 = max_model_len)
    assert last.total_num_scheduled_tokens == 1
    scheduler.update_from_output(
        prompt_step, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[7]])
    )
    assert not loop._can_overlap()
    assert scheduler.schedule().total_num_scheduled_tokens == 0  # what it would have sent


class _InstantExecutor:
    """A worker that answers every step at once, each scheduled request sampling token 7
    (the prompts fit the budget: no partial prefill); counts the steps that computed
    nothing."""

    def __init__(self) -> None:
        self.num_empty_steps = 0

    async def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.total_num_scheduled_tokens == 0:
            self.num_empty_steps += 1
        req_ids = list(scheduler_output.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[7] for _ in req_ids])


def test_empty_steps_beside_an_empty_step_in_flight_are_idle() -> None:
    """Async scheduling, a waiting request that can never be admitted (a finished prefill
    request keeps its blocks for a send), nothing left to run: the loop must pause between
    its empty steps. Once an empty step had been started beside the last decode, one empty
    step was always in flight, so no result counted as idle and the workers were stepped
    back to back for as long as the request waited."""
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, async_scheduling=True
        ),
        CacheConfig(block_size=4, num_blocks=8),
        connector=InMemoryConnector(),
    )
    executor = _InstantExecutor()
    loop = EngineLoop(
        "i0", scheduler, executor, lambda _, outs: None, max_in_flight=2, admission_window_s=0
    )
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    # 21 tokens in 6 blocks, held after its end (delay_free: no finished_sending comes).
    prefill_side = {"do_remote_decode": True}
    sender = Request(
        "p", list(range(100, 120)), params, eos_token_id=2, kv_transfer_params=prefill_side
    )
    waiting = Request("w", list(range(200, 216)), params, eos_token_id=2)  # needs 4 blocks

    async def run() -> None:
        loop.start()
        loop.add_request(sender)
        loop.add_request(waiting)
        await asyncio.sleep(0.3)
        await loop.stop()

    asyncio.run(run())
    assert sender.is_finished and waiting.status == RequestStatus.WAITING
    assert executor.num_empty_steps > 0
    # Every empty step is an idle one (the last may still have been in flight), each
    # followed by idle_sleep_s (none was: back to back, thousands in 0.3 s).
    assert loop.counters.num_idle_steps >= executor.num_empty_steps - 2


class _OneAtATimeExecutor:
    """A worker that runs the steps it is given one after another (as a Ray actor runs one
    caller's calls), each computing for ``step_s``; every scheduled request samples token 7
    (the prompt fits the budget: no partial prefill)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self._worker = asyncio.Lock()

    async def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        async with self._worker:
            if scheduler_output.total_num_scheduled_tokens:
                await asyncio.sleep(self.step_s)
        req_ids = list(scheduler_output.num_scheduled_tokens)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[7] for _ in req_ids])


def test_a_step_queued_behind_another_is_timed_from_when_that_one_returned() -> None:
    """Async scheduling starts step N+1 while step N runs; the worker runs N+1 after N. Each
    step takes 0.4 s, within the 0.65 s step timeout, yet step N+1 (0.8 s after its start,
    half of it queued behind N) failed the instance as hung: its workers would be killed
    and its requests moved."""
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, async_scheduling=True
        ),
        CacheConfig(block_size=4, num_blocks=16),
    )
    seen: list[EngineCoreOutput] = []
    loop = EngineLoop(
        "i0",
        scheduler,
        _OneAtATimeExecutor(0.4),
        lambda _, outs: seen.extend(outs),
        max_in_flight=2,
        admission_window_s=0,
        step_timeout_s=0.65,
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        loop.start()
        loop.add_request(Request("r", [3, 4, 5, 6], params, eos_token_id=2))
        while not any(o.finished for o in seen):
            await asyncio.sleep(0.01)
        await loop.stop()

    asyncio.run(asyncio.wait_for(run(), 30))
    assert loop.error is None and not loop.hung
    assert [t for o in seen for t in o.new_token_ids] == [7, 7, 7, 7]
    assert loop.counters.max_in_flight == 2
