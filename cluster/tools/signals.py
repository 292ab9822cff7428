"""Stopping the long-running commands (`tandem up`, `tandem serve`) on an operator's signal,
whether it comes while they start or once they serve."""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

INTERRUPTED = 130  # the exit status of a start cut short (128 + SIGINT, as shells report)


def stop_on_signals() -> None:
    """From now on Ctrl-C and SIGTERM (`kill`, a container stop) both raise KeyboardInterrupt
    in the main thread, so that either unwinds through the caller's clean-up. SIGTERM counts
    as Ctrl-C so that a job started in the background of a script (which ignores SIGINT)
    still stops cleanly. Call it again after ``ray.init``, which sets a SIGTERM handler of
    its own (``sys.exit``)."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def interrupted_while_starting(command: str) -> int:
    """Say that a start was cut short (no traceback); the caller takes down what it began."""
    print(f"\n{command}: interrupted while starting: shutting down", file=sys.stderr, flush=True)
    return INTERRUPTED


def wait_for_stop() -> None:
    """Block until Ctrl-C or SIGTERM."""
    stop_on_signals()
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nshutting down", flush=True)
