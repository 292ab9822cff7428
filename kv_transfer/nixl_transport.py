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

Decode side (``nixl_reads.py``): ``start_load_kv`` builds, per segment of the handle that
overlaps the worker's layers, one transfer: a descriptor per (layer, K or V, block) pair on
both sides, merged where both are contiguous. With the block-first cache
(``kv_transfer.blocks.allocate_kv_caches``) a block's layers are one span, so a run of adjacent
blocks on both sides is one descriptor; a pipeline stage reads its own layer range. The READ
is posted at once (no thread); each step polls it. When it is done, its notification tells
the source which layers were read, and the request's blocks are reported received; an
error, or the deadline, reports it failed and the scheduler's ``failure_policy`` applies
(recompute or fail).

One-sided reads need one rule the pull transports do not: the source cannot see a read in
progress, so it frees on its own clock. A read therefore starts only while the lease has
``safety_margin_s`` left, and one not done when that margin is reached fails (it is waited
for, never released while it runs, and its data discarded; the decode side then
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
import logging
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, ClassVar

from kv_transfer.base import _Load
from kv_transfer.blocks import KVPayload
from kv_transfer.cma import SourceProcess, Token, TokenHolder
from kv_transfer.leases import LeaseTable
from kv_transfer.nixl_layout import (
    NixlHandle,
    NixlPeer,
    PoolLayout,
    merge_descriptors,
    merge_spans,
)
from kv_transfer.nixl_package import MISSING, nixl_api, nixl_available
from kv_transfer.nixl_peers import NixlPeers
from kv_transfer.nixl_reads import _Read
from kv_transfer.nixl_retired import _Retired

if TYPE_CHECKING:
    import torch


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


class NixlWorkerConnector(NixlPeers):
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
        same_node_copy: bool = True,
    ) -> None:
        super().__init__(max_parallel_loads)
        if lease_s <= safety_margin_s or safety_margin_s < 0:
            raise ValueError("lease_s must be > safety_margin_s >= 0")
        self._api = nixl_api()
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
        # Peers disconnected after a read from them got stuck (they did not leave), and when:
        # connected again when a hand-off names them ``reconnect_after_s`` later, rather than
        # unknown until they rejoin (sooner, its loads fail at once: a path still broken
        # would hold every read to its deadline and past).
        self._disconnected: dict[str, tuple[NixlPeer, float]] = {}
        self.reconnect_after_s = 30.0
        self._peer_infos: dict[str, NixlPeer] = {}  # agent name -> what it published
        self._reads: dict[str, _Read] = {}
        # Loads not posted yet: (when to post, the load). Only ``load_delay_s`` (fault
        # injection in tests) keeps one here past the step that brought it.
        self._delayed: dict[str, tuple[float, _Load]] = {}
        self._retired: list[_Retired] = []  # (see nixl_retired)
        self._closing: list[tuple[Any, list[str], list[Any], Any]] = []  # (see nixl_retired)
        self._probing: list[_Retired] = []  # (see nixl_retired)
        # Held around each use of the agent by another thread (a probe's: its caller's lock)
        self._guard: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        self.abort_grace_s = 10.0  # a failed read still running this long: disconnect
        self.num_descriptors = 0  # descriptors of the reads so far (merging at work)
        # Reads from a worker of this machine by one kernel copy, not a NIXL READ
        # (``kv_transfer/cma.py``); not where UCX's transports are restricted (``ucx_tls``):
        # the copy is the one UCX's CMA transport makes.
        self.same_node_copy = same_node_copy and ucx_tls is None
        self._token = TokenHolder()  # how a reader of this machine finds this process
        self._published: Token | None = None  # the token peer_info gives with this agent
        self._direct: dict[str, SourceProcess] = {}
        self.num_direct_reads = 0

    # -- set-up ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[torch.Tensor], layers: range) -> None:
        """Register the pool with a new agent (its old name, and every lease, end unreported:
        the blocks they named are gone). Peers learn the new name through ``peer_info``."""
        self.retire_caches()  # first: a same-node copy of the old cache fails from now on
        self.leases.end_all()
        self._drop_reads()
        # The old agent goes first: it deregisters the old cache while this still holds it.
        # ``super()`` drops the last reference, and memory freed while still registered may
        # be unmapped or handed out again under UCX and a peer's READ.
        self._close_agent()
        super().register_kv_caches(kv_caches, layers)
        layout = PoolLayout.of(kv_caches, layers)
        if self.ucx_tls is not None:  # read by UCX when the agent makes its backend
            os.environ["UCX_TLS"] = self.ucx_tls
        for key, value in UCX_DEFAULTS.items():  # unless this process's environment says
            os.environ.setdefault(key, value)
        name = f"tandem-kv-{uuid.uuid4().hex[:16]}"
        agent = _make_agent(self._api, name, self.backends, self.progress_wait_us)
        try:
            if not agent.backends:
                raise RuntimeError(f"NIXL has none of the backends {self.backends} here")
            # A slab of scratch space, registered too: what probes read into (never the cache).
            import torch

            device = kv_caches[0].device
            self.scratch = torch.zeros(layout.slab, dtype=torch.uint8, device=device)
            regions: dict[int, Any] = {self.scratch.data_ptr(): layout.slab}
            for cache in kv_caches:
                storage = cache.untyped_storage()
                regions[storage.data_ptr()] = storage.nbytes()
            descs = [(addr, size, layout.device_id, "") for addr, size in regions.items()]
            self._registered = [agent.register_memory(descs, layout.mem_type)]
        except BaseException:
            _end_agent(agent, [], [])  # now: the traceback would keep it for the collector
            raise
        self.agent, self.layout = agent, layout
        self._published = self._token.token  # published with this agent, as one pair
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
        return NixlPeer(
            self.agent.name, bytes(self.agent.get_agent_metadata()), self.layout, self._published
        )

    def retire_caches(self) -> None:
        """A new token: copies of the current cache by same-node readers fail from now on
        (they check it after copying); the token published with the next agent is the new
        one. Called before the cache can change hands (``register_kv_caches``, the worker's
        ``init_kv_cache``)."""
        self._token.renew()
        self._published = None

    def release_caches(self) -> None:
        """As ``close``, the agent's: it deregisters the cache while still held (memory freed
        while registered could be read by a peer); reads and probes still running keep what
        they use (``_retired``, ``_closing``). ``register_kv_caches`` makes a new one."""
        self.retire_caches()
        self.leases.end_all()
        self._drop_reads()
        self._close_agent()
        super().release_caches()

    def close(self) -> None:
        self._token.clear()  # first: no same-node copy of this cache succeeds from now on
        self._drop_reads()
        self.leases.end_all()
        self._close_agent()
        super().close()
        if self._retired or self._probing or self._closing:  # transfers still running
            _linger(self)

    def _close_agent(self) -> None:
        agent, self.agent = self.agent, None
        if agent is None:
            return
        peers = list(self._peers)
        self._peers.clear()
        self._peer_infos.clear()
        self._disconnected.clear()
        self._departed.clear()
        for source in self._direct.values():
            source.close()
        self._direct.clear()
        registered, self._registered = self._registered, []
        if any(entry.agent is agent for entry in (*self._retired, *self._probing)):
            # Its reads still running (a replaced cache's, a probe's) write into memory it
            # registered, from peers it knows: both stay until they end (``_poll_reads``).
            self._closing.append((agent, peers, registered, (self.kv_caches, self.scratch)))
        else:
            _end_agent(agent, peers, registered)

    def _end_agent(self, agent: Any, peers: list[str], registered: list[Any]) -> None:
        _end_agent(agent, peers, registered)

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
                logger.warning("NIXL notifications: %s: %s", type(exc).__name__, str(exc))
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

    def _fetch(self, handle: Any, layers: range, timeout_s: float) -> KVPayload:
        raise NotImplementedError("the nixl transport reads into the blocks in place")


def _end_agent(agent: Any, peers: list[str], registered: list[Any]) -> None:
    """Undo what an agent set up, then end it, in NIXL's order: its peers (their endpoints
    close), its memory registrations, the agent (its progress thread, its UCX worker). A
    ``nixl_agent`` has no close: its C++ side ends with the last reference to it, dropped
    here -- the Python object may live on (a variable, a log record's traceback, a cycle)
    until the garbage collector ends it at some later moment, in another test or thread, and
    UCX aborts the process when it destroys an endpoint with work still queued. Callers end
    an agent only once none of its transfers runs (a handle not released would hold it)."""
    for name in peers:
        with contextlib.suppress(Exception):  # already gone: nothing to undo
            agent.remove_remote_agent(name)
    for reg in registered:
        try:
            agent.deregister_memory(reg)
        except Exception as exc:
            logger.warning("NIXL deregister failed: %s", str(exc))
    agent.agent = None  # the binding's last reference: the agent ends here, in this thread


# Closed connectors whose transfers still ran (a probe's that timed out, a dropped read's):
# kept here, so the memory those write into outlives them, and polled until every one has
# ended and their agents are undone -- closed, nothing else polls them. (Polling also
# disconnects the sources of those past their deadline, through their agents: a hung peer
# does not keep a closed connector here for good.)
_lingering: list[NixlWorkerConnector] = []
_lingering_lock = threading.Lock()
LINGER_POLL_S = 0.2


def _linger(connector: NixlWorkerConnector) -> None:
    with _lingering_lock:
        _lingering.append(connector)
        if len(_lingering) == 1:  # no reaper runs
            threading.Thread(target=_reap, name="nixl-linger", daemon=True).start()


def _reap() -> None:
    while True:
        time.sleep(LINGER_POLL_S)
        with _lingering_lock:
            connectors = list(_lingering)
        ended = []
        for connector in connectors:
            with connector._guard:  # a probe may still be watching its read
                connector._poll_retired()
                if not (connector._retired or connector._probing or connector._closing):
                    ended.append(connector)
        with _lingering_lock:
            for connector in ended:
                _lingering.remove(connector)
            if not _lingering:
                return
