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


def test_a_worker_on_one_thread_takes_one_core_not_a_share(
    tmp_path: Path, restore_threads: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step (one thread) beside a prefill on a 16-core machine: the prefill takes
    the 15 cores left, not half of them (7 sat idle while both ran)."""
    table = tmp_path / "cores"
    decode, prefill, other = (CoreShare(cores=16, path=table) for _ in range(3))
    # Between two decode steps (the grace after one): still one core, not a share.
    monkeypatch.setattr(cores, "GRACE_S", 5.0)
    with decode.busy(num_tokens=8):
        pass
    with prefill.busy(num_tokens=512):
        assert prefill.threads == 15
    monkeypatch.setattr(cores, "GRACE_S", 0.0)
    with decode.busy(num_tokens=8):
        assert decode.threads == 1
        with prefill.busy(num_tokens=512):
            assert prefill.threads == 15
            with other.busy(num_tokens=512):
                assert other.threads == 7  # (16 - 1) // 2
                prefill.adjust()
                assert prefill.threads == 7
    for share in (decode, prefill, other):
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


def _write(path: Path, text: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for line in text.split(";"):
        name, value = line.split("=")
        (path / name).write_text(value)


def test_the_cgroup_cpu_quota_v2_v1_and_a_containers_own_view(tmp_path: Path) -> None:
    """A pod's CPU limit caps the cores: cgroup v2's cpu.max in the process's cgroup (or at
    the root, as a container sees its own), v1's quota and period; no limit, no cap."""
    v2 = tmp_path / "v2"
    _write(v2 / "kubepods" / "pod1", "cpu.max=150000 100000\n")
    assert cores.cgroup_cpu_quota(v2, "0::/kubepods/pod1\n") == 1.5
    _write(v2 / "kubepods" / "pod2", "cpu.max=max 100000\n")
    assert cores.cgroup_cpu_quota(v2, "0::/kubepods/pod2\n") is None
    container = tmp_path / "container"
    _write(container, "cpu.max=200000 100000\n")
    assert cores.cgroup_cpu_quota(container, "0::/\n") == 2.0
    v1 = tmp_path / "v1"
    quota = "cpu.cfs_quota_us=300000\n;cpu.cfs_period_us=100000\n"
    _write(v1 / "cpu,cpuacct" / "docker" / "abc", quota)
    own = "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"
    assert cores.cgroup_cpu_quota(v1, own) == 3.0
    _write(v1 / "cpu,cpuacct" / "free", "cpu.cfs_quota_us=-1\n;cpu.cfs_period_us=100000\n")
    assert cores.cgroup_cpu_quota(v1, "4:cpu,cpuacct:/free\n0::/\n") is None
    assert cores.cgroup_cpu_quota(tmp_path / "nothing", "0::/\n") is None


def test_machine_cores_are_capped_by_the_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    affinity = len(os.sched_getaffinity(0))
    monkeypatch.setattr(cores, "cgroup_cpu_quota", lambda: None)
    assert cores.machine_cores() == affinity
    monkeypatch.setattr(cores, "cgroup_cpu_quota", lambda: 0.5)
    assert cores.machine_cores() == 1  # at least one
    monkeypatch.setattr(cores, "cgroup_cpu_quota", lambda: affinity + 0.9)
    assert cores.machine_cores() == affinity  # the affinity still caps
    if affinity >= 2:
        monkeypatch.setattr(cores, "cgroup_cpu_quota", lambda: 1.5)
        assert cores.machine_cores() == 1  # rounded down: a thread past it would stall


def test_a_limit_on_a_parent_cgroup_binds_its_children(tmp_path: Path) -> None:
    """The process sits in a child cgroup with no limit of its own (``max``), under a
    container or slice limited to 2 CPUs: the parent's limit counts, and the smallest wins."""
    v2 = tmp_path / "v2"
    _write(v2 / "pod", "cpu.max=200000 100000\n")
    _write(v2 / "pod" / "ray.service", "cpu.max=max 100000\n")
    assert cores.cgroup_cpu_quota(v2, "0::/pod/ray.service\n") == 2.0
    _write(v2 / "pod" / "ray.service" / "worker", "cpu.max=350000 100000\n")
    assert cores.cgroup_cpu_quota(v2, "0::/pod/ray.service/worker\n") == 2.0
    v1 = tmp_path / "v1"
    _write(v1 / "cpu" / "user.slice", "cpu.cfs_quota_us=150000\n;cpu.cfs_period_us=100000\n")
    _write(v1 / "cpu" / "user.slice" / "s1", "cpu.cfs_quota_us=-1\n;cpu.cfs_period_us=100000\n")
    assert cores.cgroup_cpu_quota(v1, "3:cpu:/user.slice/s1\n0::/\n") == 1.5
