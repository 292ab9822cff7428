"""Core sharing between the workers of one machine (``actors.cores``)."""

from __future__ import annotations

import multiprocessing
import os
import struct
import time
from pathlib import Path

import pytest
import torch

from actors import cores
from actors.cores import _PIDS, CoreShare


@pytest.fixture
def restore_threads() -> object:
    threads = torch.get_num_threads()
    yield None
    torch.set_num_threads(threads)


def test_a_busy_worker_gets_the_cores_it_shares(
    tmp_path: Path, restore_threads: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cores, "GRACE_S", 0.0)
    table = tmp_path / "cores"
    a = CoreShare(cores=4, path=table)
    b = CoreShare(cores=4, path=table)
    c = CoreShare(cores=4, path=table)
    assert len({a.slot, b.slot, c.slot}) == 3
    with a.busy(num_tokens=128):
        assert a.threads == 4 and torch.get_num_threads() == 4  # alone: every core
        with b.busy(num_tokens=128):
            assert b.threads == 2
            a.adjust()  # a's next layer
            assert a.threads == 2
            with c.busy(num_tokens=128):
                assert c.threads == 1  # 4 // 3
            a.adjust()
            assert a.threads == 2
        a.adjust()
        assert a.threads == 4  # b's step ended
    with a.busy(num_tokens=8):
        assert a.threads == 1  # a small step (a decode) stays on one thread
    for share in (a, b, c):
        share.close()


def test_a_worker_between_two_steps_still_counts_as_busy(
    tmp_path: Path, restore_threads: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cores, "GRACE_S", 0.2)
    table = tmp_path / "cores"
    decode, prefill = CoreShare(cores=2, path=table), CoreShare(cores=2, path=table)
    with decode.busy(num_tokens=128):
        pass
    with prefill.busy(num_tokens=128):
        assert prefill.threads == 1  # the other one's next step is due any moment
    time.sleep(0.25)
    with prefill.busy(num_tokens=128):
        assert prefill.threads == 2  # past the grace: the machine is prefill's
    decode.close()
    prefill.close()


def _hold_slot_and_die(path: str) -> None:
    share = CoreShare(cores=2, path=Path(path))
    share._mm[share.slot] = 1  # flagged busy...
    share._mm.flush()
    os._exit(0)  # ...and gone without clearing it


def test_a_dead_workers_flag_and_slot_are_let_go(tmp_path: Path, restore_threads: object) -> None:
    table = tmp_path / "cores"
    live = CoreShare(cores=2, path=table)
    assert live.slot == 0
    proc = multiprocessing.get_context("fork").Process(target=_hold_slot_and_die, args=(table,))
    proc.start()
    proc.join(10)
    assert proc.exitcode == 0
    assert live._mm[:256].count(1) == 1  # the dead worker's flag is still there
    (pid,) = struct.unpack_from("<i", live._mm, _PIDS + 4)
    assert pid == proc.pid
    with live.busy(num_tokens=128):
        assert live.threads == 2  # its pid is gone: not counted
        again = CoreShare(cores=2, path=table)  # a restarted worker, during live's step
        assert again.slot == 1  # the dead one's slot: its lock went with it; flag cleared
        assert live._mm[:256].count(1) == 1  # live's own flag only
        live.adjust()  # its next layer: the dead slot's flag is gone, nothing miscounted
        assert live.threads == 2
    again.close()
    live.close()
