"""The NIXL KV transport in one process (two agents over UCX on loopback): READs land bit for
bit straight in the destination blocks, with adjacent blocks merged into one descriptor; a
pipeline stage reads its layer range; leases end on the readers' notifications or on expiry;
an unknown source, an expired lease or a source that is gone fail the load (nothing written);
idle agents use no CPU. Skipped without the ``nixl`` extra."""

from __future__ import annotations

import dataclasses
import os
import pickle
import resource
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kv_transfer import nixl_transport
from kv_transfer.base import WorkerConnector, _Load
from kv_transfer.blocks import allocate_kv_caches
from kv_transfer.connector import KVConnectorMetadata, KVReadStuck, KVSegment, LoadSpec, SaveSpec
from kv_transfer.nixl_transport import MISSING, nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason=MISSING)

if nixl_available():
    from kv_transfer.nixl_reads import _Read
    from kv_transfer.nixl_transport import NixlHandle, NixlWorkerConnector

NUM_LAYERS, BLOCK, KV_HEADS, HEAD_DIM = 4, 4, 2, 8
SRC_TABLE = [5, 6, 7, 2]  # the saved request's block table; 10 tokens fill its first three
DST_IDS = [10, 11, 0]  # 5->10 and 6->11 are adjacent on both sides: one descriptor; 7->0 another


def _caches(
    num_blocks: int, dtype: torch.dtype, seed: int, layers: range = range(NUM_LAYERS)
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    caches = allocate_kv_caches(len(layers), num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return caches


@pytest.fixture
def make() -> Iterator[Callable[..., NixlWorkerConnector]]:
    """Builds connectors holding ``layers`` of a cache; every one knows every other. At the
    end every endpoint is closed first, while every agent still answers, then every
    connector; and every agent any of them made has ended -- none is left for the garbage
    collector to end at some later moment, under whatever another test runs (UCX aborts the
    process when it destroys an endpoint with work still queued)."""
    made: list[NixlWorkerConnector] = []
    bindings: list[weakref.ref[Any]] = []  # each agent's C++ side: dead once it has ended
    make_agent = nixl_transport._make_agent

    def recorded(*args: Any) -> Any:
        agent = make_agent(*args)
        bindings.append(weakref.ref(agent.agent))
        return agent

    def build(
        num_blocks: int = 8,
        seed: int = 0,
        layers: range = range(NUM_LAYERS),
        dtype: torch.dtype = torch.float32,
        **options: Any,
    ) -> NixlWorkerConnector:
        # NIXL's READs unless a test asks for the same-node copy (one process: it would
        # take every read here).
        options.setdefault("same_node_copy", False)
        connector = NixlWorkerConnector(**options)
        connector.register_kv_caches(_caches(num_blocks, dtype, seed, layers), layers)
        for other in made:
            other.add_peers([connector.peer_info()])
            connector.add_peers([other.peer_info()])
        made.append(connector)
        return connector

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(nixl_transport, "_make_agent", recorded)
        yield build
    for connector in made:
        connector.remove_peers(list(connector._peers))
    for connector in made:
        connector.close()
    deadline = time.monotonic() + 5.0  # (transfers still running end on the linger thread)
    while any(c in nixl_transport._lingering for c in made) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(c in nixl_transport._lingering for c in made), "transfers still run"
    # No gc.collect(): an agent that only a collection would end is what this rules out.
    assert [ref for ref in bindings if ref() is not None] == []


def _save(src: WorkerConnector, num_tokens: int = 10, req_id: str = "r") -> list[KVSegment]:
    src.wait_for_save(
        KVConnectorMetadata(saves=[SaveSpec(req_id, num_tokens)]), {req_id: SRC_TABLE}
    )
    saved: list[KVSegment] = src.report().saved[req_id]
    return saved


def _load(
    dst: WorkerConnector, handle: list[KVSegment], timeout_s: float = 5.0, req_id: str = "r"
) -> tuple[set[str] | None, set[str] | None]:
    """Load ``handle`` into ``DST_IDS``, stepping idle until the load ends; (done, failed)."""
    dst.start_load_kv(KVConnectorMetadata(loads=[LoadSpec(req_id, handle, DST_IDS, 0, timeout_s)]))
    deadline = time.monotonic() + timeout_s + 5.0
    while dst.num_loading() and time.monotonic() < deadline:
        dst.start_load_kv(None, idle=True)
    assert dst.num_loading() == 0, "the load never ended"
    _, done, failed = dst.get_finished()
    return done, failed


def _same_blocks(dst: WorkerConnector, src: WorkerConnector, layers: range) -> bool:
    for layer in layers:
        got = dst.kv_caches[layer - dst.layers.start]
        want = src.kv_caches[layer - src.layers.start]
        for s, d in zip(SRC_TABLE[:3], DST_IDS, strict=True):
            if not torch.equal(got[:, d].view(torch.uint8), want[:, s].view(torch.uint8)):
                return False
    return True


def _snapshot(c: WorkerConnector) -> list[torch.Tensor]:
    return [t.clone() for t in c.kv_caches]


def _unchanged(c: WorkerConnector, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(c.kv_caches, before, strict=True))


def _sending(c: WorkerConnector, wait_s: float = 0.0) -> set[str] | None:
    """The source's ended leases; with ``wait_s``, poll that long for the notification."""
    deadline = time.monotonic() + wait_s
    while True:
        ended = c.get_finished()[0]
        if ended or time.monotonic() >= deadline:
            return ended
        time.sleep(0.005)


def _recorded(method: Callable[..., Any], calls: list[Any]) -> Callable[..., Any]:
    """``method``, noting the first argument of each call (the transfer released, the agent
    ended): what a test watches for still happens, nothing is left for the collector."""

    def call(first: Any, *rest: Any) -> Any:
        calls.append(first)
        return method(first, *rest)

    return call


# -- the round trip --------------------------------------------------------------------------
@pytest.mark.parametrize("copy", [False, True], ids=["nixl-read", "same-node-copy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_blocks_land_bit_for_bit_and_end_the_lease(
    make: Callable[..., NixlWorkerConnector], dtype: torch.dtype, copy: bool
) -> None:
    """Both ways of reading: a NIXL READ, or (a source of this machine) one kernel copy."""
    src, dst = make(dtype=dtype), make(num_blocks=12, seed=1, dtype=dtype, same_node_copy=copy)
    handle = _save(src)
    (segment,) = handle
    assert segment.in_place and segment.layers == range(NUM_LAYERS)
    lease = segment.handle
    assert isinstance(lease, NixlHandle) and lease.agent == src.agent.name
    assert lease.block_ids == tuple(SRC_TABLE[:3]) and pickle.loads(pickle.dumps(lease)) == lease
    assert _sending(src) is None  # held until read
    before = _snapshot(dst)

    assert _load(dst, handle) == ({"r"}, None)
    assert _same_blocks(dst, src, range(NUM_LAYERS))
    others = [b for b in range(12) if b not in DST_IDS]
    for layer, old in zip(dst.kv_caches, before, strict=True):
        assert torch.equal(layer[:, others], old[:, others])
    per_block = NUM_LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * dtype.itemsize
    assert dst.report().bytes_loaded == 3 * per_block
    # Block-first caches: every layer of 5,6 -> 10,11 is one span, 7 -> 0 another.
    assert dst.num_descriptors == 2
    assert dst.num_direct_reads == int(copy) and dst.num_reads_started == 1
    # The reader's notification ends the lease: reported once, and gone.
    assert _sending(src, wait_s=5.0) == {"r"}
    assert _sending(src) is None and len(src.leases) == 0


def test_the_same_node_copy_is_only_for_host_memory_and_can_be_turned_off(
    make: Callable[..., NixlWorkerConnector],
) -> None:
    src = make()
    on, off = make(seed=1, same_node_copy=True), make(seed=2, same_node_copy=False)
    assert src.agent.name in on._direct and not off._direct
    # UCX's transports restricted (ucx_tls; registering would set UCX_TLS for the process):
    # NIXL only, whatever the option says.
    restricted = NixlWorkerConnector(same_node_copy=True, ucx_tls="tcp")
    assert not restricted.same_node_copy
    restricted.close()
    peer = src.peer_info()
    assert peer.same_host is not None and peer.same_host.pid == os.getpid()
    on._forget_peer(src.agent.name)
    on.add_peers(
        [dataclasses.replace(peer, layout=dataclasses.replace(peer.layout, mem_type="VRAM"))]
    )
    assert src.agent.name in on._peers and src.agent.name not in on._direct


def test_layer_first_caches_work_with_more_descriptors(
    make: Callable[..., NixlWorkerConnector],
) -> None:
    """Separate tensors per layer (not the workers' layout) still transfer correctly."""
    src, dst = NixlWorkerConnector(same_node_copy=False), NixlWorkerConnector(same_node_copy=False)
    try:
        gen = torch.Generator().manual_seed(3)
        for c, n in ((src, 8), (dst, 12)):
            caches = [
                torch.randn(2, n, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
                for _ in range(NUM_LAYERS)
            ]
            c.register_kv_caches(caches, range(NUM_LAYERS))
        src.add_peers([dst.peer_info()])
        dst.add_peers([src.peer_info()])
        assert _load(dst, _save(src)) == ({"r"}, None)
        assert _same_blocks(dst, src, range(NUM_LAYERS))
        assert dst.num_descriptors == NUM_LAYERS * 2 * 2  # per layer, K and V: two runs each
    finally:
        src.close()
        dst.close()


def test_decode_stages_read_their_ranges_and_the_lease_ends_after_both(
    make: Callable[..., NixlWorkerConnector],
) -> None:
    src = make()
    low = make(num_blocks=12, seed=1, layers=range(0, 1))
    high = make(num_blocks=12, seed=2, layers=range(1, NUM_LAYERS))
    handle = _save(src)
    assert _load(low, handle) == ({"r"}, None)
    assert _same_blocks(low, src, range(0, 1))
    time.sleep(0.05)
    assert _sending(src) is None  # layers 1-3 not read yet: still held
    assert _load(high, handle) == ({"r"}, None)
    assert _same_blocks(high, src, range(1, NUM_LAYERS))
    assert _sending(src, wait_s=5.0) == {"r"}
    assert high.report().bytes_loaded == 3 * low.report().bytes_loaded


def test_prefill_stages_each_lease_their_layers_for_one_decode_worker(
    make: Callable[..., NixlWorkerConnector],
) -> None:
    first, second = make(layers=range(0, 3)), make(seed=5, layers=range(3, NUM_LAYERS))
    dst = make(num_blocks=12, seed=1)
    handle = sorted(_save(first) + _save(second), key=lambda s: s.first_layer)
    assert [s.layers for s in handle] == [range(0, 3), range(3, NUM_LAYERS)]
    assert _load(dst, handle) == ({"r"}, None)
    assert _same_blocks(dst, first, range(0, 3))
    assert _same_blocks(dst, second, range(3, NUM_LAYERS))
    assert _sending(first, wait_s=5.0) == {"r"} and _sending(second, wait_s=5.0) == {"r"}


def test_a_load_from_the_middle_of_the_saved_blocks(
    make: Callable[..., NixlWorkerConnector],
) -> None:
    """A local prefix hit: the decode side reads only the blocks after it."""
    src, dst = make(), make(num_blocks=12, seed=1)
    handle = _save(src)
    spec = LoadSpec("r", handle, [3, 4], 1, 5.0)  # saved blocks 1 and 2 (ids 6, 7)
    dst.start_load_kv(KVConnectorMetadata(loads=[spec]))
    while dst.num_loading():
        dst.start_load_kv(None, idle=True)
    assert dst.get_finished()[1] == {"r"}
    for layer in range(NUM_LAYERS):
        assert torch.equal(dst.kv_caches[layer][:, [3, 4]], src.kv_caches[layer][:, [6, 7]])


# -- failures ----------------------------------------------------------------------------------
def test_an_unknown_source_fails_the_load_and_writes_nothing(
    make: Callable[..., NixlWorkerConnector], caplog: pytest.LogCaptureFixture
) -> None:
    dst = make(num_blocks=12, seed=1)
    stranger = NixlHandle("tandem-kv-nobody", "x", 0, NUM_LAYERS, tuple(SRC_TABLE[:3]), 1e12)
    before = _snapshot(dst)
    assert _load(dst, [KVSegment(0, NUM_LAYERS, stranger, True)]) == (None, {"r"})
    assert _unchanged(dst, before)
    assert "unknown KV source tandem-kv-nobody" in caplog.text
    assert not dst.history[-1].ok and dst.history[-1].num_bytes == 0


def test_a_segment_claiming_layers_the_source_lacks_fails_and_writes_nothing(
    make: Callable[..., NixlWorkerConnector], caplog: pytest.LogCaptureFixture
) -> None:
    """A source holding layers 0-2 whose handle claims all four: the read would reach past
    its pool's layer table (or wrap to its last layers); it fails before anything is read."""
    src = make(layers=range(0, 3))
    dst = make(num_blocks=12, seed=1)
    (segment,) = _save(src)
    forged = KVSegment(0, NUM_LAYERS, segment.handle, True)
    before = _snapshot(dst)
    assert _load(dst, [forged]) == (None, {"r"})
    assert _unchanged(dst, before)
    assert "were asked of a source holding range(0, 3)" in caplog.text


def test_an_expired_lease_is_reported_and_no_read_starts(
    make: Callable[..., NixlWorkerConnector],
) -> None:
    src = make(lease_s=0.3, safety_margin_s=0.1)
    dst = make(num_blocks=12, seed=1, lease_s=0.3, safety_margin_s=0.1)
    handle = _save(src)
    assert _sending(src) is None
    time.sleep(0.35)
    assert _sending(src) == {"r"}  # expired: the prefill side may free the blocks
    assert len(src.leases) == 0
    before = _snapshot(dst)
    assert _load(dst, handle) == (None, {"r"})
    assert _unchanged(dst, before)  # the decode side did not read blocks that may be reused


def test_no_read_starts_within_the_margin_of_the_lease(
    make: Callable[..., NixlWorkerConnector], caplog: pytest.LogCaptureFixture
) -> None:
    """The source frees on its own clock (it cannot see a one-sided read): a read that could
    outlast the lease, less the margin, does not start."""
    src, dst = make(), make(num_blocks=12, seed=1)  # dst: the default margin of 1 s
    (segment,) = _save(src)
    lease = segment.handle
    late = NixlHandle(
        lease.agent, lease.lease_id, 0, NUM_LAYERS, lease.block_ids, time.time() + 0.5
    )
    before = _snapshot(dst)
    assert _load(dst, [KVSegment(0, NUM_LAYERS, late, True)]) == (None, {"r"})
    assert _unchanged(dst, before)
    assert "lease has expired" in caplog.text


def test_a_read_seen_done_only_after_the_lease_is_not_trusted(
    make: Callable[..., NixlWorkerConnector], caplog: pytest.LogCaptureFixture
) -> None:
    """A step that runs past the lease (less the margin) sees the read done too late: the
    source may have reused its blocks meanwhile, so the load fails and is recomputed."""
    src, dst = make(), make(num_blocks=12, seed=1)
    (segment,) = _save(src)
    lease = segment.handle
    soon = time.time() + dst.safety_margin_s + 0.1  # 0.1 s to read in
    late = NixlHandle(lease.agent, lease.lease_id, 0, NUM_LAYERS, lease.block_ids, soon)
    spec = LoadSpec("r", [KVSegment(0, NUM_LAYERS, late, True)], DST_IDS, 0, 5.0)
    now = time.monotonic()
    dst._reads["r"] = dst._start_read(_Load(spec, None, now, now + 5.0, time.time()))  # in time
    time.sleep(0.2)  # ... but the worker's next look comes after the lease's margin
    while dst.num_loading():
        dst.start_load_kv(None, idle=True)
    assert dst.get_finished()[1:] == (None, {"r"})
    assert "after the source's lease" in caplog.text


def test_a_read_failing_in_one_segment_fails_after_the_others_stop(
    make: Callable[..., NixlWorkerConnector],
) -> None:
    """Two prefill stages; the second is gone. The first stage's READ was posted: the load is
    reported failed only once nothing of it runs any more."""
    first, second = make(layers=range(0, 3)), make(seed=5, layers=range(3, NUM_LAYERS))
    dst = make(num_blocks=12, seed=1)
    handle = sorted(_save(first) + _save(second), key=lambda s: s.first_layer)
    second.close()
    assert _load(dst, handle) == (None, {"r"})
    assert not dst._reads and not dst._retired  # no transfer left running


class _RunningTransfer:
    """Stands in for a NIXL transfer whose copy is still running (state set by the test)."""

    def __init__(self) -> None:
        self.state = "PROC"
        self.released = False

    def release(self) -> None:
        self.released = True


def test_a_failed_read_is_reported_only_once_its_transfer_stops(
    make: Callable[..., NixlWorkerConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NIXL's release of a running UCX transfer does not stop its copy: a read past its
    deadline is not released or reported while its transfer runs (the blocks would go to
    another request); its source is disconnected after ``abort_grace_s``; it is reported
    failed as soon as the transfer stops."""
    dst = make(num_blocks=12, seed=1)
    xfer = _RunningTransfer()
    monkeypatch.setattr(dst, "_state", lambda x, agent=None: x.state)
    forgotten: list[str] = []
    monkeypatch.setattr(dst, "_forget_peer", forgotten.append)
    dst.abort_grace_s = 0.2
    now = time.monotonic()
    load = _Load(LoadSpec("r", [], DST_IDS, 0, 0.1), None, now - 0.2, now - 0.1, time.time())
    dst._reads["r"] = _Read(load, [xfer], 0, 0, now + 100.0, ["tandem-kv-source"])
    dst._poll_reads()
    assert dst.num_loading() == 1 and not xfer.released  # past its deadline, still running
    assert dst.get_finished()[1:] == (None, None)
    # An idle step still waits (polls, with sleeps) its 50 ms: the failed read's past
    # deadline ended each idle step at once (about 500 empty steps a second).
    began = time.monotonic()
    dst.start_load_kv(None, idle=True)
    assert time.monotonic() - began >= 0.045
    time.sleep(0.2)
    dst._poll_reads()
    assert forgotten == ["tandem-kv-source"] and dst.num_loading() == 1
    xfer.state = "ERR"  # the closed endpoint ended it
    dst._poll_reads()
    assert xfer.released and dst.num_loading() == 0
    assert dst.get_finished()[1:] == (None, {"r"})


def test_a_stuck_read_disconnects_only_the_sources_it_still_reads_from(
    make: Callable[..., NixlWorkerConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read from two sources (a pipelined prefill instance's stages): one transfer is done,
    the other hangs. Only the hung one's source is disconnected -- the healthy one was too,
    and every load from it then failed at once for ``reconnect_after_s``."""
    dst = make(num_blocks=12, seed=1)
    done, stuck = _RunningTransfer(), _RunningTransfer()
    done.state = "DONE"
    monkeypatch.setattr(dst, "_state", lambda x, agent=None: x.state)
    forgotten: list[str] = []
    monkeypatch.setattr(dst, "_forget_peer", forgotten.append)
    dst.abort_grace_s = 0.05
    now = time.monotonic()
    load = _Load(LoadSpec("r", [], DST_IDS, 0, 0.1), None, now - 0.3, now - 0.2, time.time())
    dst._reads["r"] = _Read(load, [done, stuck], 0, 0, now + 100.0, ["stage-0", "stage-1"])
    dst._poll_reads()
    assert forgotten == ["stage-1"] and done.released and not stuck.released
    stuck.state = "ERR"
    dst._poll_reads()
    assert dst.get_finished()[1:] == (None, {"r"})


def test_a_read_cut_short_by_the_lease_says_so(
    make: Callable[..., NixlWorkerConnector],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A read's deadline is the sooner of its ``timeout_s`` and the source's lease (less
    the margin): when the lease cut it short, the error says so, not only "timed out"."""
    dst = make(num_blocks=12, seed=1)
    xfer = _RunningTransfer()
    monkeypatch.setattr(dst, "_state", lambda x, agent=None: x.state)
    now = time.monotonic()
    # timeout_s 5 s, but the deadline (the lease's) came 0.4 s after the start
    load = _Load(LoadSpec("r", [], DST_IDS, 0, 5.0), None, now - 0.5, now - 0.1, time.time())
    dst._reads["r"] = _Read(load, [xfer], 0, 0, now + 100.0, ["tandem-kv-source"])
    dst._poll_reads()
    xfer.state = "ERR"
    dst._poll_reads()
    assert dst.get_finished()[1:] == (None, {"r"})
    assert "timed out after 0.5s (before its timeout_s: the source's lease" in caplog.text


def test_a_read_that_never_ends_fails_the_step_and_keeps_its_cache_alive(
    make: Callable[..., NixlWorkerConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read still running long after its source was disconnected may write into its blocks
    at any time: it is never reported (the scheduler would hand the blocks to another
    request); the step fails, which fails the instance over. Its recovery gives the worker
    new caches, and the old one stays alive until the transfer ends."""
    dst = make(num_blocks=12, seed=1)
    xfer = _RunningTransfer()
    monkeypatch.setattr(dst, "_state", lambda x, agent=None: x.state)
    monkeypatch.setattr(dst, "_forget_peer", lambda name: None)
    dst.abort_grace_s = 0.05
    now = time.monotonic()
    load = _Load(LoadSpec("r", [], DST_IDS, 0, 0.1), None, now - 1.0, now - 0.5, time.time())
    dst._reads["r"] = _Read(load, [xfer], 0, 0, now + 100.0, ["tandem-kv-source"])
    dst._poll_reads()  # 0.5 s overdue: disconnected ...
    with pytest.raises(KVReadStuck, match="KV read of r still runs"):
        dst._poll_reads()  # ... and, still running, the step fails
    assert dst.get_finished()[1:] == (None, None) and not xfer.released
    assert dst.num_loading() == 1 and not dst._retired
    old = dst.kv_caches
    dst.register_kv_caches(_caches(12, torch.float32, 1), range(NUM_LAYERS))  # the recovery
    assert dst.num_loading() == 0 and dst.get_finished()[1:] == (None, None)
    (entry,) = dst._retired
    assert entry.xfers == [xfer] and entry.keep is old  # the memory it writes stays alive
    assert entry.disconnected_at is not None  # (disconnected already: not again)
    xfer.state = "DONE"
    dst._poll_reads()
    assert xfer.released and not dst._retired


def test_a_read_running_when_the_cache_is_replaced_is_watched_through_its_own_agent(
    make: Callable[..., NixlWorkerConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """New caches mean a new agent; a transfer the old one posted and that still runs is
    kept (with the old cache) and asked about through the agent that posted it, until it
    ends -- the new agent knows nothing of it."""
    dst = make(num_blocks=12, seed=1)
    old_agent, old_caches = dst.agent, dst.kv_caches
    xfer = _RunningTransfer()
    asked: list[Any] = []

    def state(x: Any, agent: Any = None) -> str:
        asked.append(agent or dst.agent)
        return str(x.state)

    monkeypatch.setattr(dst, "_state", state)
    now = time.monotonic()
    load = _Load(LoadSpec("r", [], DST_IDS, 0, 30.0), None, now, now + 30.0, time.time())
    dst._reads["r"] = _Read(load, [xfer], 0, 0, now + 100.0, ["tandem-kv-source"])
    dst.register_kv_caches(_caches(12, torch.float32, 4), range(NUM_LAYERS))
    assert dst.agent is not old_agent and not dst._reads
    (entry,) = dst._retired
    assert entry.xfers == [xfer] and entry.keep is old_caches and entry.agent is old_agent
    assert entry.sources == ["tandem-kv-source"] and entry.deadline == load.deadline
    asked.clear()
    dst._poll_reads()
    assert asked == [old_agent] and not xfer.released
    xfer.state = "DONE"
    dst._poll_reads()
    assert xfer.released and not dst._retired


def _watch_removals(agent: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The peers ``agent`` is told to remove (disconnect), in order; it still removes them."""
    removed: list[str] = []
    remove = agent.remove_remote_agent

    def watched(name: str) -> None:
        removed.append(name)
        remove(name)

    monkeypatch.setattr(agent, "remove_remote_agent", watched)
    return removed


def test_a_dropped_read_past_its_deadline_is_disconnected_through_the_agent_that_posted_it(
    make: Callable[..., NixlWorkerConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read still running when its cache is replaced keeps the old cache and the old agent
    alive until it ends. It kept neither its deadline nor its sources: one whose source
    hangs ran -- and held the whole old cache -- for good. Past its deadline its source is
    now disconnected through the agent that posted it (the new agent's connection to that
    source is left alone), which ends it; it is never reported (nobody waits for it)."""
    src, dst = make(), make(num_blocks=12, seed=1)
    name = src.agent.name  # type: ignore[union-attr]
    old_agent, old = dst.agent, weakref.ref(dst.kv_caches[0])
    removed = _watch_removals(old_agent, monkeypatch)
    xfer = _RunningTransfer()
    monkeypatch.setattr(dst, "_state", lambda x, agent=None: x.state)
    now = time.monotonic()
    load = _Load(LoadSpec("r", [], DST_IDS, 0, 30.0), None, now, now + 30.0, time.time())
    dst._reads["r"] = _Read(load, [xfer], 0, 0, now + 100.0, [name])
    dst.register_kv_caches(_caches(12, torch.float32, 4), range(NUM_LAYERS))
    dst.add_peers([src.peer_info()])  # the new agent knows the source too
    new_removed = _watch_removals(dst.agent, monkeypatch)
    dst._poll_reads()
    assert removed == [] and not xfer.released  # before its deadline: left to end
    (entry,) = dst._retired
    assert entry.deadline == load.deadline and entry.sources == [name]
    entry.deadline = time.monotonic()  # (its deadline comes)
    del entry  # (this test's own reference would keep the old cache)
    dst._poll_reads()
    assert removed == [name] and not xfer.released  # through the agent that posted it ...
    assert new_removed == [] and dst.num_peers() == 1 and not dst._disconnected  # ... only
    assert old() is not None and dst._closing  # still running: all of it kept
    xfer.state = "ERR"  # the closed endpoint ended it
    dst._poll_reads()
    assert xfer.released and not dst._retired and not dst._closing
    assert old() is None  # the old agent undone, the old cache let go
    assert dst.get_finished()[1:] == (None, None)


def test_a_probe_given_up_on_does_not_hold_a_replaced_cache_for_good(
    make: Callable[..., NixlWorkerConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe that timed out keeps its read (and the agent that posted it) until the read
    ends; a cache replaced meanwhile stays registered with that agent, so it stays too --
    for good, when the peer hangs. The probe's peer is now disconnected through the probe's
    agent: at once once that agent is replaced (nothing else uses it), ``abort_grace_s``
    after the probe's deadline while it is still this worker's (the disconnect fails every
    load from that peer for ``reconnect_after_s``)."""
    src, dst = make(), make(num_blocks=12, seed=1)
    name = src.agent.name  # type: ignore[union-attr]
    state = {"now": "PROC"}
    released: list[Any] = []
    monkeypatch.setattr(dst, "_post", lambda xfer: state["now"])
    monkeypatch.setattr(dst, "_state", lambda xfer, agent=None: state["now"])
    monkeypatch.setattr(dst, "_release", _recorded(dst._release, released))
    with pytest.raises(ConnectionError, match="timed out"):
        dst.probe(src.peer_info(), timeout_s=0.05)
    dst._poll_reads()
    assert dst.num_peers() == 1  # this worker's own agent: not yet
    old_agent, old = dst.agent, weakref.ref(dst.kv_caches[0])
    removed = _watch_removals(old_agent, monkeypatch)
    dst.register_kv_caches(_caches(12, torch.float32, 4), range(NUM_LAYERS))
    assert old() is not None and dst._closing  # registered with the probe's agent: kept
    dst._poll_reads()
    assert removed == [name] and not released  # replaced: disconnected at once
    state["now"] = "ERR"  # the closed endpoint ended it
    dst._poll_reads()
    assert len(released) == 1 and not dst._retired and not dst._closing
    assert old() is None


def test_a_probe_given_up_on_disconnects_its_peer_after_the_grace(
    make: Callable[..., NixlWorkerConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe's agent is still this worker's: its peer is disconnected as a stuck read's
    source is (``abort_grace_s`` past the deadline; connected again later)."""
    src, dst = make(), make(num_blocks=12, seed=1)
    name = src.agent.name  # type: ignore[union-attr]
    state = {"now": "PROC"}
    monkeypatch.setattr(dst, "_post", lambda xfer: state["now"])
    monkeypatch.setattr(dst, "_state", lambda xfer, agent=None: state["now"])
    dst.abort_grace_s = 0.5
    with pytest.raises(ConnectionError, match="timed out"):
        dst.probe(src.peer_info(), timeout_s=0.05)
    dst._poll_reads()
    assert dst.num_peers() == 1
    time.sleep(0.5)
    dst._poll_reads()
    assert dst.num_peers() == 0 and name in dst._disconnected
    assert dst._retired  # still running: kept (never released under its copy)
    state["now"] = "ERR"  # the closed endpoint ended it: released here, not when dst closes
    dst._poll_reads()
    assert not dst._retired


@pytest.mark.parametrize("copy", [False, True], ids=["nixl-read", "same-node-copy"])
def test_a_source_that_is_gone_fails_the_load(
    make: Callable[..., NixlWorkerConnector], copy: bool
) -> None:
    src, dst = make(), make(num_blocks=12, seed=1, same_node_copy=copy)
    assert _load(dst, _save(src, req_id="warm"), req_id="warm") == ({"warm"}, None)
    assert dst.num_direct_reads == int(copy)
    handle = _save(src)
    src.close()  # its memory deregistered, its agent gone (its process and tensors live on)
    before = _snapshot(dst)
    start = time.monotonic()
    assert _load(dst, handle, timeout_s=3.0) == (None, {"r"})
    assert time.monotonic() - start < 4.0
    assert _unchanged(dst, before)
    if copy:
        assert src.agent is None and not dst._direct  # the copy path gave up on it


@pytest.mark.parametrize("copy", [False, True], ids=["nixl-read", "same-node-copy"])
def test_a_handle_of_a_replaced_cache_is_not_read(
    make: Callable[..., NixlWorkerConnector], copy: bool
) -> None:
    """Peers may hold a worker's old agent for a while after it replaced its cache (the
    control plane tells them when its instance rejoins): a handle of the old cache must not
    read the new one's blocks, by a READ or by a same-node copy (which then stops)."""
    src, dst = make(), make(num_blocks=12, seed=1, same_node_copy=copy)
    handle = _save(src)
    src.register_kv_caches(_caches(8, torch.float32, 3), range(NUM_LAYERS))
    before = _snapshot(dst)
    done, failed = _load(dst, handle, timeout_s=2.0)
    assert (done, failed) == (None, {"r"}) and _unchanged(dst, before)
    assert dst.num_direct_reads == 0
    if copy:
        assert not dst._direct


def test_a_copy_whose_source_changes_its_cache_meanwhile_is_thrown_away(
    make: Callable[..., NixlWorkerConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token checked after the copy: the source retires its cache while the data moves
    (here: right after it moved). The load fails, the source is not told it was read (its
    lease is not ended by this reader), and it is read with NIXL from then on."""
    from kv_transfer.cma import SourceProcess

    src, dst = make(), make(num_blocks=12, seed=1, same_node_copy=True)
    handle = _save(src)
    copy = SourceProcess._copy

    def copy_then_retire(self: SourceProcess, local: Any, remote: Any) -> int:
        done = copy(self, local, remote)
        if len(local) > 1 or int(remote[0, 0]) != self.token.address:  # the data
            src.retire_caches()
        return done

    monkeypatch.setattr(SourceProcess, "_copy", copy_then_retire)
    assert _load(dst, handle, timeout_s=2.0) == (None, {"r"})
    assert dst.num_direct_reads == 0 and not dst._direct
    assert _sending(src, wait_s=0.2) is None and len(src.leases) == 1


@pytest.mark.parametrize("copy", [False, True], ids=["nixl-read", "same-node-copy"])
def test_block_ids_outside_either_pool_fail_before_anything_moves(
    make: Callable[..., NixlWorkerConnector], copy: bool
) -> None:
    src, dst = make(), make(num_blocks=12, seed=1, same_node_copy=copy)
    handle = _save(src)
    before = _snapshot(dst)
    spec = LoadSpec("r", handle, [10, 11, 12], 0, 2.0)  # block 12 of 12
    dst.start_load_kv(KVConnectorMetadata(loads=[spec]))
    assert dst.get_finished()[2] == {"r"} and _unchanged(dst, before)
    bad = [
        dataclasses.replace(
            handle[0], handle=dataclasses.replace(handle[0].handle, block_ids=(5, 6, -1))
        )
    ]
    dst.start_load_kv(KVConnectorMetadata(loads=[LoadSpec("q", bad, DST_IDS, 0, 2.0)]))
    assert dst.get_finished()[2] == {"q"} and _unchanged(dst, before)


def test_a_peer_that_left_is_forgotten_once_nothing_reads_from_it(
    make: Callable[..., NixlWorkerConnector],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``remove_peers`` (its instance left the cluster): the peer's endpoint and metadata go,
    and a load from it fails as from an unknown source; while a read from it runs, it stays
    until that read ends."""
    src, other, dst = make(), make(seed=2), make(num_blocks=12, seed=1)
    assert dst.num_peers() == 2
    handle = _save(src)
    dst.remove_peers([src.agent.name])  # type: ignore[union-attr]
    assert dst.num_peers() == 1
    assert _load(dst, handle) == (None, {"r"})
    assert not dst.history[-1].ok and "unknown KV source" in caplog.text

    xfer = _RunningTransfer()
    monkeypatch.setattr(dst, "_state", lambda x, agent=None: x.state)
    name = other.agent.name  # type: ignore[union-attr]
    now = time.monotonic()
    load = _Load(LoadSpec("q", [], DST_IDS, 0, 30.0), None, now, now + 30.0, time.time())
    dst._reads["q"] = _Read(load, [xfer], 0, 0, now + 100.0, [name])
    dst.remove_peers([name])
    assert dst.num_peers() == 1  # still read from
    xfer.state = "DONE"
    dst._poll_reads()
    assert dst.num_peers() == 0 and dst.num_loading() == 0


@pytest.mark.parametrize("copy", [False, True], ids=["nixl-read", "same-node-copy"])
def test_a_source_disconnected_after_a_stuck_read_is_read_again_later(
    make: Callable[..., NixlWorkerConnector], copy: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """A read that never ends has its source disconnected (``abort_grace_s``), but the
    source did not leave: a hand-off from it after ``reconnect_after_s`` connects again and
    reads, instead of every later one failing as from an unknown source until its instance
    rejoins. One that left (``remove_peers``) stays unknown."""
    src, dst = make(), make(num_blocks=12, seed=1, same_node_copy=copy)
    name = src.agent.name  # type: ignore[union-attr]
    dst._disconnect_peer(name)  # what a stuck read does
    assert dst.num_peers() == 0
    # Within the cool-down its loads fail at once, saying why (a path still broken would
    # hold each read to its deadline and past).
    assert _load(dst, _save(src, req_id="soon"), req_id="soon") == (None, {"soon"})
    assert "disconnected after a read from it got stuck" in caplog.text
    dst.reconnect_after_s = 0.0
    assert _load(dst, _save(src)) == ({"r"}, None)
    assert _same_blocks(dst, src, range(NUM_LAYERS)) and dst.num_peers() == 1
    assert dst.num_direct_reads == int(copy)  # the same-node copy came back too
    dst._disconnect_peer(name)
    dst.remove_peers([name])
    assert _load(dst, _save(src, req_id="q"), req_id="q") == (None, {"q"})


def test_layouts_that_differ_are_refused(make: Callable[..., NixlWorkerConnector]) -> None:
    src, dst = make(dtype=torch.bfloat16), make(num_blocks=12, seed=1)
    before = _snapshot(dst)
    assert _load(dst, _save(src)) == (None, {"r"})
    assert _unchanged(dst, before)


def test_a_released_save_ends_its_lease_at_the_next_step(
    make: Callable[..., NixlWorkerConnector],
) -> None:
    """The scheduler side says nobody will take a saved request's KV (``releases``): the
    lease ends at once and the blocks are reported free (no wait for the expiry)."""
    src = make()
    _save(src)
    _save(src, req_id="kept")
    assert _sending(src) is None
    src.wait_for_save(KVConnectorMetadata(releases=["r"]), {})
    assert _sending(src) == {"r"} and len(src.leases) == 1  # "kept" still waits


def test_new_caches_end_every_lease_and_change_the_agent(
    make: Callable[..., NixlWorkerConnector],
) -> None:
    src = make()
    old = src.agent.name
    _save(src)
    src.register_kv_caches(_caches(8, torch.float32, 3), range(NUM_LAYERS))
    assert _sending(src) is None and len(src.leases) == 0  # (see the gRPC test's reason)
    assert src.agent.name != old  # peers holding the old name cannot read the new blocks


def test_a_probe_reads_into_scratch_space_not_the_cache(
    make: Callable[..., NixlWorkerConnector],
) -> None:
    src, dst = make(), make(num_blocks=12, seed=1)
    before = _snapshot(dst)
    dst.probe(src.peer_info())
    assert _unchanged(dst, before)  # safe on a serving worker
    assert torch.equal(dst.scratch, src.kv_caches[0][0, 0].contiguous().view(-1).view(torch.uint8))
    stranger = src.peer_info()
    src.close()  # its agent is gone: the probe fails, it does not hang
    with pytest.raises((ConnectionError, RuntimeError)):
        dst.probe(stranger, timeout_s=2.0)


# -- no busy-spinning --------------------------------------------------------------------------
def test_a_probe_that_times_out_while_its_read_runs_keeps_it_until_it_ends(
    make: Callable[..., NixlWorkerConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A running transfer is never released (its copy would go on into freed memory): a
    probe given up on keeps it, and the scratch slab it writes into, until it ends."""
    src, dst = make(), make(num_blocks=12, seed=1)
    state = {"now": "PROC"}
    released: list[Any] = []
    monkeypatch.setattr(dst, "_post", lambda xfer, agent=None: state["now"])
    monkeypatch.setattr(dst, "_state", lambda xfer, agent=None: state["now"])
    monkeypatch.setattr(dst, "_release", _recorded(dst._release, released))
    with pytest.raises(ConnectionError, match="timed out"):
        dst.probe(src.peer_info(), timeout_s=0.05)
    assert not released
    (entry,) = dst._retired
    (xfer,), (scratch,) = entry.xfers, entry.keep
    assert scratch is dst.scratch and entry.sources == [src.agent.name]
    state["now"] = "DONE"
    dst._poll_reads()
    assert released == [xfer] and not dst._retired


def test_a_probe_waits_for_its_read_without_the_workers_lock(
    make: Callable[..., NixlWorkerConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a serving worker the probe gets its step lock: held for each use of the agent, not
    while the read is waited for (a peer that cannot be reached held the worker's steps for
    the probe's whole timeout). The cache replaced meanwhile keeps its agent until the probe's
    read ends."""
    src, dst = make(), make(num_blocks=12, seed=1)
    lock = threading.Lock()
    state = {"now": "PROC"}
    asked: list[bool] = []

    def watched(xfer: Any, agent: Any = None) -> str:
        asked.append(lock.locked())
        return state["now"]

    ended: list[Any] = []
    monkeypatch.setattr(dst, "_post", lambda xfer: state["now"])
    monkeypatch.setattr(dst, "_state", watched)
    monkeypatch.setattr(dst, "_end_agent", _recorded(dst._end_agent, ended))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            dst.probe(src.peer_info(), timeout_s=30.0, lock=lock)
        except BaseException as exc:
            errors.append(exc)

    probe = threading.Thread(target=run)
    probe.start()
    try:
        deadline = time.monotonic() + 10.0
        while not asked and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lock.acquire(timeout=1.0)  # a step gets in while the read runs
        try:
            old = dst.agent
            dst.register_kv_caches(_caches(12, torch.float32, 3), range(NUM_LAYERS))
            assert dst.agent is not old and ended == []  # its read still runs into old
        finally:
            lock.release()
        state["now"] = "DONE"
        probe.join(10.0)
        assert not probe.is_alive() and errors == []
        assert asked and all(asked)  # the agent is asked only under the lock
        assert ended == [old]  # ended once the probe no longer needs it
    finally:
        state["now"] = "DONE"
        probe.join(10.0)


def test_idle_agents_use_no_cpu(make: Callable[..., NixlWorkerConnector]) -> None:
    src, dst = make(), make(num_blocks=12, seed=1)
    assert _load(dst, _save(src)) == ({"r"}, None)  # connected and used once
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    busy = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert busy < 0.2, f"{busy:.2f} s of CPU in 1 s idle: a thread is spinning"


def test_the_config_builds_it() -> None:
    from cluster.config import KVTransferConfig
    from kv_transfer.registry import create_worker_connector

    options = KVTransferConfig(transport="nixl", timeout_s=2.0).connector_options()
    connector = create_worker_connector("nixl", **options)
    try:
        assert isinstance(connector, NixlWorkerConnector)
        assert connector.lease_s == 3.0 and connector.serves_in_place
        assert connector.same_node_copy  # the default
    finally:
        connector.close()
    off = KVTransferConfig(transport="nixl", same_node_copy=False).connector_options()
    assert not create_worker_connector("nixl", **off).same_node_copy
    # (Without the extra: tests/kv_transfer/test_nixl_missing.py.)


def test_a_connector_closed_while_a_probes_read_runs_undoes_its_agent_once_it_ends(
    make: Callable[..., NixlWorkerConnector], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe gave up on its read, then the connector closed (``transport: auto`` falling
    back): nothing polled a closed connector, so the read was never released nor its agent
    undone, and the scratch slab it wrote into went with the connector. The connector now
    lingers, polled, until the read ends."""
    monkeypatch.setattr(nixl_transport, "LINGER_POLL_S", 0.01)
    src, dst = make(), make(num_blocks=12, seed=1)
    state = {"now": "PROC"}
    released: list[Any] = []
    ended: list[Any] = []
    monkeypatch.setattr(dst, "_post", lambda xfer, agent=None: state["now"])
    monkeypatch.setattr(dst, "_state", lambda xfer, agent=None: state["now"])
    monkeypatch.setattr(dst, "_release", _recorded(dst._release, released))
    monkeypatch.setattr(dst, "_end_agent", _recorded(dst._end_agent, ended))
    with pytest.raises(ConnectionError, match="timed out"):
        dst.probe(src.peer_info(), timeout_s=0.05, lock=threading.Lock())
    agent = dst._retired[0].agent
    dst.close()
    assert dst in nixl_transport._lingering and not released and not ended
    state["now"] = "DONE"
    deadline = time.monotonic() + 5.0
    while dst in nixl_transport._lingering and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dst not in nixl_transport._lingering
    assert len(released) == 1 and ended == [agent]
