"""``ClusterOperations._retire`` of a prefill instance whose drain timed out: decode
instances may still read the KV it sent, so its workers stay for the reads' lease, and the
other instances' transports forget them only after it; drained, or a decode instance, they
stop at once. A shutdown during the lease still stops them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from cluster.control import operations
from cluster.control.handoffs import HandOffs
from cluster.control.operations import ClusterOperations

LEASE_S = 0.3


class Retire(ClusterOperations):
    """The mixin with what ``_retire`` uses of the actor; one in-process engine."""

    def __init__(self, role: str, holds: bool) -> None:
        engine = SimpleNamespace(
            remote=False,
            holds_requests=lambda: holds,
            take_all=lambda: [],
            take_unread_kv=lambda: list(self.unread),
            close=lambda: None,
        )
        self.unread: list[tuple[str, str]] = []  # what the leaving engine held unread

        async def stop() -> None:
            pass

        engine.stop = stop
        self.config: Any = SimpleNamespace(
            disaggregated=True,
            step_timeout_s=None,
            kv_transfer=SimpleNamespace(effective_lease_s=LEASE_S),
        )
        self.engines = {"p-0": engine}
        self.roles = {"p-0": role}
        self.views = {"p-0": SimpleNamespace(alive=True)}
        pool = SimpleNamespace(role=role)
        peers = [SimpleNamespace(agent="agent-p-0")]
        spec = SimpleNamespace(instance_id="p-0", actors=["worker"], pool=pool, kv_peers=peers)
        self.specs = {"p-0": spec, "d-0": SimpleNamespace(instance_id="d-0")}
        self.flights = {}
        self._orphans = {}
        self.hand_offs = HandOffs()
        self._confirm = lambda confirmed: None
        self.observe: Any = SimpleNamespace(remove_instance=lambda iid, role: None)
        self.lora: Any = SimpleNamespace(forget=lambda iid: None)
        self._lingering = {}
        self._last_index = {}
        self.tasks: list[asyncio.Task[None]] = []

    def _spawn(self, coro: Any) -> None:
        self.tasks.append(asyncio.ensure_future(coro))


EVENTS: list[tuple[str, Any]] = []


@pytest.fixture(autouse=True)
def recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ray.kill`` and the KV peers' disconnect only record what they were asked."""
    import ray

    from cluster.control import placement

    async def disconnect(specs: list[Any], names: list[str], timeout_s: float = 0) -> None:
        EVENTS.append(("disconnect", ([s.instance_id for s in specs], names)))

    EVENTS.clear()
    monkeypatch.setattr(placement, "disconnect_kv_peers", disconnect)
    monkeypatch.setattr(ray, "kill", lambda actor: EVENTS.append(("kill", actor)))
    monkeypatch.setattr(operations, "refreeze_heap", lambda: None)


STOPPED = [("kill", "worker"), ("disconnect", (["d-0"], ["agent-p-0"]))]


@pytest.mark.parametrize(
    ("role", "holds", "lease"),
    [("prefill", True, True), ("prefill", False, False), ("decode", True, False)],
)
def test_a_prefill_instance_retired_undrained_keeps_its_workers_for_the_lease(
    role: str, holds: bool, lease: bool
) -> None:
    ops = Retire(role, holds)
    during: list[Any] = []

    async def main() -> None:
        await ops._retire("p-0")
        assert "p-0" in ops._lingering  # (a shutdown kills them from here on)
        await asyncio.sleep(LEASE_S / 3)
        during.extend(EVENTS)
        await asyncio.gather(*ops.tasks)

    asyncio.run(main())
    # Within the lease, neither stopped nor forgotten: a decode instance may still read.
    assert during == ([] if lease else STOPPED)
    assert EVENTS == STOPPED and not ops._lingering
    assert "p-0" not in ops.engines and "p-0" not in ops.specs


def test_a_shutdown_during_the_lease_still_stops_the_workers() -> None:
    ops = Retire("prefill", True)

    async def main() -> None:
        await ops._retire("p-0")
        await asyncio.sleep(LEASE_S / 3)
        for task in ops.tasks:  # as ``SchedulerActor.shutdown`` cancels its tasks
            task.cancel()
        await asyncio.gather(*ops.tasks, return_exceptions=True)

    asyncio.run(main())
    assert EVENTS == [("kill", "worker")] and not ops._lingering


def test_a_shutdown_before_the_stop_task_starts_still_stops_the_workers() -> None:
    """The task that would stop them cancelled before its first step (a shutdown at once):
    its ``finally`` never runs, so ``shutdown`` kills what ``_lingering`` holds."""
    ops = Retire("prefill", True)

    async def main() -> None:
        await ops._retire("p-0")
        for task in ops.tasks:  # (before the loop ran it once)
            task.cancel()
        await asyncio.gather(*ops.tasks, return_exceptions=True)

    asyncio.run(main())
    assert EVENTS == [] and list(ops._lingering) == ["p-0"]
    from cluster.control.scheduler_actor import SchedulerActor

    actor = SchedulerActor.__new__(SchedulerActor)  # what its shutdown reads, nothing held

    async def flush() -> None:
        pass

    actor.views, actor._tasks, actor.engines, actor.flights, actor.specs = {}, set(), {}, {}, {}
    actor.clients = SimpleNamespace(close_all=lambda: None)  # type: ignore[assignment]
    actor.observe = SimpleNamespace(flush=flush)  # type: ignore[assignment]
    actor.config = SimpleNamespace(engine_actors=False)  # type: ignore[assignment]
    actor._lingering = ops._lingering
    asyncio.run(actor.shutdown())
    assert EVENTS == [("kill", "worker")]


class Grow(Retire):
    """``Retire`` with a pool ``p`` that started with ``p-0`` and ``p-1`` (no ``_grow`` gave
    them: ``_last_index`` has no entry for it), and a ``_grow`` whose start only records the
    ids it was asked for."""

    def __init__(self) -> None:
        super().__init__("prefill", False)
        self.pool = SimpleNamespace(name="p", role="prefill")
        for iid in ("p-0", "p-1"):
            self.engines[iid] = self.engines["p-0"]
            self.roles[iid] = "prefill"
            self.views[iid] = SimpleNamespace(alive=True)
            self.specs[iid] = SimpleNamespace(
                instance_id=iid, actors=["worker"], pool=self.pool, kv_peers=[]
            )
        del self.specs["d-0"]
        self.config.startup_timeout_s = 1.0
        self.asked: list[str] = []

        async def start(config: Any, wanted: list[Any], *_: Any) -> list[Any]:
            self.asked.extend(iid for iid, _ in wanted)
            raise RuntimeError("recorded")

        self._start_instances = start

    @property
    def kv_fallback(self) -> str | None:
        return None


def test_a_grown_pool_never_reuses_the_index_of_an_instance_it_retired() -> None:
    """Pool ``p`` started with p-0 and p-1; p-1 leaves; the pool grows again: the new
    instance is p-2, not a second p-1 (whose late reports it would take, and, with engine
    actors, whose detached workers' names it would ask for while they wait for the lease)."""
    ops = Grow()

    async def main() -> None:
        await ops._retire("p-1")
        with pytest.raises(RuntimeError, match="recorded"):
            await ops._grow(ops.pool, 1)
        await asyncio.gather(*ops.tasks)

    asyncio.run(main())
    assert ops.asked == ["p-2"]


def test_a_grow_whose_engines_never_start_leaves_no_kv_peer_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With engine actors, a new instance is refused after ``_connect_kv_peers`` told the
    live workers of its workers (``nixl``: their agents added): its engine actor never
    became ready. Its workers are killed (``_grow``), and the live workers forget their
    agents -- as when the connection itself is refused. They kept them for as long as they
    ran, one more set for each grow the autoscaler asked for again."""
    import ray

    from cluster.control import remote_engine
    from cluster.control.scheduler_actor import SchedulerActor

    class Engine:
        """An engine actor that never serves."""

        def __init__(self, *_: Any) -> None:
            pass

        async def ready(self) -> None:
            raise RuntimeError("the engine did not start")

        def close(self) -> None:
            pass

    monkeypatch.setattr(remote_engine, "RemoteEngine", Engine)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(current_actor=None))
    actor = SchedulerActor.__new__(SchedulerActor)
    config = SimpleNamespace(engine_actors=True, startup_timeout_s=1.0, step_timeout_s=None)
    actor.config = config  # type: ignore[assignment]
    live = SimpleNamespace(instance_id="d-0", kv_peers=[SimpleNamespace(agent="agent-d-0")])
    new = SimpleNamespace(instance_id="d-1", kv_peers=[SimpleNamespace(agent="agent-d-1")])
    actor.specs = {"d-0": live}  # type: ignore[dict-item]
    actor.views = {"d-0": SimpleNamespace(alive=True)}  # type: ignore[dict-item]
    actor.max_model_len = 64
    actor._tasks = set()

    async def connect(specs: list[Any]) -> None:  # (the live workers learnt of d-1's agents)
        pass

    actor._connect_kv_peers = connect  # type: ignore[method-assign]

    async def main() -> None:
        with pytest.raises(RuntimeError, match="did not start"):
            await actor._add_instances([new])  # type: ignore[list-item]
        await asyncio.gather(*actor._tasks)

    asyncio.run(main())
    assert EVENTS == [("disconnect", (["d-0"], ["agent-d-1"]))]


def test_a_decode_instance_retired_undrained_lets_its_sources_go() -> None:
    """A decode instance leaves with hand-offs still queued or loading (its drain timed out,
    or ``drain_timeout_s=0``): their requests move, and the prefill instances that lease
    their KV release it now, not when the lease expires (``kv_leases_expired``)."""
    ops = Retire("decode", True)
    released: list[str] = []
    source = SimpleNamespace(release_kv=released.append)
    ops.engines["src-0"] = source
    ops.unread = [("r@1", "src-0"), ("r@2", "src-0"), ("r@3", "gone")]

    async def main() -> None:
        await ops._retire("p-0")
        await asyncio.gather(*ops.tasks)

    asyncio.run(main())
    assert released == ["r@1", "r@2"]  # (an instance that left meanwhile: nothing to tell)


def test_a_leaving_engine_names_the_hand_offs_it_held_unread() -> None:
    """``InstanceEngine.take_unread_kv`` on a decode engine leaving with a load scheduled, a
    hand-off queued in its scheduler and one not given to it yet: all three sources are named,
    and its blocks are all free."""
    from cluster.control.engine import InstanceEngine
    from cluster.control.engine_loop import EngineLoop
    from kv_transfer.connector import KVSegment, PDConnector
    from tests.scheduler.helpers import assert_all_free, make_request, make_scheduler

    connector = PDConnector("d-0", 4, 5.0)
    scheduler = make_scheduler(block_size=4, num_blocks=8, connector=connector, max_model_len=32)

    def hand_off(rid: str, n: int) -> Any:
        params = {"do_remote_prefill": True, "remote_instance_id": f"p-{rid}"}
        params |= {"remote_num_tokens": n, "handle": [KVSegment(0, 2, "lease", in_place=True)]}
        tokens = list(range(10, 10 + n))
        return make_request(
            tokens, req_id=rid, max_tokens=4, output_token_ids=[1000], kv_transfer_params=params
        )

    scheduler.add_request(hand_off("loading", 12))
    scheduler.add_request(hand_off("queued", 20))
    loads = scheduler.schedule().kv_connector_metadata.loads
    assert [load.req_id for load in loads] == ["loading"]
    loop = EngineLoop("d-0", scheduler, None, lambda *_: None)  # type: ignore[arg-type]
    loop.pending = [hand_off("new", 8)]
    leaving = SimpleNamespace(loop=loop)
    unread = InstanceEngine.take_unread_kv(leaving)  # type: ignore[arg-type]
    assert sorted(unread) == [("loading", "p-loading"), ("new", "p-new"), ("queued", "p-queued")]
    assert_all_free(scheduler)


class Resize(ClusterOperations):
    """``scale_pool`` over pool ``d``: d-0 serves, d-1 failed for good (its worker, whose step
    raised, lives on with its GPU). ``_grow`` notes what had been retired when it ran."""

    def __init__(self) -> None:
        pool = SimpleNamespace(name="d", role="decode")
        self.config: Any = SimpleNamespace(pools=[pool], drain_timeout_s=1.0)
        self.started = True
        self._resizing = asyncio.Lock()
        self._membership = asyncio.Lock()
        self._shrinking: set[str] = set()
        self._start_instances = object()  # (it may start instances)
        ids = ("d-0", "d-1")
        self.specs: Any = {i: SimpleNamespace(pool=pool, actors=["worker"]) for i in ids}
        self.views: Any = {i: SimpleNamespace(alive=i == "d-0", draining=False) for i in ids}
        self.engines: Any = {i: SimpleNamespace(draining=False) for i in ids}
        self.autoscaler: Any = SimpleNamespace(resized=lambda pool: None)
        self.retired: list[str] = []
        self.retired_when_grown: list[str] | None = None

    async def _ready(self) -> None:
        pass

    async def _holds_requests(self, iid: str) -> bool:
        return False

    async def _retire(self, iid: str) -> None:
        self.retired.append(iid)
        del self.specs[iid], self.views[iid], self.engines[iid]

    async def _grow(self, pool: Any, count: int) -> None:
        self.retired_when_grown = list(self.retired)


def test_a_grow_retires_the_dead_instances_before_it_places_new_workers() -> None:
    """Pool d back to 2 instances after d-1 failed: d-1 is retired (its workers stopped)
    before the new instance's workers are placed -- they may need its GPU. Retired after the
    grow, on a full cluster the grow timed out waiting for that GPU and d-1 was never
    retired: the autoscaler asked again and again, each time in vain."""
    ops = Resize()
    result = asyncio.run(ops.scale_pool("d", 2))
    assert ops.retired_when_grown == ["d-1"]
    assert ops.retired == ["d-1"] and result == {"pool": "d", "instances": ["d-0"]}
