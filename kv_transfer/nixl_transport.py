"""The ``nixl`` KV transport: the decode worker READs the prompt's blocks straight out of the
prefill worker's cache into its own blocks, one-sided, with NVIDIA's NIXL (UCX underneath: a
kernel copy between processes of one node, TCP or RDMA between nodes). No buffer in between,
no object store, no serialization.

Set-up, once per cache (``register_kv_caches``): the worker makes a NIXL agent (a fresh name
per registration), registers its whole KV pool with it (DRAM on CPU, VRAM on CUDA: the memory
type follows the cache's device) and describes the pool (``PoolLayout``: where each layer's K
and V of block 0 are, the block stride). ``peer_info()`` is that agent's metadata and the
layout; the control plane gathers it from every worker when their instance registers and hands
every worker the others' (``add_peers``), so nothing about the peer travels per request.

Prefill side: a save copies nothing. ``_publish`` leases the request's blocks (as ``grpc``
does, ``kv_transfer.leases``) and returns a ``NixlHandle``: the agent, the lease, the block
ids, the layers, and the wall-clock time the lease expires. The blocks stay allocated until
the lease ends::

    save ─▶ lease ─┬─ a READ's notification for each of its layers ─▶ ended ─▶ blocks freed
                   └─ expired (lease_s)                              ─▶ ended ─▶ blocks freed

Decode side: ``start_load_kv`` builds, per segment of the handle that overlaps the worker's
layers, one transfer: a descriptor per (layer, K or V, block) pair on both sides, merged where
both are contiguous. With the block-first cache (``kv_transfer.blocks.allocate_kv_caches``) a
block's layers are one span, so a run of adjacent blocks on both sides is one descriptor; a
pipeline stage reads its own layer range. The READ is posted at once (no thread); each step
polls it. When it is done, its notification tells the source which layers were read, and
the request's blocks are reported received; an error, or the deadline, reports it failed and
the scheduler's ``failure_policy`` applies (recompute or fail).

One-sided reads need one rule the pull transports do not: the source cannot see a read in
progress, so it frees on its own clock. A read therefore starts only while the lease has
``safety_margin_s`` left, and is cancelled when that margin is reached (the decode side then
recomputes); the handle carries the lease's expiry as wall-clock time, so the two workers'
clocks must agree within the margin (NTP does far better). A dead source fails the read (the
kernel copy or the connection fails) or lets it run into its deadline: no hang either way.

Progress: UCX carries a READ as messages the source must answer (on one node, too: the data
moves by a kernel copy, the request does not), so the source's agent needs a progress thread:
a request would otherwise wait for the prefill worker's next step, or forever when it idles.
NIXL's default thread busy-polls a core even when idle (``pthrDelay = 0``); ours waits on
UCX's events, at most ``progress_wait_us`` at a time: it answers a read within microseconds
and costs nothing measurable when idle (``_make_agent``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from kv_transfer.base import WorkerConnector, _Load
from kv_transfer.blocks import KVPayload
from kv_transfer.leases import LeaseTable
from kv_transfer.nixl_layout import (
    NixlHandle,
    NixlPeer,
    PoolLayout,
    merge_descriptors,
    merge_spans,
)

if TYPE_CHECKING:
    import torch

    from kv_transfer.connector import KVConnectorMetadata, KVSegment, LoadSpec

logger = logging.getLogger(__name__)

__all__ = [
    "MISSING",
    "NixlHandle",
    "NixlPeer",
    "NixlWorkerConnector",
    "PoolLayout",
    "merge_descriptors",
    "merge_spans",
    "nixl_available",
]

# The PyPI wheels: ``nixl-cu12`` imports as ``nixl_cu12``; other builds as ``nixl``.
_MODULES = ("nixl_cu12", "nixl")
MISSING = (
    "the nixl KV transport needs NVIDIA NIXL: install the extra, "
    "`pip install 'tandem-serve[nixl]'` (the nixl-cu12 wheel; install torch first)"
)


def nixl_available() -> bool:
    """Whether a NIXL package is installed (without importing it)."""
    return any(importlib.util.find_spec(name) is not None for name in _MODULES)


def _nixl_api() -> Any:
    for name in _MODULES:
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError:
            continue
    raise ImportError(MISSING)


_AGENT_LOCK = threading.Lock()
# UCX's TCP transport (between nodes without RDMA, or where the kernel copy is not allowed)
# cuts messages into 8 KiB segments by default: one system call each. Bigger segments and
# socket buffers took KV reads over TCP from 0.3-0.4 to 0.5-1x a plain socket copy here
# (``make bench-kv``, nixl-tcp vs tcp). Set in the worker's environment before its agent.
UCX_DEFAULTS = {
    "UCX_TCP_TX_SEG_SIZE": "256k",
    "UCX_TCP_RX_SEG_SIZE": "256k",
    "UCX_TCP_SNDBUF": "4m",
    "UCX_TCP_RCVBUF": "4m",
}


def _make_agent(api: Any, name: str, backends: list[str], progress_wait_us: int) -> Any:
    """A NIXL agent with a progress thread that sleeps on UCX events between bursts of work,
    at most ``progress_wait_us`` at a time. ``nixl_agent`` hard-codes the thread's delay to 0
    (a busy loop); the binding's config class is swapped, for the construction only, for one
    that keeps ours."""
    base = api.nixlBind.nixlAgentConfig

    class _Config(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, progress_wait_us if key == "pthrDelay" else value)

    config = api.nixl_agent_config(
        enable_prog_thread=True, enable_listen_thread=False, backends=backends
    )
    with _AGENT_LOCK:
        api.nixlBind.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, config)
        finally:
            api.nixlBind.nixlAgentConfig = base


@dataclass
class _Read:
    load: _Load
    xfers: list[Any]  # NIXL transfer handles, posted
    num_bytes: int
    num_descriptors: int
    lease_deadline: float  # time.monotonic(): the data is trusted only if read before this
    sources: list[str] = field(default_factory=list)  # the agents it reads from
    error: str | None = None  # failed: reported once no transfer of it runs any more
    disconnected: bool = False  # its sources were disconnected (it ran far past its deadline)


class NixlWorkerConnector(WorkerConnector):
    """Serves this worker's blocks to one-sided READs and reads other workers' into its own.

    ``lease_s``: how long saved blocks wait for their read. ``safety_margin_s``: a read must
    end this long before the source's lease does (see the module's notes). ``backends``:
    NIXL backends (UCX). ``progress_wait_us``: the longest sleep of the progress thread
    between UCX events (it wakes on events; this only bounds an idle wait). ``ucx_tls``: the
    UCX transports to allow (``UCX_TLS``; this worker process's environment), e.g. ``tcp``.
    """

    transport: ClassVar[str] = "nixl"
    supports_cross_node: ClassVar[bool] = True
    supports_layer_ranges: ClassVar[bool] = True
    serves_in_place: ClassVar[bool] = True

    def __init__(
        self,
        *,
        lease_s: float = 10.0,
        safety_margin_s: float = 1.0,
        backends: tuple[str, ...] | list[str] = ("UCX",),
        progress_wait_us: int = 100_000,
        ucx_tls: str | None = None,
        max_parallel_loads: int = 4,
    ) -> None:
        super().__init__(max_parallel_loads)
        if lease_s <= safety_margin_s or safety_margin_s < 0:
            raise ValueError("lease_s must be > safety_margin_s >= 0")
        self._api = _nixl_api()
        self.lease_s = lease_s
        self.safety_margin_s = safety_margin_s
        self.backends = list(backends)
        self.progress_wait_us = progress_wait_us
        self.ucx_tls = ucx_tls
        self.leases = LeaseTable()
        self.agent: Any = None
        self.layout: PoolLayout | None = None
        self.scratch: Any = None  # a registered slab that probes read into
        self._registered: list[Any] = []
        self._peers: dict[str, PoolLayout] = {}  # agent name -> its pool
        self._departed: set[str] = set()  # peers that left, forgotten once nothing reads them
        self._reads: dict[str, _Read] = {}
        # Loads not posted yet: (when to post, the load). Only ``load_delay_s`` (fault
        # injection in tests) keeps one here past the step that brought it.
        self._delayed: dict[str, tuple[float, _Load]] = {}
        # Transfers still running when their read was given up on (or the cache replaced),
        # with the caches they write into: kept alive until the transfers end.
        self._retired: list[tuple[list[Any], list[Any]]] = []
        self.abort_grace_s = 10.0  # a failed read still running this long: disconnect
        self.num_descriptors = 0  # descriptors of the reads so far (merging at work)

    # -- set-up ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor], layers: range) -> None:
        """Register the pool with a new agent (its old name, and every lease, end: the blocks
        they named are gone). Peers learn the new name through ``peer_info``."""
        self.leases.end_all()
        self._drop_reads()
        super().register_kv_caches(kv_caches, layers)
        self._close_agent()
        layout = PoolLayout.of(kv_caches, layers)
        if self.ucx_tls is not None:  # read by UCX when the agent makes its backend
            os.environ["UCX_TLS"] = self.ucx_tls
        for key, value in UCX_DEFAULTS.items():  # unless this process's environment says
            os.environ.setdefault(key, value)
        name = f"tandem-kv-{uuid.uuid4().hex[:16]}"
        agent = _make_agent(self._api, name, self.backends, self.progress_wait_us)
        if not agent.backends:
            raise RuntimeError(f"NIXL has none of the backends {self.backends} here")
        # A slab of scratch space, registered too: what probes read into (never the cache).
        import torch

        self.scratch = torch.zeros(layout.slab, dtype=torch.uint8, device=kv_caches[0].device)
        regions: dict[int, Any] = {self.scratch.data_ptr(): layout.slab}
        for cache in kv_caches:
            storage = cache.untyped_storage()
            regions[storage.data_ptr()] = storage.nbytes()
        descs = [(addr, size, layout.device_id, "") for addr, size in regions.items()]
        self._registered = [agent.register_memory(descs, layout.mem_type)]
        self.agent, self.layout = agent, layout
        logger.info(
            "NIXL agent %s: %d MiB of %s registered (%d region(s))",
            agent.name,
            sum(regions.values()) >> 20,
            layout.mem_type,
            len(regions),
        )

    def peer_info(self) -> NixlPeer:
        if self.agent is None or self.layout is None:
            raise RuntimeError("register_kv_caches first")
        return NixlPeer(self.agent.name, bytes(self.agent.get_agent_metadata()), self.layout)

    def add_peers(self, peers: list[Any]) -> None:
        """Learn other workers' agents (idempotent; this worker's own is skipped)."""
        if self.agent is None:
            raise RuntimeError("register_kv_caches first")
        for peer in peers:
            if not isinstance(peer, NixlPeer) or peer.agent == self.agent.name:
                continue
            if peer.agent not in self._peers:
                try:
                    self.agent.add_remote_agent(peer.metadata)
                except Exception as exc:  # e.g. a worker that died since: reads from it fail
                    logger.warning(
                        "NIXL peer %s not added: %s: %s", peer.agent, type(exc).__name__, exc
                    )
                    continue
                self._peers[peer.agent] = peer.layout

    def num_peers(self) -> int:
        return len(self._peers)

    def remove_peers(self, names: list[str]) -> None:
        """Forget peers whose workers left (their endpoints and metadata go); one that a
        read in progress still reads from goes once no read does (``_poll_reads``)."""
        reading = {name for read in self._reads.values() for name in read.sources}
        for name in names:
            if name in reading:
                self._departed.add(name)
            elif name in self._peers:
                self._forget_peer(name)

    def probe(self, peer: NixlPeer, timeout_s: float = 5.0) -> None:
        """Read one slab of ``peer``'s block 0 into this worker's scratch slab (the caches
        are not touched: safe while both serve); raise if NIXL cannot reach the peer."""
        if self.agent is None or self.layout is None:
            raise RuntimeError("register_kv_caches first")
        self.add_peers([peer])
        mine, theirs = self.layout, peer.layout
        mine.check_compatible(theirs)
        scratch = self.scratch.data_ptr()
        local = np.array([[scratch, mine.slab, mine.device_id]], dtype=np.uint64)
        remote = np.array([[theirs.bases[0][0], mine.slab, theirs.device_id]], dtype=np.uint64)
        xfer = self.agent.initialize_xfer(
            "READ",
            self.agent.get_xfer_descs(local, mine.mem_type),
            self.agent.get_xfer_descs(remote, theirs.mem_type),
            peer.agent,
            b"probe",
        )
        deadline = time.monotonic() + timeout_s
        state = self._post(xfer)
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
            state = self._state(xfer)
        self._release(xfer)
        if state != "DONE":
            why = "timed out" if state == "PROC" else state
            raise ConnectionError(f"NIXL could not read from {peer.agent} ({why})")

    def close(self) -> None:
        self._drop_reads()
        self.leases.end_all()
        self._close_agent()
        super().close()

    def _close_agent(self) -> None:
        agent, self.agent = self.agent, None
        if agent is None:
            return
        for name in list(self._peers):
            with contextlib.suppress(Exception):  # already gone: nothing to undo
                agent.remove_remote_agent(name)
        self._peers.clear()
        self._departed.clear()
        for reg in self._registered:
            try:
                agent.deregister_memory(reg)
            except Exception as exc:
                logger.warning("NIXL deregister failed: %s", exc)
        self._registered = []

    # -- prefill side ----------------------------------------------------------------------
    def _publish(self, req_id: str, block_ids: list[int]) -> tuple[Any, int]:
        if self.agent is None or self.layout is None:
            raise RuntimeError("register_kv_caches first: no NIXL agent")
        expires_at = time.time() + self.lease_s
        lease_id = self.leases.add(req_id, block_ids, self.layers, self.lease_s)
        handle = NixlHandle(
            self.agent.name,
            lease_id,
            self.layers.start,
            self.layers.stop,
            tuple(block_ids),
            expires_at,
        )
        return handle, 2 * self.layout.slab * len(self.layers) * len(block_ids)

    def _finished_sending(self) -> set[str]:
        if self.agent is not None:
            try:
                notifs = self.agent.get_new_notifs()
            except Exception as exc:  # e.g. a reader that died: its notifications are lost
                logger.warning("NIXL notifications: %s: %s", type(exc).__name__, exc)
                notifs = {}
            for messages in notifs.values():
                for message in messages:
                    self._read_done(message)
        return self.leases.take_ended()

    def _read_done(self, message: bytes) -> None:
        """A reader's notification, ``lease_id:first:last``: those layers were read."""
        try:
            lease_id, first, last = message.decode().split(":")
            layers = range(int(first), int(last))
            self.leases.pin(lease_id, layers)
        except (KeyError, ValueError, UnicodeDecodeError):
            return  # an expired lease, or not one of ours
        self.leases.unpin(lease_id, layers, complete=True)

    # -- decode side -----------------------------------------------------------------------
    def start_load_kv(self, metadata: KVConnectorMetadata | None, idle: bool = False) -> None:
        """Post this step's READs; end the ones that finished (or ran out of time). ``idle``:
        nothing is computed this step, so wait a little (polling, with sleeps) for a read."""
        now, wall = time.monotonic(), time.time()
        for spec in metadata.loads if metadata else ():
            load = _Load(spec, None, now, now + spec.timeout_s, wall)
            self._delayed[spec.req_id] = (now + self.load_delay_s, load)
        for req_id, (post_at, load) in list(self._delayed.items()):
            if now >= load.deadline:
                del self._delayed[req_id]
                self._end_load(load, 0, f"timed out after {now - load.started:.1f}s")
            elif now >= post_at:
                del self._delayed[req_id]
                try:
                    self._reads[req_id] = self._start_read(load)
                except Exception as exc:
                    self._end_load(load, 0, f"{type(exc).__name__}: {exc}")
        self._poll_reads()
        if idle and self._reads and not self._delayed:
            # Nothing to compute: wait for a read, polling (the progress threads move the
            # data). Most reads take well under a millisecond: poll at once for the first
            # one, then every half millisecond, for at most 50 ms per idle step.
            start = time.monotonic()
            until = min(start + 0.05, min(r.load.deadline for r in self._reads.values()))
            before = len(self._reads)
            while self._reads and len(self._reads) == before:
                now = time.monotonic()
                if now >= until:
                    break
                time.sleep(0 if now - start < 0.001 else 0.0005)
                self._poll_reads()
        elif idle and self._delayed:
            time.sleep(0.005)

    def _start_read(self, load: _Load) -> _Read:
        """Check every segment and build its descriptors, then post the READs. Nothing is
        posted unless all of them can be: a failure before that writes nothing."""
        if self.agent is None or self.layout is None:
            raise RuntimeError("register_kv_caches first: no NIXL agent")
        spec, mine = load.spec, self.layout
        now, wall = time.monotonic(), time.time()
        lease_deadline = load.deadline
        planned: list[tuple[NixlHandle, Any, Any, bytes]] = []
        num_bytes = num_descriptors = covered = 0
        for segment in spec.handle:
            lo = max(segment.first_layer, self.layers.start)
            hi = min(segment.last_layer, self.layers.stop)
            if lo >= hi:
                continue  # another stage's layers
            handle = self._check_handle(segment, spec, wall)
            # The read must end before the lease does, less the margin (the source's clock).
            lease_deadline = min(
                lease_deadline, now + handle.expires_at - self.safety_margin_s - wall
            )
            source = self._peers[handle.agent]
            if lo < source.layers.start or hi > source.layers.stop:
                raise ValueError(
                    f"layers [{lo}, {hi}) were asked of a source holding {source.layers}"
                )
            first = spec.first_block
            src_ids = handle.block_ids[first : first + len(spec.block_ids)]
            dst_ids = spec.block_ids
            layers = range(lo, hi)
            span = mine.span(layers)
            if span is not None and span == source.span(layers):
                # Block-first caches: one span per block, adjacent blocks merged.
                local, remote = merge_spans(
                    source.block_addresses(src_ids, layers),
                    mine.block_addresses(dst_ids, layers),
                    span,
                    source.device_id,
                    mine.device_id,
                )
            else:
                local, remote = merge_descriptors(
                    source.addresses(np.array(src_ids), layers),
                    mine.addresses(np.array(dst_ids), layers),
                    mine.slab,
                    source.device_id,
                    mine.device_id,
                )
            descs = (
                self.agent.get_xfer_descs(local, mine.mem_type),
                self.agent.get_xfer_descs(remote, source.mem_type),
            )
            planned.append((handle, *descs, f"{handle.lease_id}:{lo}:{hi}".encode()))
            num_bytes += 2 * mine.slab * len(layers) * len(dst_ids)
            num_descriptors += len(local)
            covered += hi - lo
        if covered != len(self.layers):
            raise ValueError(
                f"the saved KV covers {covered} of this worker's {len(self.layers)} layers "
                f"({[s.layers for s in spec.handle]} vs {self.layers})"
            )
        # Every transfer is made (NIXL checks the descriptors, connects) before any is posted.
        made = []
        try:
            for handle, local_descs, remote_descs, notif in planned:
                made.append(
                    self.agent.initialize_xfer(
                        "READ", local_descs, remote_descs, handle.agent, notif
                    )
                )
        except Exception:
            for xfer in made:
                self._release(xfer)  # made, never posted
            raise
        sources = [handle.agent for handle, *_ in planned]
        read = _Read(load, [], num_bytes, num_descriptors, lease_deadline, sources)
        load.deadline = min(load.deadline, lease_deadline)
        for (handle, *_), xfer in zip(planned, made, strict=True):
            if read.error is not None:
                self._release(xfer)  # not posted: a failed read posts nothing more
                continue
            read.xfers.append(xfer)
            if self._post(xfer) == "ERR":
                read.error = f"the READ from {handle.agent} failed to start (is it gone?)"
        self.num_descriptors += num_descriptors
        if read.error is None:  # every READ posted
            self.num_reads_started += 1
        return read

    def _check_handle(self, segment: KVSegment, spec: LoadSpec, wall: float) -> NixlHandle:
        handle = segment.handle
        if not isinstance(handle, NixlHandle):
            raise TypeError(f"the nixl transport cannot read a {type(handle).__name__}")
        source = self._peers.get(handle.agent)
        if source is None:
            raise ConnectionError(f"unknown KV source {handle.agent} (not registered, or gone)")
        assert self.layout is not None
        self.layout.check_compatible(source)
        if len(handle.block_ids) < spec.first_block + len(spec.block_ids):
            raise ValueError(
                f"the source holds {len(handle.block_ids)} blocks, blocks "
                f"[{spec.first_block}, {spec.first_block + len(spec.block_ids)}) were asked for"
            )
        if wall >= handle.expires_at - self.safety_margin_s:
            raise TimeoutError("the source's lease has expired (or is about to)")
        return handle

    def _poll_reads(self) -> None:
        if self.agent is None:
            return
        if self._retired:  # transfers given up on: released once they end
            retired, self._retired = self._retired, []
            for xfers, caches in retired:
                still = [x for x in xfers if self._state(x) == "PROC"]
                for xfer in xfers:
                    if xfer not in still:
                        self._release(xfer)
                if still:
                    self._retired.append((still, caches))
        for req_id, read in list(self._reads.items()):
            states = [self._state(x) for x in read.xfers]
            now = time.monotonic()  # after the states: a check may have run the copy
            if read.error is None:
                if all(state == "DONE" for state in states):
                    if now > read.lease_deadline:
                        # Seen done only after the source may have freed the blocks: the
                        # data cannot be trusted (a step ran long; recompute instead).
                        read.error = "the read ended after the source's lease"
                    else:
                        del self._reads[req_id]
                        for xfer in read.xfers:
                            self._release(xfer)
                        seconds = now - read.load.started
                        self._end_load(read.load, read.num_bytes, None, seconds)
                        continue
                elif "ERR" in states:
                    read.error = "the READ failed (is the source gone?)"
                elif now >= read.load.deadline:
                    read.error = f"timed out after {now - read.load.started:.1f}s"
                else:
                    continue
            # Failed: reported only once nothing of it writes into the blocks any more (the
            # scheduler hands them to another request then). NIXL's release of a running UCX
            # transfer frees the request without stopping the copy, so a running one is never
            # released: it is waited for. One that still runs ``abort_grace_s`` past the
            # deadline has an unresponsive source: its endpoint is closed (which ends its
            # operations), and after as long again the load is given up on, with an error.
            running = []
            for xfer, state in zip(read.xfers, states, strict=True):
                if state == "PROC":
                    running.append(xfer)
                else:
                    self._release(xfer)
            read.xfers = running
            if not running:
                del self._reads[req_id]
                self._end_load(read.load, 0, read.error)
                continue
            overdue = now - read.load.deadline
            if overdue >= self.abort_grace_s and not read.disconnected:
                logger.warning(
                    "KV read of %s still running: disconnecting %s", req_id, read.sources
                )
                for name in read.sources:
                    self._forget_peer(name)
                read.disconnected = True
            elif overdue >= 2 * self.abort_grace_s:
                logger.error("KV read of %s never ended; giving up on it", req_id)
                del self._reads[req_id]
                self._retired.append((running, self.kv_caches))
                self._end_load(read.load, 0, read.error)
        if self._departed:
            self._forget_departed()

    def _forget_departed(self) -> None:
        reading = {name for read in self._reads.values() for name in read.sources}
        for name in [n for n in self._departed if n not in reading]:
            self._departed.discard(name)
            self._forget_peer(name)

    def _forget_peer(self, name: str) -> None:
        """Disconnect a peer (reads from it end); it is unknown until published again."""
        self._peers.pop(name, None)
        if self.agent is not None:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(name)

    def _post(self, xfer: Any) -> str:
        """Post a transfer: "DONE", "PROC" or "ERR" (NIXL raises for a peer it knows is
        gone, e.g. ``nixlRemoteDisconnectError``: that is an "ERR" too)."""
        try:
            return str(self.agent.transfer(xfer))
        except Exception as exc:
            logger.warning("NIXL transfer failed: %s: %s", type(exc).__name__, exc)
            return "ERR"

    def _state(self, xfer: Any) -> str:
        try:
            return str(self.agent.check_xfer_state(xfer))
        except Exception as exc:
            logger.warning("NIXL transfer failed: %s: %s", type(exc).__name__, exc)
            return "ERR"

    def _release(self, xfer: Any) -> None:
        """Release an ended transfer (never a running one: see ``_poll_reads``)."""
        with contextlib.suppress(Exception):
            xfer.release()

    def _drop_reads(self) -> None:
        """Forget every read (the cache goes: nobody waits for these requests any more). Its
        transfers still running keep the old cache alive until they end."""
        reads, self._reads = self._reads, {}
        self._delayed.clear()
        for read in reads.values():
            running = [x for x in read.xfers if self._state(x) == "PROC"]
            for xfer in read.xfers:
                if xfer not in running:
                    self._release(xfer)
            if running:
                self._retired.append((running, self.kv_caches))

    def num_loading(self) -> int:
        return len(self._reads) + len(self._delayed)

    def _fetch(self, handle: Any, layers: range, timeout_s: float) -> KVPayload:
        raise NotImplementedError("the nixl transport reads into the blocks in place")
