"""Waiting for an operator's stop, shared by the long-running commands (`tandem up`,
`tandem serve`)."""

from __future__ import annotations

import signal
import time
from typing import Any


def wait_for_stop() -> None:
    """Block until Ctrl-C or SIGTERM (`kill`, a container stop). Both count as Ctrl-C, so a
    job started in the background of a script (which ignores SIGINT) still stops cleanly."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("\nshutting down", flush=True)
