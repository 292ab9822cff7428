"""The decode side of the ``nixl`` transport (``nixl_transport.py``): posting a request's
READs straight into its blocks, polling them each step, and ending them -- done, failed, out
of time or past the source's lease -- without ever reporting blocks that a copy still writes
into.

A load becomes a ``_Read`` once its READs are posted: one transfer per segment of the handle
that overlaps this worker's layers, each made (descriptors checked, peer connected) before any
is posted. ``_poll_reads`` ends it: every transfer done before the source's lease (less the
margin) ends the load with its bytes; an error or the deadline fails it, but only once none of
its transfers runs any more (NIXL's release of a running UCX transfer does not stop its copy);
one that runs on long past the deadline has its source disconnected, and if it runs on even
then, the step fails (``KVReadStuck``): the blocks it may still write cannot go back to the
pool, so the instance fails over and its engine ends the worker's process, as a hung one's
(``cluster/control/engine_loop.py``): no late write can land anywhere then.

Transfers nobody waits for any more but that still run -- a read dropped with its cache, a
probe's given up on -- become ``_Retired``: kept, with the memory they write into and the
agent that posted them, and still ended by their deadline: past it, their sources are
disconnected through that agent (``_poll_retired``), which ends them, and the agent, the old
cache with it, can be undone.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kv_transfer.base import _Load
from kv_transfer.cma import SourceProcess
from kv_transfer.connector import KVReadStuck
from kv_transfer.nixl_layout import NixlHandle, PoolLayout, merge_descriptors, merge_spans
from kv_transfer.nixl_retired import NixlRetired, _Retired

if TYPE_CHECKING:
    from kv_transfer.connector import KVConnectorMetadata, KVSegment, LoadSpec

logger = logging.getLogger(__name__)


@dataclass
class _Read:
    load: _Load
    xfers: list[Any]  # NIXL transfer handles, posted
    num_bytes: int
    num_descriptors: int
    lease_deadline: float  # time.monotonic(): the data is trusted only if read before this
    sources: list[str] = field(default_factory=list)  # the agent each of ``xfers`` reads from
    error: str | None = None  # failed: reported once no transfer of it runs any more
    disconnected: bool = False  # its sources were disconnected (it ran far past its deadline)


class NixlReads(NixlRetired):
    """A ``NixlWorkerConnector`` as a reader (its base: the state is the connector's, set up by
    its ``__init__`` and ``register_kv_caches``)."""

    layout: PoolLayout | None  # this worker's pool
    safety_margin_s: float
    num_descriptors: int
    _peers: dict[str, PoolLayout]
    _departed: set[str]
    _reads: dict[str, _Read]
    _delayed: dict[str, tuple[float, _Load]]
    same_node_copy: bool  # copy from sources of this machine by CMA (``_copy``)
    _direct: dict[str, SourceProcess]  # agent name -> its process, where it can be read so
    num_direct_reads: int

    def _forget_peer(self, name: str) -> None:  # the connector's
        raise NotImplementedError

    def _reconnect(self, name: str) -> bool:  # the connector's
        raise NotImplementedError

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
                    read = self._start_read(load)
                except Exception as exc:
                    self._end_load(load, 0, f"{type(exc).__name__}: {exc}")
                else:
                    if read is not None:  # posted (None: copied already, ended)
                        self._reads[req_id] = read
        self._poll_reads()
        if idle and self._reads and not self._delayed:
            # Nothing to compute: wait for a read, polling (the progress threads move the
            # data). Most reads take well under a millisecond: poll at once for the first
            # one, then every half millisecond, for at most 50 ms per idle step.
            start = time.monotonic()
            # (Not the deadlines of reads that failed already: past, they ended every idle
            # step's wait at once while their transfers were waited out.)
            deadlines = [r.load.deadline for r in self._reads.values() if r.error is None]
            until = min([start + 0.05, *deadlines])
            before = len(self._reads)
            while self._reads and len(self._reads) == before:
                now = time.monotonic()
                if now >= until:
                    break
                time.sleep(0 if now - start < 0.001 else 0.0005)
                self._poll_reads()
        elif idle and self._delayed:
            time.sleep(0.005)

    def _start_read(self, load: _Load) -> _Read | None:
        """Check every segment and build its descriptors, then post the READs (None: the
        blocks were copied at once, ``_copy``, and the load has ended). Nothing is posted
        unless all of them can be: a failure before that writes nothing."""
        if self.agent is None or self.layout is None:
            raise RuntimeError("register_kv_caches first: no NIXL agent")
        spec, mine = load.spec, self.layout
        now, wall = time.monotonic(), time.time()
        lease_deadline = load.deadline
        planned: list[tuple[NixlHandle, np.ndarray, np.ndarray, bytes]] = []
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
            if first < 0 or len(src_ids) != len(dst_ids):
                raise ValueError(f"blocks [{first}, +{len(dst_ids)}) of {len(handle.block_ids)}")
            # (NIXL refuses descriptors outside registered memory; a copy would not.)
            if min(min(src_ids, default=0), min(dst_ids, default=0)) < 0 or (
                max(src_ids, default=0) >= source.num_blocks
                or max(dst_ids, default=0) >= mine.num_blocks
            ):
                raise ValueError(
                    f"block ids out of range: {src_ids} of {source.num_blocks} at the source, "
                    f"{dst_ids} of {mine.num_blocks} here"
                )
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
            planned.append((handle, local, remote, f"{handle.lease_id}:{lo}:{hi}".encode()))
            num_bytes += 2 * mine.slab * len(layers) * len(dst_ids)
            num_descriptors += len(local)
            covered += hi - lo
        if covered != len(self.layers):
            raise ValueError(
                f"the saved KV covers {covered} of this worker's {len(self.layers)} layers "
                f"({[s.layers for s in spec.handle]} vs {self.layers})"
            )
        load.deadline = min(load.deadline, lease_deadline)
        if self.same_node_copy and all(h.agent in self._direct for h, *_ in planned):
            self._copy(load, planned, num_bytes)
            return None
        # Every transfer is made (NIXL checks the descriptors, connects) before any is posted.
        made = []
        try:
            for handle, local, remote, notif in planned:
                made.append(
                    self.agent.initialize_xfer(
                        "READ",
                        self.agent.get_xfer_descs(local, mine.mem_type),
                        self.agent.get_xfer_descs(remote, self._peers[handle.agent].mem_type),
                        handle.agent,
                        notif,
                    )
                )
        except Exception:
            for xfer in made:
                self._release(xfer)  # made, never posted
            raise
        read = _Read(load, [], num_bytes, num_descriptors, lease_deadline)
        for (handle, *_), xfer in zip(planned, made, strict=True):
            if read.error is not None:
                self._release(xfer)  # not posted: a failed read posts nothing more
                continue
            read.xfers.append(xfer)
            read.sources.append(handle.agent)
            if self._post(xfer) == "ERR":
                read.error = f"the READ from {handle.agent} failed to start (is it gone?)"
        self.num_descriptors += num_descriptors
        if read.error is None:  # every READ posted
            self.num_reads_started += 1
        return read

    def _copy(
        self,
        load: _Load,
        planned: list[tuple[NixlHandle, np.ndarray, np.ndarray, bytes]],
        num_bytes: int,
    ) -> None:
        """The same-node path (``kv_transfer/cma.py``): every source is a process of this
        machine that this one may read, so the spans are copied now, one copy call per
        source (between two checks of its token), and each source is told, as a READ's
        notification would, which layers were read. A copy that ends after the source's
        lease (less the margin) is not trusted."""
        self.num_reads_started += 1
        for handle, local, remote, notif in planned:
            source = self._direct[handle.agent]
            try:
                source.read(local, remote)
            except OSError as exc:
                # Gone, its cache replaced, or refused: this source is read by NIXL from now
                # on (which fails too if it is gone, or times out).
                logger.warning("same-node copy from %s failed: %s", handle.agent, str(exc))
                self._direct.pop(handle.agent, None)
                source.close()
                raise
            if time.monotonic() > load.deadline:  # the lease's margin, or the load's own
                raise TimeoutError("the copy ended past its deadline (the source's lease)")
            try:  # at once: if another source fails, this one need not wait for expiry
                self.agent.send_notif(handle.agent, notif)
            except Exception as exc:  # the source's lease then ends by expiry
                logger.warning("KV read notification to %s: %s", handle.agent, str(exc))
        self.num_direct_reads += 1
        self.num_descriptors += sum(len(local) for _, local, _, _ in planned)
        self._end_load(load, num_bytes, None, time.monotonic() - load.started)

    def _check_handle(self, segment: KVSegment, spec: LoadSpec, wall: float) -> NixlHandle:
        handle = segment.handle
        if not isinstance(handle, NixlHandle):
            raise TypeError(f"the nixl transport cannot read a {type(handle).__name__}")
        source = self._peers.get(handle.agent)
        if source is None and self._reconnect(handle.agent):
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
        self._poll_retired()
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
                    load = read.load
                    if load.deadline < load.started + load.spec.timeout_s - 1e-3:
                        read.error += (
                            " (before its timeout_s: the source's lease, less the safety "
                            "margin, ended first -- the hand-off waited before its read; "
                            "kv_transfer.lease_s sets the lease)"
                        )
                else:
                    continue
            # Failed: reported only once nothing of it writes into the blocks any more (the
            # scheduler hands them to another request then). NIXL's release of a running UCX
            # transfer frees the request without stopping the copy, so a running one is never
            # released: it is waited for. One that still runs ``abort_grace_s`` past the
            # deadline has an unresponsive source: its endpoint is closed (which ends its
            # operations). One still running after as long again may write into its blocks
            # at any time: reporting the load would hand them to another request, so the
            # step fails instead (``KVReadStuck``). The instance fails over and its engine
            # ends this worker's process, as a hung worker's (Ray restarts it under
            # ``max_restarts``).
            running, sources = [], []
            for xfer, source, state in zip(read.xfers, read.sources, states, strict=True):
                if state == "PROC":
                    running.append(xfer)
                    sources.append(source)
                else:
                    self._release(xfer)
            read.xfers, read.sources = running, sources
            if not running:
                del self._reads[req_id]
                self._end_load(read.load, 0, read.error)
                continue
            overdue = now - read.load.deadline
            if overdue >= self.abort_grace_s and not read.disconnected:
                logger.warning(
                    "KV read of %s still running: disconnecting %s", req_id, read.sources
                )
                for name in dict.fromkeys(read.sources):  # (only the stuck transfers' sources)
                    self._disconnect_peer(name)
                read.disconnected = True
            elif overdue >= 2 * self.abort_grace_s:
                raise KVReadStuck(
                    f"the KV read of {req_id} still runs {overdue:.1f}s past its deadline, "
                    f"its source disconnected ({read.error}): its blocks may still be "
                    "written, so this worker's cache cannot be reused"
                )
        if self._departed:
            self._forget_departed()

    def _forget_departed(self) -> None:
        reading = {name for read in self._reads.values() for name in read.sources}
        for name in [n for n in self._departed if n not in reading]:
            self._departed.discard(name)
            self._forget_peer(name)

    def _post(self, xfer: Any) -> str:
        """Post a transfer: "DONE", "PROC" or "ERR" (NIXL raises for a peer it knows is
        gone, e.g. ``nixlRemoteDisconnectError``: that is an "ERR" too)."""
        try:
            return str(self.agent.transfer(xfer))
        except Exception as exc:
            # Logged as text, here and in every NIXL module: a record holding the exception
            # (pytest keeps them) kept its traceback's frames, their transfer handles, and so
            # the agent's C++ side alive, to end at some later moment under UCX's feet.
            logger.warning("NIXL transfer failed: %s: %s", type(exc).__name__, str(exc))
            return "ERR"

    def _drop_reads(self) -> None:
        """Forget every read (the cache goes: nobody waits for these requests any more, and
        they are not reported: the next cache comes with a fresh scheduler). Its transfers
        still running keep the old cache alive until they end; their deadline and sources
        go with them (``_Retired``), so one whose source hangs is still ended."""
        reads, self._reads = self._reads, {}
        self._delayed.clear()
        now = time.monotonic()
        for read in reads.values():
            running, sources = [], []
            for xfer, source in zip(read.xfers, read.sources, strict=True):
                if self._state(xfer) == "PROC":
                    running.append(xfer)
                    sources.append(source)
                else:
                    self._release(xfer)
            if running:
                entry = _Retired(running, sources, self.kv_caches, self.agent, read.load.deadline)
                if read.disconnected:  # (already, as a live read: at about its deadline + grace)
                    entry.disconnected_at = min(now, read.load.deadline + self.abort_grace_s)
                self._retired.append(entry)

    def num_loading(self) -> int:
        return len(self._reads) + len(self._delayed)
