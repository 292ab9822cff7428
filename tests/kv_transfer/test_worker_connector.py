"""``WorkerConnector``'s save/load pipeline through an in-memory transport: saved blocks land
bit for bit in other block ids, failures and timeouts are reported once and never write, and an
idle step waits a little (not forever) for a fetch in flight."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from kv_transfer.base import WorkerConnector
from kv_transfer.blocks import KVPayload, allocate_kv_caches
from kv_transfer.connector import KVConnectorMetadata, LoadSpec, SaveSpec

NUM_LAYERS, BLOCK, KV_HEADS, HEAD_DIM = 2, 4, 2, 8


class MemoryConnector(WorkerConnector):
    """Handles are keys of a dict shared by the connectors of one test. ``_fetch`` can be told
    to raise, or to hold until ``release`` is set (at most ``hold_s``)."""

    transport = "memory"

    def __init__(self, store: dict[str, KVPayload]) -> None:
        super().__init__()
        self.store = store
        self.raise_on_fetch = False
        self.hold_s = 0.0
        self.release = threading.Event()
        self.fetch_done = threading.Event()  # set when a fetch returns or raises
        self._ids = itertools.count()

    def _save(self, req_id: str, data: KVPayload) -> Any:
        handle = f"{req_id}#{next(self._ids)}"
        self.store[handle] = data.copy()  # the pieces are views of the cache
        return handle

    def _fetch(self, handle: Any, layers: range, timeout_s: float) -> KVPayload:
        try:
            if self.hold_s:
                self.release.wait(self.hold_s)
            if self.raise_on_fetch:
                raise ConnectionError("the source is gone")
            return self.store[handle]
        finally:
            self.fetch_done.set()


def _caches(num_blocks: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Random caches in the workers' layout (views of one block-first buffer)."""
    gen = torch.Generator().manual_seed(seed)
    caches = allocate_kv_caches(NUM_LAYERS, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return caches


def _bytes_per_block(dtype: torch.dtype) -> int:
    itemsize = torch.tensor([], dtype=dtype).element_size()
    return NUM_LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * itemsize


@pytest.fixture
def pair() -> Iterator[tuple[MemoryConnector, MemoryConnector]]:
    """A prefill-side and a decode-side connector on one store, float32 caches."""
    store: dict[str, KVPayload] = {}
    src, dst = MemoryConnector(store), MemoryConnector(store)
    src.register_kv_caches(_caches(8, torch.float32, 0), range(NUM_LAYERS))
    dst.register_kv_caches(_caches(12, torch.float32, 1), range(NUM_LAYERS))
    yield src, dst
    for c in (src, dst):
        c.release.set()
        c.close()


SRC_TABLE = [5, 1, 7, 2]  # the saved request's block table; 10 tokens fill its first three


def _save(src: WorkerConnector, num_tokens: int = 10) -> Any:
    src.wait_for_save(
        KVConnectorMetadata(saves=[SaveSpec("r", num_tokens)]), {"r": SRC_TABLE, "x": [0]}
    )
    report = src.report()
    assert set(report.saved) == {"r"}
    return report.saved["r"]


Saved = tuple[MemoryConnector, MemoryConnector, Any]


@pytest.fixture
def saved(pair: tuple[MemoryConnector, MemoryConnector]) -> Saved:
    """``pair`` once the source has saved request "r" (10 tokens: three blocks), and the
    handle of that save."""
    src, dst = pair
    return src, dst, _save(src)


def _load(dst: WorkerConnector, spec: LoadSpec, max_calls: int = 100) -> int:
    """Start ``spec``'s load, then step idle until it is reported; returns the calls made."""
    dst.start_load_kv(KVConnectorMetadata(loads=[spec]))
    calls = 1
    while dst.num_loading() and calls < max_calls:
        dst.start_load_kv(None, idle=True)
        calls += 1
    assert dst.num_loading() == 0, "the load never ended"
    return calls


def _snapshot(c: WorkerConnector) -> list[torch.Tensor]:
    return [t.clone() for t in c.kv_caches]


def _unchanged(c: WorkerConnector, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(c.kv_caches, before, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_blocks_load_bit_for_bit_into_other_block_ids(dtype: torch.dtype) -> None:
    store: dict[str, KVPayload] = {}
    src, dst = MemoryConnector(store), MemoryConnector(store)
    try:
        src.register_kv_caches(_caches(8, dtype, 0), range(NUM_LAYERS))
        dst.register_kv_caches(_caches(12, dtype, 1), range(NUM_LAYERS))
        src.wait_for_save(
            KVConnectorMetadata(saves=[SaveSpec("r", 10), SaveSpec("gone", 4)]), {"r": SRC_TABLE}
        )
        report = src.report()
        assert set(report.saved) == {"r"}  # "gone" has no block table: finished meanwhile
        assert report.bytes_saved == 3 * _bytes_per_block(dtype)
        assert src.report().saved == {}  # reported once
        before = _snapshot(dst)
        dst_ids = [11, 0, 6]
        _load(dst, LoadSpec("r", report.saved["r"], dst_ids, 0, timeout_s=5.0))
        assert dst.get_finished() == (None, {"r"}, None)
        assert dst.get_finished() == (None, None, None)  # exactly once
        others = [b for b in range(12) if b not in dst_ids]
        for layer in range(NUM_LAYERS):
            got, want = dst.kv_caches[layer], src.kv_caches[layer]
            for s, d in zip(SRC_TABLE[:3], dst_ids, strict=True):
                # Compare bit patterns: bit for bit, not merely equal values.
                assert torch.equal(got[:, d].view(torch.int16), want[:, s].view(torch.int16))
            assert torch.equal(got[:, others], before[layer][:, others])
        assert dst.report().bytes_loaded == 3 * _bytes_per_block(dtype)
    finally:
        src.close()
        dst.close()


def test_first_block_copies_only_the_tail(saved: Saved) -> None:
    src, dst, handle = saved
    before = _snapshot(dst)
    _load(dst, LoadSpec("r", handle, [9], first_block=2, timeout_s=5.0))
    assert dst.get_finished() == (None, {"r"}, None)
    for layer in range(NUM_LAYERS):
        assert torch.equal(dst.kv_caches[layer][:, 9], src.kv_caches[layer][:, SRC_TABLE[2]])
        others = [b for b in range(12) if b != 9]
        assert torch.equal(dst.kv_caches[layer][:, others], before[layer][:, others])
    (record,) = dst.history
    assert record.req_id == "r" and record.ok
    assert record.num_bytes == _bytes_per_block(torch.float32)


def test_fetch_that_raises_is_reported_failed_and_writes_nothing(saved: Saved) -> None:
    _, dst, handle = saved
    dst.raise_on_fetch = True
    before = _snapshot(dst)
    _load(dst, LoadSpec("r", handle, [0, 1, 2], 0, timeout_s=5.0))
    assert dst.get_finished() == (None, None, {"r"})
    assert dst.get_finished() == (None, None, None)
    assert _unchanged(dst, before)
    (record,) = dst.history
    assert record.req_id == "r" and not record.ok and record.num_bytes == 0
    assert dst.report().bytes_loaded == 0


def test_new_caches_drop_load_outcomes_not_yet_reported(saved: Saved) -> None:
    """A stage's load landed in the step that failed (its report never went out); the
    recovery gives it new caches and a fresh scheduler, which may wait for "r" again (placed
    anew). The old outcome must not reach it: "r" would be promoted before its new load
    wrote a byte."""
    _, dst, handle = saved
    _load(dst, LoadSpec("r", handle, [0, 1, 2], 0, timeout_s=5.0))
    dst.raise_on_fetch = True
    _load(dst, LoadSpec("q", handle, [3, 4, 5], 0, timeout_s=5.0))
    dst.register_kv_caches(_caches(12, torch.float32, 2), range(NUM_LAYERS))
    assert dst.get_finished() == (None, None, None)


def test_new_caches_drop_the_step_report_not_yet_taken(saved: Saved) -> None:
    """A step whose forward raised after its loads had landed (and a save had been made)
    never returned its ``report()``; the recovery resets this surviving worker's cache for a
    fresh scheduler. That scheduler's first report must not carry the old step's loads,
    bytes or saves: they were counted again in the KV metrics (a failed one as a recompute)
    and, in a pipeline instance, left a merger entry that never completes."""
    src, dst, handle = saved
    _load(dst, LoadSpec("r", handle, [0, 1, 2], 0, timeout_s=5.0))
    src.wait_for_save(KVConnectorMetadata(saves=[SaveSpec("q", 10)]), {"q": SRC_TABLE})
    for connector, seed in ((dst, 2), (src, 3)):
        connector.register_kv_caches(_caches(12, torch.float32, seed), range(NUM_LAYERS))
        report = connector.report()
        assert report.loads == [] and report.saved == {}
        assert report.bytes_loaded == 0 and report.bytes_saved == 0


@pytest.mark.parametrize("slow", ["transport", "load_delay_s"])
def test_fetch_past_the_timeout_fails_and_its_late_data_is_never_written(
    saved: Saved, slow: str
) -> None:
    _, dst, handle = saved
    if slow == "transport":
        dst.hold_s = 0.3
    else:
        dst.load_delay_s = 0.3
    before = _snapshot(dst)
    _load(dst, LoadSpec("r", handle, [0, 1, 2], 0, timeout_s=0.05))
    # Given up at the deadline, while the fetch was still running.
    assert not dst.fetch_done.is_set()
    assert dst.get_finished() == (None, None, {"r"})
    assert dst.fetch_done.wait(2.0)
    time.sleep(0.01)  # let the pool thread hand the result to its future
    dst.start_load_kv(None, idle=True)
    dst.start_load_kv(None)
    assert dst.get_finished() == (None, None, None)
    assert _unchanged(dst, before)  # the blocks may belong to someone else by now
    assert dst.report().bytes_loaded == 0
    assert all(not record.ok for record in dst.history)


def test_a_load_queued_for_a_thread_pulls_within_what_is_left_of_its_deadline() -> None:
    """Loads beyond ``max_parallel_loads`` wait for a thread: the deadline counts from the
    start of the load, so one whose deadline passed while it queued (reported failed)
    does not pull at all, and one that starts late pulls only for what is left (it pulled
    for its whole timeout, holding a thread and the source's lease past its failure)."""
    store: dict[str, KVPayload] = {}
    src = MemoryConnector(store)
    src.register_kv_caches(_caches(8, torch.float32, 0), range(NUM_LAYERS))
    handle = _save(src)
    timeouts: list[float] = []

    class Recording(MemoryConnector):
        def _fetch(self, handle: Any, layers: range, timeout_s: float) -> KVPayload:
            timeouts.append(timeout_s)
            self.hold_s = 0.3 if len(timeouts) == 1 else 0.0  # the first holds the thread
            return super()._fetch(handle, layers, timeout_s)

    dst = Recording(store)
    dst._pool.shutdown()
    dst._pool = ThreadPoolExecutor(1)
    dst.register_kv_caches(_caches(12, torch.float32, 1), range(NUM_LAYERS))
    try:
        dst.start_load_kv(
            KVConnectorMetadata(
                loads=[
                    LoadSpec("first", handle, [0, 1, 2], 0, timeout_s=1.0),
                    LoadSpec("late", handle, [3, 4, 5], 0, timeout_s=0.1),
                    LoadSpec("later", handle, [6, 7, 8], 0, timeout_s=0.6),
                ]
            )
        )
        while dst.num_loading():
            dst.start_load_kv(None, idle=True)
        assert dst.get_finished()[1:] == ({"first", "later"}, {"late"})
        assert dst.fetch_done.wait(1.0)
        assert len(timeouts) == 2  # "late" never pulled
        assert timeouts[0] == pytest.approx(1.0, abs=0.05)
        assert timeouts[1] < 0.6 - 0.25  # "later" started after "first" held 0.3 s
    finally:
        dst.release.set()
        for c in (src, dst):
            c.close()


def test_timed_out_load_is_recorded_as_failed_in_history(saved: Saved) -> None:
    _, dst, handle = saved
    dst.hold_s = 1.0
    _load(dst, LoadSpec("r", handle, [0, 1, 2], 0, timeout_s=0.02))
    assert dst.get_finished() == (None, None, {"r"})
    # Every finished load leaves a record, as a fetch that raised does: a benchmark that
    # trips the deadline (set_fault_injection) must see its failures in transfer_history.
    assert [(record.req_id, record.ok, record.num_bytes) for record in dst.history] == [
        ("r", False, 0)
    ]


def test_source_with_fewer_blocks_than_asked_fails_and_writes_nothing(
    pair: tuple[MemoryConnector, MemoryConnector],
) -> None:
    src, dst = pair
    handle = _save(src, num_tokens=6)  # two blocks saved
    before = _snapshot(dst)
    _load(dst, LoadSpec("r", handle, [3, 4], first_block=1, timeout_s=5.0))  # blocks 1 and 2
    assert dst.get_finished() == (None, None, {"r"})
    assert _unchanged(dst, before)
    (record,) = dst.history
    assert not record.ok and record.num_bytes == 0


def test_idle_step_waits_for_a_fetch_about_to_finish(saved: Saved) -> None:
    _, dst, handle = saved
    dst.hold_s = 0.02
    dst.start_load_kv(KVConnectorMetadata(loads=[LoadSpec("r", handle, [0, 1, 2], 0, 5.0)]), True)
    assert dst.num_loading() == 0
    assert dst.get_finished() == (None, {"r"}, None)


def test_idle_step_does_not_wait_for_a_slow_fetch(saved: Saved) -> None:
    _, dst, handle = saved
    dst.hold_s = 5.0
    before = _snapshot(dst)
    spec = LoadSpec("r", handle, [0, 1, 2], 0, timeout_s=5.0)
    start = time.monotonic()
    dst.start_load_kv(KVConnectorMetadata(loads=[spec]), idle=True)
    dst.start_load_kv(None, idle=True)
    elapsed = time.monotonic() - start
    assert not dst.fetch_done.is_set() and dst.num_loading() == 1
    assert elapsed < 1.0  # two short waits (~50 ms each), not the fetch's 5 s
    assert dst.get_finished() == (None, None, None)
    dst.release.set()  # the fetch returns now; the load completes normally
    assert dst.fetch_done.wait(2.0)
    _load(dst, spec)
    assert dst.get_finished() == (None, {"r"}, None)
    assert not _unchanged(dst, before)


def test_non_idle_step_never_waits(saved: Saved) -> None:
    _, dst, handle = saved
    dst.hold_s = 5.0
    dst.start_load_kv(KVConnectorMetadata(loads=[LoadSpec("r", handle, [0], 0, 5.0)]))
    assert dst.num_loading() == 1 and not dst.fetch_done.is_set()
    dst.start_load_kv(None)
    assert dst.num_loading() == 1 and dst.get_finished() == (None, None, None)


def test_history_records_bytes_and_outcome_of_each_load(saved: Saved) -> None:
    _, dst, handle = saved
    _load(dst, LoadSpec("ok", handle, [0, 1, 2], 0, timeout_s=5.0))
    _load(dst, LoadSpec("short", handle, [4, 5], first_block=2, timeout_s=5.0))
    dst.raise_on_fetch = True
    _load(dst, LoadSpec("raised", handle, [6], 0, timeout_s=5.0))
    assert dst.get_finished() == (None, {"ok"}, {"short", "raised"})
    per_block = _bytes_per_block(torch.float32)
    assert [(r.req_id, r.num_bytes, r.ok) for r in dst.history] == [
        ("ok", 3 * per_block, True),
        ("short", 0, False),
        ("raised", 0, False),
    ]
    assert all(r.seconds >= 0 for r in dst.history)
    assert dst.report().bytes_loaded == 3 * per_block
    assert dst.report().bytes_loaded == 0  # reset by each report
