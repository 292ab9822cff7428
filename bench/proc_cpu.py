"""CPU time per process of a serving run, grouped by the hop each process is.

Every token a served request streams crosses several processes: the model worker(s), the
central scheduler actor, the Serve replica holding the client (detokenization, SSE), Serve's HTTP
proxy, Ray's own daemons, and the load client. On a machine with few cores they all share the
cores the model wants, so the CPU each spends per output token is what a hop costs. This reads
``/proc`` (utime + stime of every thread of every process) before and after a run. Every
matching process on the host counts: run it with nothing else of Ray or Tandem alive.

    before = snapshot(); ...run...; table = per_hop(before, snapshot())
"""

from __future__ import annotations

import os
import resource
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")

# (hop, words in the process title or command line), first match wins.
HOPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model worker", ("ray::WorkerActor", "ray::ModelWorker")),  # (the second: before 11-29)
    ("engine actor", ("ray::EngineActor",)),
    ("scheduler actor", ("ray::SchedulerActor",)),
    ("serve ingress", ("ray::ServeReplica:tandem:OpenAIIngress",)),
    ("serve cluster replica", ("ray::ServeReplica:tandem:TandemCluster",)),
    ("serve replica (other)", ("ray::ServeReplica",)),
    ("serve proxy", ("ray::ProxyActor",)),
    ("serve controller", ("ray::ServeController",)),
    (
        "ray daemons",
        (
            *("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py"),
            *("ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::IDLE"),
        ),
    ),
    ("tandem serve", ("tandem serve", "cluster.tools.cli serve")),
    ("llama-server", ("llama-server",)),  # (bench.serve_configs' baseline)
)


def _title(pid: str) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def snapshot() -> dict[int, tuple[str, float]]:
    """pid -> (hop, CPU seconds so far) for every process of a known hop."""
    out: dict[int, tuple[str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        title = _title(entry)
        hop = next((h for h, words in HOPS if any(w in title for w in words)), None)
        if hop is None:
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(entry)] = (hop, (int(fields[11]) + int(fields[12])) * _TICK_S)
    return out


def per_hop(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds each hop spent between two snapshots (processes that ended in between are
    not counted; ones that started count from zero)."""
    spent: dict[str, float] = {}
    for pid, (hop, cpu) in after.items():
        start = before.get(pid, (hop, 0.0))[1]
        spent[hop] = spent.get(hop, 0.0) + max(cpu - start, 0.0)
    return spent


def children_cpu_s() -> float:
    """CPU seconds of this process's children that have exited (a load client run to the end
    is gone before the second snapshot)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime
