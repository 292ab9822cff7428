"""Stopping the long-running commands (`tandem up`, `tandem serve`) on an operator's signal,
whether it comes while they start or once they serve."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

_received: list[int] = []  # the signals that stopped this process (the first decides)


def stop_on_signals() -> None:
    """From now on Ctrl-C and SIGTERM (`kill`, a container stop) both raise KeyboardInterrupt
    in the main thread, so that either unwinds through the caller's clean-up. SIGTERM counts
    as Ctrl-C so that a job started in the background of a script (which ignores SIGINT)
    still stops cleanly. Call it again after ``ray.init``, which sets a SIGTERM handler of
    its own (``sys.exit``: callers catch that ``SystemExit`` as a stop too).
    Only the first signal interrupts: one during the clean-up that follows would cut it
    short with a traceback, leaving things half taken down. The second says that the
    clean-up goes on; a third ends the process at once (whatever still runs stays)."""

    def interrupt(signum: int, frame: Any) -> None:
        _received.append(signum)
        if len(_received) == 1:
            raise KeyboardInterrupt
        if len(_received) == 2:
            print(
                "\nstill shutting down; once more to quit at once, leaving what still runs",
                file=sys.stderr,
                flush=True,
            )
            return
        os._exit(128 + _received[0])

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def interrupted_while_starting(command: str, exc: BaseException) -> int:
    """Say that a start was cut short (no traceback), before the caller takes down what it
    began, and return the exit status: 128 + the signal's number, as shells report it (130
    for Ctrl-C, 143 for SIGTERM; ``exc``: the KeyboardInterrupt, or Ray's handler's
    SystemExit, whose code is the signal's number)."""
    if _received:
        signum = _received[0]
    elif isinstance(exc, SystemExit) and isinstance(exc.code, int):
        signum = exc.code
    else:
        signum = signal.SIGINT
    if not _received:
        # Not ours that stopped the start: Ray's SIGTERM handler (``sys.exit``, installed by
        # ``ray.init``, still in place). Count it as the first signal and take both signals
        # back, so that one during the clean-up that follows says so instead of cutting it
        # short (Ray's handler: a second SystemExit; ours with nothing counted: a
        # KeyboardInterrupt) and leaving a detached cluster behind.
        _received.append(int(signum))
    stop_on_signals()
    print(f"\n{command}: interrupted while starting: shutting down", file=sys.stderr, flush=True)
    return 128 + signum


def wait_for_stop() -> None:
    """Block until Ctrl-C or SIGTERM."""
    stop_on_signals()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nshutting down", flush=True)
