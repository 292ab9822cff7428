"""Same-node reads without a transfer library: ``process_vm_readv``, the kernel's copy between
two processes' memory (cross-memory attach, CMA), which is also what UCX uses under NIXL
between two workers of one machine. Called directly it costs one system call per read (and
two 16-byte reads that check the source, below) instead of NIXL's transfer set-up, post,
completion and notification: for a 128-token request of the built-in model (2.8 MiB) about
0.16 ms of copying against about 0.5 ms through NIXL here.

It needs what CMA under UCX needs: both processes on one machine, in one PID namespace, and
the reader allowed to trace the source (the same user, and ``kernel.yama.ptrace_scope`` at 0
where Yama is on, or ``CAP_SYS_PTRACE``). ``SourceProcess.attach`` checks all of it by reading
a random token that the source published with its address (``Token``), and returns None where
that fails or reads something else.

A process id names whatever process holds it now: in another PID namespace on the same kernel
(another pod) the same number is another process, and a source that died could in principle
have its id taken. Hence the token (a match is the source, nothing else), and the pidfd the
reader holds of the process it attached to: a source that has exited is never read again.

The token also vouches for the source's cache: the source renews it before it lets its cache
go and clears it before it closes (``TokenHolder``), and a read checks it before and after the
copy, like a sequence lock. Found after the copy, the copy read the cache it was meant to (the
renewal comes before any store into reused memory: x86 makes stores visible in program order,
and on other machines the locks taken between the two on the source side order them; the
reader's three system calls are ordered by the kernel's own locks); changed -- even half
written -- the copy is thrown away. What the token does not cover, leases ending within one
cache, the read's deadline does (``nixl_reads.py``).
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
    work: not Linux, no boot id). The value stands for the memory it vouches for as it is
    now: ``renew`` (a new cache) and ``clear`` (none) must come before that memory changes
    hands, so that a reader that checks the value after its copy knows the copy was good."""

    def __init__(self) -> None:
        self._value = np.zeros(16, dtype=np.uint8)
        self.token: Token | None = None
        self.renew()

    def renew(self) -> None:
        """A new value, in place: readers attached to the old one stop reading."""
        self._value[:] = np.frombuffer(os.urandom(16), dtype=np.uint8)
        host = host_id()
        if host is not None and _libc() is not None:
            self.token = Token(host, os.getpid(), self._value.ctypes.data, self._value.tobytes())

    def clear(self) -> None:
        """No value (the memory it vouched for is going): every reader stops."""
        self._value[:] = 0
        self.token = None


class StaleSource(OSError):
    """The source no longer holds the token a reader attached with: its cache was replaced
    or closed (or the process is not the one attached)."""


class SourceProcess:
    """A process this one reads from (``read``), attached by ``attach``."""

    def __init__(self, token: Token, pidfd: int) -> None:
        self.pid = token.pid
        self.token = token
        self._pidfd: int | None = pidfd
        self._poll = select.poll()
        self._poll.register(pidfd, select.POLLIN)  # readable once the process has exited
        self._found = np.zeros(len(token.value), dtype=np.uint8)
        self._token_spans = (
            np.array([[self._found.ctypes.data, self._found.nbytes]], dtype=np.uint64),
            np.array([[token.address, self._found.nbytes]], dtype=np.uint64),
        )

    @classmethod
    def attach(cls, token: Token) -> SourceProcess | None:
        """The process that published ``token``, if this one can read it there (the same
        machine and PID namespace, the right to trace it) and finds the token's bytes; else
        None, with the reason logged."""
        if _libc() is None or token.host != host_id() or len(token.value) < 16:
            return None
        try:
            pidfd = os.pidfd_open(token.pid)
        except OSError as exc:
            logger.info("no same-node copy from process %d: %s", token.pid, exc)
            return None
        source = cls(token, pidfd)
        try:
            source.check()
        except StaleSource:  # another process under that number (or a cache since replaced)
            logger.info("no same-node copy from process %d: not the publisher", token.pid)
        except OSError as exc:
            logger.info("no same-node copy from process %d: %s", token.pid, exc)
        else:
            return source
        source.close()
        return None

    def check(self) -> None:
        """Raise unless the source still holds the token (``StaleSource``) and lives."""
        self._copy(*self._token_spans)
        if self._found.tobytes() != self.token.value:
            raise StaleSource(f"process {self.pid} no longer holds the KV cache attached to")

    @property
    def alive(self) -> bool:
        return self._pidfd is not None and not self._poll.poll(0)

    def read(self, local: np.ndarray, remote: np.ndarray) -> int:
        """Copy each span ``remote[i]`` (address in the source, length) to ``local[i]``
        (address here, length): rows ``[address, length, ...]``, equal lengths row by row.
        Returns the bytes copied. Raises ``OSError`` -- nothing written if the source had
        already exited or changed its cache (``StaleSource``) -- if any span could not be
        copied whole, or if the token is gone after the copy: what was copied then is not to
        be trusted (the source may have reused that memory meanwhile)."""
        self.check()
        done = self._copy(local, remote)
        self.check()
        return done

    def _copy(self, local: np.ndarray, remote: np.ndarray) -> int:
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

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (at interpreter exit, modules may be gone)
            self.close()
