"""The peers of a ``NixlWorkerConnector``: learning other workers' agents (``add_peers``),
forgetting those that left, a probe read, and connecting again a peer disconnected after a
stuck read (a mixin: the state is the connector's, set up by its ``__init__``)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import numpy as np

from kv_transfer.cma import SourceProcess
from kv_transfer.nixl_layout import NixlPeer
from kv_transfer.nixl_reads import NixlReads
from kv_transfer.nixl_retired import _Retired

logger = logging.getLogger(__name__)


class NixlPeers(NixlReads):
    """Peer bookkeeping of a ``NixlWorkerConnector``."""

    _peer_infos: dict[str, NixlPeer]
    _disconnected: dict[str, tuple[NixlPeer, float]]
    reconnect_after_s: float
    scratch: Any

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
                        "NIXL peer %s not added: %s: %s", peer.agent, type(exc).__name__, str(exc)
                    )
                    continue
                self._peers[peer.agent] = peer.layout
                self._peer_infos[peer.agent] = peer
                self._disconnected.pop(peer.agent, None)
                # Host memory only (the kernel copy cannot read VRAM): both pools in DRAM.
                assert self.layout is not None
                dram = peer.layout.mem_type == self.layout.mem_type == "DRAM"
                if self.same_node_copy and dram and peer.same_host is not None:
                    source = SourceProcess.attach(peer.same_host)
                    if source is not None:
                        self._direct[peer.agent] = source

    def num_peers(self) -> int:
        return len(self._peers)

    def remove_peers(self, names: list[str]) -> None:
        """Forget peers whose workers left (their endpoints and metadata go); one that a
        read in progress still reads from goes once no read does (``_poll_reads``)."""
        reading = {name for read in self._reads.values() for name in read.sources}
        for name in names:
            self._disconnected.pop(name, None)
            if name in reading:
                self._departed.add(name)
            elif name in self._peers:
                self._forget_peer(name)

    def probe(
        self,
        peer: NixlPeer,
        timeout_s: float = 5.0,
        lock: contextlib.AbstractContextManager[Any] | None = None,
    ) -> None:
        """Read one slab of ``peer``'s block 0 into this worker's scratch slab (the caches
        are not touched: safe while both serve); raise if NIXL cannot reach the peer.
        ``lock``: held around each use of the agent, not while the read is waited for (the
        serving worker's step lock: its steps go on while a peer that cannot be reached
        holds the probe to its timeout)."""
        guard = lock if lock is not None else contextlib.nullcontext()
        if lock is not None:
            self._guard = lock  # what guards the agent from here on (``linger``)
        with guard:
            if self.agent is None or self.layout is None:
                raise RuntimeError("register_kv_caches first")
            self.add_peers([peer])
            mine, theirs = self.layout, peer.layout
            mine.check_compatible(theirs)
            agent, scratch = self.agent, self.scratch
            local = np.array([[scratch.data_ptr(), mine.slab, mine.device_id]], dtype=np.uint64)
            remote = np.array([[theirs.bases[0][0], mine.slab, theirs.device_id]], dtype=np.uint64)
            xfer = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local, mine.mem_type),
                agent.get_xfer_descs(remote, theirs.mem_type),
                peer.agent,
                b"probe",
            )
            deadline = time.monotonic() + timeout_s
            state = self._post(xfer)
            # Watched: its agent and scratch stay while it runs, whatever a step does; given
            # up on, its peer is disconnected through its agent after the deadline.
            watched = _Retired([xfer], [peer.agent], [scratch], agent, deadline)
            self._probing.append(watched)
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.001)
            with guard:
                state = self._state(xfer, agent)
        with guard:
            self._probing = [w for w in self._probing if w is not watched]
            if state == "PROC":  # still copying: released once it ends (or is disconnected)
                self._retired.append(watched)
            else:
                self._release(xfer)
                self._end_idle_agents()  # its agent, replaced (or closed) meanwhile
        if state != "DONE":
            why = "timed out" if state == "PROC" else state
            raise ConnectionError(f"NIXL could not read from {peer.agent} ({why})")

    def _forget_peer(self, name: str) -> None:
        """Disconnect a peer (reads from it end); it is unknown until published again."""
        self._peers.pop(name, None)
        self._peer_infos.pop(name, None)
        source = self._direct.pop(name, None)
        if source is not None:
            source.close()
        if self.agent is not None:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(name)

    def _disconnect_peer(self, name: str) -> None:
        """End the reads from a peer that stopped answering (its endpoint closes); it is
        connected again when a hand-off next names it (``_reconnect``)."""
        peer = self._peer_infos.get(name)
        self._forget_peer(name)
        if peer is not None:
            self._disconnected[name] = (peer, time.monotonic())

    def _reconnect(self, name: str) -> bool:
        """Connect again a peer disconnected after a stuck read, once ``reconnect_after_s``
        have passed (``ConnectionError`` before: the load fails at once)."""
        found = self._disconnected.get(name)
        if found is None:
            return False
        peer, since = found
        wait = since + self.reconnect_after_s - time.monotonic()
        if wait > 0:
            raise ConnectionError(
                f"KV source {name} was disconnected after a read from it got stuck; "
                f"connecting again in {wait:.0f} s"
            )
        del self._disconnected[name]
        logger.info("NIXL peer %s: connecting again after a stuck read", name)
        self.add_peers([peer])
        return name in self._peers
