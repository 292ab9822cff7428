"""The long-running commands' signal handling (``cluster/tools/signals.py``), in a process of
its own: the first signal interrupts, a second one during the clean-up does not cut it short,
a third ends the process at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

# A command that starts, is interrupted, and then cleans up slowly (as `tandem up` does).
SCRIPT = """
import signal, sys, time
from cluster.tools.signals import interrupted_while_starting, stop_on_signals
stop_on_signals()
if "--ray" in sys.argv:  # as `tandem serve` is while Serve starts: ray.init's SIGTERM handler
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
try:
    print("starting", flush=True)
    time.sleep(60)
except (KeyboardInterrupt, SystemExit) as exc:
    status = interrupted_while_starting("cmd", exc)
    print("cleaning", flush=True)
    for _ in range(15):
        time.sleep(0.1)
    print("cleaned", flush=True)
    sys.exit(status)
"""

ROOT = Path(__file__).resolve().parents[3]


def run(signals: list[int], *args: str) -> tuple[int, str, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "starting\n"
    proc.send_signal(signals[0])
    assert proc.stdout.readline() == "cleaning\n"
    for signum in signals[1:]:
        time.sleep(0.2)  # (each in turn: a signal pending twice is delivered once)
        proc.send_signal(signum)
    out, err = proc.communicate(timeout=30)
    return proc.returncode, out, err


def test_a_second_signal_does_not_cut_the_clean_up_short() -> None:
    status, out, err = run([signal.SIGINT, signal.SIGTERM])
    assert status == 130
    assert out == "cleaned\n"
    assert "still shutting down" in err
    assert "Traceback" not in err


def test_a_third_signal_ends_at_once() -> None:
    status, out, err = run([signal.SIGTERM, signal.SIGINT, signal.SIGINT])
    assert status == 128 + signal.SIGTERM
    assert "cleaned" not in out
    assert "Traceback" not in err


def test_a_signal_after_rays_handler_stopped_the_start_does_not_cut_the_clean_up_short() -> None:
    """The start ended by Ray's SIGTERM handler (a SystemExit, nothing counted as ours): a
    second signal, of either kind, says that the clean-up goes on rather than cutting it
    short (and leaving a detached cluster behind on a joined Ray)."""
    for second in (signal.SIGTERM, signal.SIGINT):
        status, out, err = run([signal.SIGTERM, second], "--ray")
        assert status == 128 + signal.SIGTERM, err
        assert out == "cleaned\n" and "still shutting down" in err
        assert "Traceback" not in err
