"""The start-up heap is frozen out of the cyclic collector in an actor's process, and a
change of the cluster's shape (an instance left, one was rebuilt) lets the collector reclaim
the cycles that died since -- a dropped block pool is one (its free list is doubly linked).
The same processes collect young objects every ``THRESHOLDS[0]`` allocations, not 700."""

from __future__ import annotations

import pytest

from tests.cluster.conftest import RayCluster

ray = pytest.importorskip("ray")


class _Node:
    other: _Node | None = None


def _probe() -> tuple[bool, bool, bool, bool]:
    import gc
    import weakref

    from cluster.control.heap import THRESHOLDS, freeze_heap, refreeze_heap

    default = gc.get_threshold()
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle, alive at start-up
    ref = weakref.ref(a)
    freeze_heap()
    frozen = gc.get_freeze_count() > 0
    relaxed = default[0] < THRESHOLDS[0] and gc.get_threshold() == THRESHOLDS
    del a, b
    gc.collect()
    kept_while_frozen = ref() is not None  # frozen: the collector does not see it
    refreeze_heap()
    return frozen, relaxed, kept_while_frozen, ref() is None


def test_refreeze_reclaims_cycles_that_died_while_frozen(ray_cluster: RayCluster) -> None:
    @ray.remote(num_cpus=0)
    class Probe:
        def run(self) -> tuple[bool, bool, bool, bool]:
            return _probe()

    probe = Probe.remote()  # type: ignore[attr-defined]
    try:
        assert ray.get(probe.run.remote()) == (True, True, True, True)
    finally:
        ray.kill(probe)


def test_outside_an_actor_the_heap_is_left_alone() -> None:
    import gc

    from cluster.control.heap import freeze_heap

    before, thresholds = gc.get_freeze_count(), gc.get_threshold()
    freeze_heap()  # a test process, a program embedding the SchedulerActor
    assert gc.get_freeze_count() == before
    assert gc.get_threshold() == thresholds


def test_relaxing_never_lowers_a_threshold_nor_wakes_a_disabled_collector() -> None:
    import gc

    from cluster.control.heap import THRESHOLDS, relax_collector

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 100, 5)
        relax_collector()
        assert gc.get_threshold() == (THRESHOLDS[0], 100, THRESHOLDS[2])
        gc.set_threshold(0, 10, 10)
        relax_collector()
        assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)
