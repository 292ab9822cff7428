"""The cores of one machine shared by the workers on it: no core sits idle while another
worker could use it.

Each worker with ``num_threads: auto`` takes a slot in a small shared-memory table (one per
user and machine, ``/dev/shm``) and flags itself busy while it runs a step. Before each step
and between the model's layers it sets torch's threads to an even share of the machine's cores
among the busy workers: a decode instance alone on a 2-core machine runs with 2 threads, and
drops to 1 within a layer once the prefill instance starts a step (and back when it ends, plus
a few milliseconds of grace: the gap between one worker's steps is not an idle machine).
OpenMP teams that outnumber the cores spin against each other at every barrier (two 2-thread
workers busy together on 2 cores ran 100x slower than two 1-thread ones), so the share is
recomputed often and cheaply: one 256-byte read per layer.

A slot is held with an advisory record lock for the process's life, so a worker
that dies frees its slot; a busy flag it left behind is ignored once its pid is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

SLOTS = 256
# A worker counts as busy this long after its step ends: the gap before its next step (the
# scheduler's turn) must not hand its cores to another worker's step for a moment.
GRACE_S = 0.005
# A slot's flag while its worker steps: on a share of the cores, or on one thread; and after
# a step on one thread (0 after a shared one), for the grace that follows it.
SHARING, ONE_THREAD, AFTER_ONE_THREAD = 1, 2, 3
# Steps of fewer tokens run on one thread: served, a decode step overlaps the control plane's
# work on the previous token (scheduler, ingress, HTTP), and a 2-thread team on a 2-core
# machine then loses a thread at its barriers -- measured slower than one thread (ITL 18.7 vs
# 13.5 ms at concurrency 1). Prefill-sized steps gain (a 128-token prefill: 58 vs 100 ms).
MIN_STEP_TOKENS = 64
_PIDS = SLOTS  # the pid table (int32) starts after the busy flags (uint8)
_ENDS = _PIDS + 4 * SLOTS  # then when each slot's last step ended (float64, monotonic)
_SIZE = _ENDS + 8 * SLOTS


def machine_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by its cgroup's CPU quota
    (a Kubernetes pod's CPU limit, Docker's ``--cpus``: with more threads than the quota
    allows, the kernel stalls them every period), rounded down, at least one."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    return cores


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"), own: str | None = None) -> float | None:
    """The CPUs this process's cgroup may use (quota / period: 1.5 for a 1500m limit), or
    None if it has no limit. cgroup v2 (``cpu.max``) or v1 (``cpu.cfs_quota_us`` and
    ``cpu.cfs_period_us``), in the cgroup that ``own`` (``/proc/self/cgroup``'s text)
    names under ``root`` and its ancestors, the smallest (or ``root`` itself: a container
    sees its own cgroup there)."""
    if own is None:
        try:
            own = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    v2_path: str | None = None
    v1_path: str | None = None
    for line in own.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[1] == "":
            v2_path = parts[2]
        elif "cpu" in parts[1].split(","):
            v1_path = parts[2]
    limits = []
    if v2_path is not None:  # (a hybrid v1/v2 host mounts v2 under "unified")
        limits.append(_first(_v2_limit, [root, root / "unified"], v2_path))
    if v1_path is not None:
        mounts = [root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"]
        limits.append(_first(_v1_limit, mounts, v1_path))
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def _first(read: Any, bases: list[Path], path: str) -> float | None:
    """The smallest limit ``read`` finds in the cgroup ``path`` and its ancestors (a limit on
    a parent binds its children too), under the first of ``bases`` that has any; each base
    itself counts (a container sees its own cgroup at the mount's root)."""
    parts = [p for p in path.split("/") if p]
    for base in bases:
        directories = [base.joinpath(*parts[:n]) for n in range(len(parts), 0, -1)] + [base]
        answers = [read(d) for d in directories]
        found = [a for a in answers if a is not _MISSING]
        if found:
            limits = [a for a in found if a is not None]
            return min(limits) if limits else None
    return None


_MISSING = object()


def _v2_limit(directory: Path) -> Any:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return _MISSING
    if quota == "max" or float(period) <= 0:
        return None
    return float(quota) / float(period)


def _v1_limit(directory: Path) -> Any:
    try:
        quota = float((directory / "cpu.cfs_quota_us").read_text())
        period = float((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return _MISSING
    if quota <= 0 or period <= 0:  # -1: no limit
        return None
    return quota / period


def _lock_byte(fd: int, offset: int) -> None:
    """An exclusive write lock on one byte, held by this open file (Linux's open-file-
    description locks: two tables opened in one process conflict too), else by the process."""
    ofd = getattr(fcntl, "F_OFD_SETLK", None)
    if ofd is None:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
        return
    # struct flock: l_type, l_whence (short), l_start, l_len (off_t), l_pid (0 for OFD locks)
    fcntl.fcntl(fd, ofd, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0))


def _table_path() -> Path:
    root = Path("/dev/shm")
    if not root.is_dir() or not os.access(root, os.W_OK):
        root = Path(tempfile.gettempdir())
    return root / f"tandem-cores-{os.getuid()}"


class CoreShare:
    """This worker's view of the machine's cores (see the module's docstring)."""

    def __init__(
        self,
        cores: int | None = None,
        path: Path | None = None,
        min_step_tokens: int = MIN_STEP_TOKENS,
    ) -> None:
        self.cores = cores or machine_cores()
        self.min_step_tokens = min_step_tokens
        self.path = path or _table_path()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < _SIZE:
                os.ftruncate(fd, _SIZE)
            self._mm = mmap.mmap(fd, _SIZE)
            self.slot = self._claim(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._pid = os.getpid()
        struct.pack_into("<i", self._mm, _PIDS + 4 * self.slot, self._pid)
        self._mm[self.slot] = 0
        self._flags = np.frombuffer(self._mm, dtype=np.uint8, count=SLOTS)
        self._ends = np.frombuffer(self._mm, dtype=np.float64, count=SLOTS, offset=_ENDS)
        self._ends[self.slot] = 0.0
        self._dead: list[int] = []  # slots whose busy flag a dead worker left (each step)
        self.threads = 0  # what this step's thread runs with (0: not set yet)
        self.shares = False  # this step takes a share (else one thread)

    def _claim(self, fd: int) -> int:
        for slot in range(SLOTS):
            try:
                _lock_byte(fd, slot)
            except OSError:
                continue  # another live worker's
            return slot
        raise RuntimeError(f"all {SLOTS} core-sharing slots of {self.path} are taken")

    def close(self) -> None:
        if self._fd < 0:
            return
        self._mm[self.slot] = 0
        del self._flags, self._ends  # (views of the map: it cannot close under them)
        self._mm.close()
        os.close(self._fd)  # releases the slot's lock
        self._fd = -1

    # -- the share ------------------------------------------------------------------------
    def _others_busy(self) -> tuple[int, int]:
        """Other workers in a step or just out of one (``GRACE_S``), called during a step:
        (those that share the cores, those on one thread -- a small step)."""
        flags = self._flags
        recent = self._ends > time.monotonic() - GRACE_S
        sharing = int(np.count_nonzero((flags == SHARING) | (recent & (flags == 0))))
        single = int(
            np.count_nonzero((flags == ONE_THREAD) | (recent & (flags == AFTER_ONE_THREAD)))
        )
        # A dead worker's slot may have been taken (and its flag cleared) since the step began.
        for slot in self._dead:
            if flags[slot] == SHARING:
                sharing -= 1
            elif flags[slot] == ONE_THREAD:
                single -= 1
        if flags[self.slot] == ONE_THREAD:
            single -= 1
        else:
            sharing -= 1
        return max(0, sharing), max(0, single)

    def share(self) -> int:
        """Threads for this worker now: the cores that workers on one thread leave, split
        evenly among the busy workers that share them."""
        sharing, single = self._others_busy()
        return max(1, (self.cores - single) // (1 + sharing))

    def set_threads(self, n: int) -> None:
        if n != self.threads:
            torch.set_num_threads(n)
            self.threads = n

    def adjust(self) -> None:
        """Between layers: follow the other workers' steps starting and ending."""
        if self.shares:
            self.set_threads(self.share())

    def _dead_slots(self) -> list[int]:
        dead = []
        flags = self._mm[:SLOTS]
        for slot in range(SLOTS):
            if flags[slot] not in (SHARING, ONE_THREAD) or slot == self.slot:
                continue
            (pid,) = struct.unpack_from("<i", self._mm, _PIDS + 4 * slot)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                dead.append(slot)
            except PermissionError:
                pass  # alive, another user's
        return dead

    @contextlib.contextmanager
    def busy(self, num_tokens: int) -> Iterator[None]:
        """Around a step of ``num_tokens``: flagged busy, threads set to the share at its
        start (one thread for a step under ``min_step_tokens``)."""
        self._dead = self._dead_slots()
        self.shares = num_tokens >= self.min_step_tokens
        self._mm[self.slot] = SHARING if self.shares else ONE_THREAD
        # OpenMP's thread count is per calling thread, and a Ray actor may run steps on
        # another thread than the last one: set it afresh at every step.
        self.threads = 0
        self.set_threads(self.share() if self.shares else 1)
        try:
            yield
        finally:
            self._ends[self.slot] = time.monotonic()
            self._mm[self.slot] = 0 if self.shares else AFTER_ONE_THREAD
