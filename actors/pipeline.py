"""What pipeline stages pass along, and how an instance's per-stage KV reports become one.

A ``pp_size > 1`` instance runs one step as a chain (DESIGN §3.3)::

    stage 0 (embeds) ─hidden─▶ stage 1 ─hidden─▶ ... ─▶ last stage (norm, logits, samples)

Every stage but the last returns an ``IntermediateOutput``; the next stage receives it. Each
stage has a KV connector for its own layers, so each adds a ``StageReport`` for the step and
passes the list on; the last stage returns a ``ModelRunnerOutput`` whose ``kv_connector_output``
is that list. ``StageReportMerger`` (on the control plane) turns the lists into what the
scheduler expects from a single worker: a load is finished when every stage has written its
layers (failed if any stage failed), a send when every stage's source let go, and a save's
handle is one ``KVSegment`` per stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kv_transfer.connector import KVConnectorReport, KVSegment
from scheduler import ModelRunnerOutput

if TYPE_CHECKING:
    import torch


@dataclass
class StageReport:
    """One stage's connector reports for one step."""

    pp_rank: int
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    failed_recving: set[str] | None = None
    kv: KVConnectorReport | None = None


@dataclass
class IntermediateOutput:
    """A stage's output for the next stage: the hidden states of every scheduled token (in
    the batch order every stage derives from the same ``SchedulerOutput``), or None when the
    step computed nothing, the connector reports of the stages so far, and the requests
    those stages failed (their LoRA adapter could not be read there), with why: the last
    stage samples none of them and reports them (``ModelRunnerOutput.failed_req_ids``)."""

    hidden_states: torch.Tensor | None
    stage_reports: list[StageReport] = field(default_factory=list)
    failed_req_ids: dict[str, str] = field(default_factory=dict)


class StageReportMerger:
    """Combines the per-stage reports of one instance's steps (one merger per instance).

    A stage reports a load done or failed on the step its own layers land (or time out);
    stages may differ by steps. The scheduler hears of a load only once every stage has
    reported it, so no stage still writes into blocks the scheduler has moved on from (a
    failed load's blocks are recomputed, an aborted one's freed). Every stage's load ends by
    its deadline, so the merged report is bounded by the transfer timeout too.
    """

    def __init__(self, pp_size: int) -> None:
        self.pp_size = pp_size
        self._recving: dict[str, set[int]] = {}  # req_id -> stages done
        self._recv_failed: set[str] = set()  # some stage failed; waiting for the others
        self._sending: dict[str, set[int]] = {}  # req_id -> stages whose lease ended
        self._send_expected: dict[str, int] = {}  # req_id -> stages holding a lease
        # req_id -> the stages' load records so far: one record per load once all are in
        # (its slowest stage's time, every stage's bytes, ok only if every stage's was).
        self._load_parts: dict[str, list[tuple[str, float, int, bool]]] = {}

    def merge(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        reports = output.kv_connector_output
        if not isinstance(reports, list):
            return output
        done: set[str] = set()
        failed: set[str] = set()
        sent: set[str] = set()
        kv = KVConnectorReport()
        segments: dict[str, list[KVSegment]] = {}
        for report in reports:
            for req_id in report.finished_recving or ():
                if self._stage_done(self._recving, req_id, report.pp_rank):
                    (failed if self._recv_failed_pop(req_id) else done).add(req_id)
            for req_id in report.failed_recving or ():
                self._recv_failed.add(req_id)
                if self._stage_done(self._recving, req_id, report.pp_rank):
                    self._recv_failed.discard(req_id)
                    failed.add(req_id)
            for req_id in report.finished_sending or ():
                stages = self._sending.setdefault(req_id, set())
                stages.add(report.pp_rank)
                if len(stages) >= self._send_expected.get(req_id, self.pp_size):
                    del self._sending[req_id]
                    self._send_expected.pop(req_id, None)
                    sent.add(req_id)
            if report.kv is not None:
                kv.bytes_saved += report.kv.bytes_saved
                kv.bytes_loaded += report.kv.bytes_loaded
                for load in report.kv.loads:
                    parts = self._load_parts.setdefault(load[0], [])
                    parts.append(load)
                    if len(parts) >= self.pp_size:
                        del self._load_parts[load[0]]
                        kv.loads.append(_merged_load(parts))
                for req_id, segs in report.kv.saved.items():
                    segments.setdefault(req_id, []).extend(segs)
        for req_id in done | failed:  # (a stage that sent no record: what the others did)
            parts = self._load_parts.pop(req_id, [])
            if parts:
                kv.loads.append(_merged_load(parts))
        # A save's segments all arrive in the step that finishes the prompt (every stage ran
        # it). When a stage's save failed, its layers are missing: the decode side finds the
        # segments short and recomputes. A send is done when every stage that leased blocks
        # in place has let them go.
        for req_id, segs in segments.items():
            kv.saved[req_id] = sorted(segs, key=lambda s: s.first_layer)
            ranks = {rank for rank, seg in enumerate(kv.saved[req_id]) if seg.in_place}
            if ranks:
                self._send_expected[req_id] = len(ranks)
        output.finished_recving = done or None
        output.failed_recving = failed or None
        output.finished_sending = sent or None
        output.kv_connector_output = kv
        return output

    def _stage_done(self, table: dict[str, set[int]], req_id: str, rank: int) -> bool:
        stages = table.setdefault(req_id, set())
        stages.add(rank)
        if len(stages) < self.pp_size:
            return False
        del table[req_id]
        return True

    def _recv_failed_pop(self, req_id: str) -> bool:
        if req_id in self._recv_failed:
            self._recv_failed.discard(req_id)
            return True
        return False

    def pending(self) -> int:
        """Transfers some stages have reported and others not yet."""
        return len(self._recving) + len(self._sending)

    def forget(self) -> None:
        """Drop partial reports (the instance's workers were replaced)."""
        self._recving.clear()
        self._recv_failed.clear()
        self._sending.clear()
        self._send_expected.clear()
        self._load_parts.clear()


def stage_report(pp_rank: int, output: Any, kv: KVConnectorReport | None) -> StageReport:
    """A ``StageReport`` from a connector's ``get_finished()`` triple and ``report()``."""
    sending, recving, failed = output
    return StageReport(pp_rank, sending, recving, failed, kv)


__all__ = ["IntermediateOutput", "StageReport", "StageReportMerger", "stage_report"]


def _merged_load(parts: list[tuple[str, float, int, bool]]) -> tuple[str, float, int, bool]:
    """One load of a request from its stages' records: the slowest stage's time, every
    stage's bytes, ok only if every stage's load was."""
    return (
        parts[0][0],
        max(p[1] for p in parts),
        sum(p[2] for p in parts),
        all(p[3] for p in parts),
    )
