"""The ``nixl`` transport's transfers that nobody waits for any more but that may still run
(``_Retired``: a read dropped with its cache, a probe's given up on), and the agents they
keep busy: ``NixlRetired`` polls them, disconnects the sources of those past their deadline
through the agent that posted them, and ends the replaced agents none of whose transfers
runs any more (a mixin of the worker connector, as ``NixlReads``, its subclass, is)."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from kv_transfer.base import WorkerConnector

logger = logging.getLogger(__name__)


@dataclass
class _Retired:
    """Transfers nobody waits for any more that still ran when they were given up on: a
    dropped read's (its cache replaced, the connector closed) or a probe's that timed out.
    Never released while they run (NIXL's release does not stop a UCX copy): kept with the
    memory they write into and the agent that posted them, which alone can tell their state
    and close their endpoints (it may no longer be this worker's agent). Past ``deadline``
    their sources are disconnected through that agent (``_poll_retired``): that ends them,
    and with them what keeps the agent, and the old cache it registered, alive."""

    xfers: list[Any]
    sources: list[str]  # the agent each of ``xfers`` reads from
    keep: list[Any]  # what they write into, kept alive while they run
    agent: Any  # the agent that posted them
    deadline: float  # time.monotonic(): the read's deadline, or the probe's
    disconnected_at: float | None = None  # when their sources were disconnected
    stuck: bool = False  # still running long after that (logged once)


class NixlRetired(WorkerConnector):
    """Retired transfers and replaced agents (the state is the connector's)."""

    agent: Any  # the NIXL agent (None before registration)
    abort_grace_s: float
    # Transfers still running when their cache was replaced (or a probe gave up on them):
    # see ``_Retired``.
    _retired: list[_Retired]
    # Probes' transfers being watched (``probe``, outside the worker's step lock), in the
    # same form: their agents are busy as retired ones' are.
    _probing: list[_Retired]
    # Agents replaced while reads they posted ran: (agent, its peers, its registrations,
    # the memory they registered -- kept alive: peers may still read it, and a probe's
    # entry holds only its scratch slab), undone once none of their reads runs
    # (``_end_agent``).
    _closing: list[tuple[Any, list[str], list[Any], Any]]

    def _disconnect_peer(self, name: str) -> None:  # the connector's
        raise NotImplementedError

    def _end_agent(self, agent: Any, peers: list[str], registered: list[Any]) -> None:
        raise NotImplementedError  # the connector's

    def _poll_retired(self) -> None:
        """Release the transfers of an old cache or a probe that ended; disconnect the
        sources of those still running past their deadline, through the agent that posted
        them; then end the replaced agents none of whose transfers runs any more."""
        if self._retired:
            retired, self._retired = self._retired, []
            for entry in retired:
                states = [self._state(x, entry.agent) for x in entry.xfers]
                running, sources = [], []
                for xfer, source, state in zip(entry.xfers, entry.sources, states, strict=True):
                    if state == "PROC":
                        running.append(xfer)
                        sources.append(source)
                    else:
                        self._release(xfer)
                if not running:
                    continue
                entry.xfers, entry.sources = running, sources
                self._retired.append(entry)
                self._time_out_retired(entry)
        self._end_idle_agents()

    def _time_out_retired(self, entry: _Retired) -> None:
        """A retired transfer past its deadline has its sources disconnected through the
        agent that posted it (closing the endpoint ends its operations). An agent replaced
        (or closed) serves no read any more: at once, nothing else uses its endpoints; this
        worker's own agent (a probe's): ``abort_grace_s`` later, as a live read's, since the
        disconnect fails every read from that source for ``reconnect_after_s``. Still
        running ``abort_grace_s`` after that: logged once, and kept -- never released nor
        freed under its copy (the memory is another cache's or a scratch slab: this one's
        blocks are not written)."""
        now = time.monotonic()
        if entry.disconnected_at is None:
            current = self.agent is not None and entry.agent is self.agent
            if now < entry.deadline + (self.abort_grace_s if current else 0.0):
                return
            logger.warning(
                "NIXL transfer given up on still running past its deadline: disconnecting %s",
                sorted(set(entry.sources)),
            )
            for name in dict.fromkeys(entry.sources):
                if current:
                    self._disconnect_peer(name)  # connected again later (``_reconnect``)
                else:
                    with contextlib.suppress(Exception):  # already gone: nothing to undo
                        entry.agent.remove_remote_agent(name)
            entry.disconnected_at = now
        elif not entry.stuck and now >= entry.disconnected_at + self.abort_grace_s:
            entry.stuck = True
            logger.error(
                "NIXL transfer from %s still runs %.1f s after its source was disconnected: "
                "the memory it writes into, and its agent, stay until it ends",
                sorted(set(entry.sources)),
                now - entry.disconnected_at,
            )

    def _end_idle_agents(self) -> None:
        """End the replaced agents none of whose transfers runs any more."""
        if self._closing:
            busy = [entry.agent for entry in (*self._retired, *self._probing)]
            closing, self._closing = self._closing, []
            for item in closing:
                if any(agent is item[0] for agent in busy):
                    self._closing.append(item)
                else:
                    self._end_agent(*item[:3])

    def _state(self, xfer: Any, agent: Any = None) -> str:
        try:
            return str((agent or self.agent).check_xfer_state(xfer))
        except Exception as exc:
            logger.warning("NIXL transfer failed: %s: %s", type(exc).__name__, str(exc))
            return "ERR"

    def _release(self, xfer: Any) -> None:
        """Release an ended transfer (never a running one: see ``_poll_reads``). A handle NIXL
        would not release holds its agent's C++ side past ``_end_agent``: logged."""
        try:
            xfer.release()
        except Exception as exc:
            logger.warning("NIXL transfer not released: %s: %s", type(exc).__name__, str(exc))
