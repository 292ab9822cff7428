"""Same-node reads without a transfer library: ``process_vm_readv``, the kernel's copy between
two processes' memory (cross-memory attach, CMA), which is also what UCX uses under NIXL
between two workers of one machine. Called directly it costs one system call per read instead
of NIXL's transfer set-up, post, completion and notification: for a 128-token request of the
built-in model (2.8 MiB) about 0.16 ms of copying against about 0.5 ms through NIXL here.

It needs what CMA under UCX needs: both processes on one machine, in one PID namespace, and
the reader allowed to trace the source (the same user, and ``kernel.yama.ptrace_scope`` at 0
where Yama is on, or ``CAP_SYS_PTRACE``). ``SourceProcess.attach`` checks all of it by reading
a random token that the source published with its address (``Token``), and returns None where
that fails or reads something else.

A process id names whatever process holds it now: in another PID namespace on the same kernel
(another pod) the same number is another process, and a source that died could in principle
have its id taken. Hence the token (a match is the source, nothing else), and the pidfd the
reader holds of the process it attached to, checked before every read: a source that has
exited is never read again.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import select
from dataclasses import dataclass
from functools import cache

import numpy as np

logger = logging.getLogger(__name__)

IOV_MAX = 1024  # iovecs per call (Linux's UIO_MAXIOV)


@cache
def _libc() -> ctypes.CDLL | None:
    if not hasattr(os, "pidfd_open"):  # Linux 5.3+, Python 3.9+
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        read = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    read.restype = ctypes.c_ssize_t
    read.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return libc


@cache
def host_id() -> str | None:
    """This boot of this machine (``/proc/sys/kernel/random/boot_id``): two processes with the
    same id may share memory by CMA. None where the kernel does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


@dataclass(frozen=True)
class Token:
    """What a source publishes so that readers can find it: its machine's boot, its process,
    and where in its memory a random value lies (kept by ``TokenHolder``)."""

    host: str
    pid: int
    address: int
    value: bytes


class TokenHolder:
    """A random value in this process's memory, and its ``Token`` (None where CMA cannot
    work: not Linux, no boot id)."""

    def __init__(self) -> None:
        self._value = np.frombuffer(os.urandom(16), dtype=np.uint8).copy()
        host = host_id()
        self.token: Token | None = None
        if host is not None and _libc() is not None:
            self.token = Token(host, os.getpid(), self._value.ctypes.data, self._value.tobytes())


class SourceProcess:
    """A process this one reads from (``read``), attached by ``attach``."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self._pidfd: int | None = pidfd
        self._poll = select.poll()
        self._poll.register(pidfd, select.POLLIN)  # readable once the process has exited

    @classmethod
    def attach(cls, token: Token) -> SourceProcess | None:
        """The process that published ``token``, if this one can read it there (the same
        machine and PID namespace, the right to trace it) and finds the token's bytes; else
        None, with the reason logged."""
        if _libc() is None or token.host != host_id():
            return None
        try:
            pidfd = os.pidfd_open(token.pid)
        except OSError as exc:
            logger.info("no same-node copy from process %d: %s", token.pid, exc)
            return None
        source = cls(token.pid, pidfd)
        found = np.zeros(len(token.value), dtype=np.uint8)
        try:
            source.read(
                np.array([[found.ctypes.data, found.nbytes]], dtype=np.uint64),
                np.array([[token.address, found.nbytes]], dtype=np.uint64),
            )
        except OSError as exc:
            logger.info("no same-node copy from process %d: %s", token.pid, exc)
            source.close()
            return None
        if found.tobytes() != token.value:  # another process under that number
            logger.info("no same-node copy from process %d: not the publisher", token.pid)
            source.close()
            return None
        return source

    @property
    def alive(self) -> bool:
        return self._pidfd is not None and not self._poll.poll(0)

    def read(self, local: np.ndarray, remote: np.ndarray) -> int:
        """Copy each span ``remote[i]`` (address in the source, length) to ``local[i]``
        (address here, length): rows ``[address, length, ...]``, equal lengths row by row.
        Returns the bytes copied; raises ``OSError`` if the source has exited or any span
        could not be copied whole (what was copied then is not to be trusted)."""
        libc = _libc()
        if libc is None or not self.alive:
            raise ProcessLookupError(f"KV source process {self.pid} has exited")
        # An iovec is {void *base; size_t len}: two 64-bit words, as a row of this array.
        loc = np.ascontiguousarray(local[:, :2], dtype=np.uint64)
        rem = np.ascontiguousarray(remote[:, :2], dtype=np.uint64)
        want = int(rem[:, 1].sum())
        if int(loc[:, 1].sum()) != want:
            raise ValueError("local and remote spans differ in length")
        done = 0
        for start in range(0, len(rem), IOV_MAX):
            n = min(IOV_MAX, len(rem) - start)
            got = libc.process_vm_readv(
                self.pid, loc[start:].ctypes.data, n, rem[start:].ctypes.data, n, 0
            )
            expected = int(rem[start : start + n, 1].sum())
            if got != expected:
                errno = ctypes.get_errno() if got < 0 else 0
                raise OSError(
                    errno,
                    f"copied {max(got, 0)} of {expected} bytes from process {self.pid}"
                    + (f": {os.strerror(errno)}" if errno else ""),
                )
            done += got
        return done

    def close(self) -> None:
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
