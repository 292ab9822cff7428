"""``StageReportMerger``: a pipeline instance's per-stage KV reports become one worker's report.

Hand-built ``ModelRunnerOutput``s whose ``kv_connector_output`` is the list of ``StageReport``s
the last stage returns (one per stage, in stage order), as ``PipelineExecutor`` receives them.
No model, no Ray.
"""

from __future__ import annotations

from typing import Any

from actors.pipeline import StageReport, StageReportMerger
from kv_transfer.connector import KVConnectorReport, KVSegment
from scheduler import ModelRunnerOutput


def _step(*reports: StageReport) -> ModelRunnerOutput:
    """The last stage's output of one step: a decode of "x" and the stages' reports."""
    return ModelRunnerOutput(
        req_ids=["x"], sampled_token_ids=[[7]], kv_connector_output=list(reports)
    )


def _quiet(pp_size: int) -> list[StageReport]:
    """Every stage reports nothing this step."""
    return [StageReport(rank) for rank in range(pp_size)]


def _loads(out: ModelRunnerOutput) -> tuple[set[str] | None, set[str] | None]:
    """The merged report's loads: (finished, failed)."""
    return out.finished_recving, out.failed_recving


def _seg(first: int, last: int, handle: Any, in_place: bool = False) -> KVSegment:
    return KVSegment(first, last, handle, in_place)


def _saved(req_id: str, segment: KVSegment, saved: int = 0, loaded: int = 0) -> KVConnectorReport:
    return KVConnectorReport(saved={req_id: [segment]}, bytes_saved=saved, bytes_loaded=loaded)


# -- loads (decode side) -------------------------------------------------------------------------
def test_load_finished_only_once_every_stage_wrote_its_layers() -> None:
    m = StageReportMerger(3)
    out = m.merge(_step(StageReport(0, finished_recving={"a"}), StageReport(1), StageReport(2)))
    assert _loads(out) == (None, None)
    assert m.pending() == 1
    out = m.merge(
        _step(StageReport(0), StageReport(1), StageReport(2, finished_recving={"a", "b"}))
    )
    assert out.finished_recving is None  # stage 1 still writes a; b only heard from stage 2
    assert m.pending() == 2
    out = m.merge(
        _step(
            StageReport(0, finished_recving={"b"}),
            StageReport(1, finished_recving={"a", "b"}),
            StageReport(2),
        )
    )
    assert _loads(out) == ({"a", "b"}, None)
    assert m.pending() == 0
    # Reported once: nothing more for them afterwards.
    out = m.merge(_step(*_quiet(3)))
    assert _loads(out) == (None, None)


def test_load_done_by_all_stages_in_one_step() -> None:
    m = StageReportMerger(2)
    out = m.merge(
        _step(StageReport(0, finished_recving={"a"}), StageReport(1, finished_recving={"a"}))
    )
    assert _loads(out) == ({"a"}, None)
    assert m.pending() == 0


def test_failed_stage_reported_once_after_the_other_stage_finished_writing() -> None:
    m = StageReportMerger(2)
    # Stage 0 timed out; stage 1 is still writing its layers into the blocks.
    out = m.merge(_step(StageReport(0, failed_recving={"a"}), StageReport(1)))
    assert _loads(out) == (None, None)
    assert m.pending() == 1
    out = m.merge(_step(*_quiet(2)))
    assert out.failed_recving is None
    # Stage 1 is done: the load as a whole failed (stage 0's layers are missing).
    out = m.merge(_step(StageReport(0), StageReport(1, finished_recving={"a"})))
    assert _loads(out) == (None, {"a"})
    assert m.pending() == 0
    out = m.merge(_step(*_quiet(2)))
    assert _loads(out) == (None, None)


def test_failure_reported_by_the_last_stage_to_answer() -> None:
    m = StageReportMerger(3)
    out = m.merge(
        _step(
            StageReport(0, finished_recving={"a"}),
            StageReport(1, finished_recving={"a"}),
            StageReport(2),
        )
    )
    assert _loads(out) == (None, None)
    out = m.merge(_step(StageReport(0), StageReport(1), StageReport(2, failed_recving={"a"})))
    assert _loads(out) == (None, {"a"})
    assert m.pending() == 0


def test_every_stage_failing_is_one_failure() -> None:
    m = StageReportMerger(2)
    out = m.merge(_step(StageReport(0, failed_recving={"a"}), StageReport(1)))
    assert out.failed_recving is None
    out = m.merge(_step(StageReport(0), StageReport(1, failed_recving={"a"})))
    assert _loads(out) == (None, {"a"})
    # A later load of another request is not tainted by a's failure.
    out = m.merge(
        _step(StageReport(0, finished_recving={"b"}), StageReport(1, finished_recving={"b"}))
    )
    assert _loads(out) == ({"b"}, None)
    assert m.pending() == 0


def test_failure_of_one_request_leaves_the_others_done() -> None:
    m = StageReportMerger(2)
    out = m.merge(
        _step(
            StageReport(0, finished_recving={"a"}, failed_recving={"b"}),
            StageReport(1, finished_recving={"a", "b"}),
        )
    )
    assert out.finished_recving == {"a"}
    assert out.failed_recving == {"b"}


# -- saves (prefill side) ------------------------------------------------------------------------
def test_saved_segments_of_all_stages_sorted_by_first_layer_and_bytes_summed() -> None:
    m = StageReportMerger(3)
    # The stages' lists travel in stage order, but the merged handle must not depend on it.
    out = m.merge(
        _step(
            StageReport(2, kv=_saved("a", _seg(4, 5, "h2"), saved=100, loaded=1)),
            StageReport(0, kv=_saved("a", _seg(0, 2, "h0"), saved=300, loaded=2)),
            StageReport(
                1,
                kv=KVConnectorReport(
                    saved={"a": [_seg(2, 4, "h1")], "b": [_seg(2, 4, "b1")]},
                    bytes_saved=200,
                    bytes_loaded=4,
                ),
            ),
        )
    )
    kv = out.kv_connector_output
    assert isinstance(kv, KVConnectorReport)
    assert [(s.first_layer, s.last_layer, s.handle) for s in kv.saved["a"]] == [
        (0, 2, "h0"),
        (2, 4, "h1"),
        (4, 5, "h2"),
    ]
    assert [s.handle for s in kv.saved["b"]] == ["b1"]  # stages 0 and 2 failed to save b
    assert kv.bytes_saved == 600 and kv.bytes_loaded == 7
    # Copy-out segments: nothing waits for a send to finish.
    assert m.pending() == 0 and out.finished_sending is None


def test_no_reports_merge_to_an_empty_report() -> None:
    m = StageReportMerger(2)
    out = m.merge(_step(*_quiet(2)))
    assert isinstance(out.kv_connector_output, KVConnectorReport)
    assert out.kv_connector_output.saved == {}
    assert out.kv_connector_output.bytes_saved == 0
    assert out.finished_sending is None
    assert _loads(out) == (None, None)
    assert out.req_ids == ["x"] and out.sampled_token_ids == [[7]]  # the step's tokens kept


# -- in-place segments (leases) ------------------------------------------------------------------
def test_lease_send_finished_once_every_leasing_stage_let_go() -> None:
    m = StageReportMerger(2)
    m.merge(
        _step(
            StageReport(0, kv=_saved("a", _seg(0, 3, "l0", in_place=True))),
            StageReport(1, kv=_saved("a", _seg(3, 5, "l1", in_place=True))),
        )
    )
    out = m.merge(_step(StageReport(0), StageReport(1, finished_sending={"a"})))
    assert out.finished_sending is None  # stage 0 still serves its blocks
    assert m.pending() == 1
    out = m.merge(_step(*_quiet(2)))
    assert out.finished_sending is None
    out = m.merge(_step(StageReport(0, finished_sending={"a"}), StageReport(1)))
    assert out.finished_sending == {"a"}
    assert m.pending() == 0
    out = m.merge(_step(*_quiet(2)))
    assert out.finished_sending is None


def test_lease_send_finished_when_the_only_leasing_stage_let_go() -> None:
    """Stage 0's save failed: only stage 1 holds a lease, so its release ends the send."""
    m = StageReportMerger(2)
    out = m.merge(
        _step(StageReport(0), StageReport(1, kv=_saved("a", _seg(3, 5, "l1", in_place=True))))
    )
    assert isinstance(out.kv_connector_output, KVConnectorReport)
    assert [s.handle for s in out.kv_connector_output.saved["a"]] == ["l1"]
    out = m.merge(_step(StageReport(0), StageReport(1, finished_sending={"a"})))
    assert out.finished_sending == {"a"}
    assert m.pending() == 0


def test_lease_of_stage_0_alone() -> None:
    m = StageReportMerger(3)
    m.merge(
        _step(
            StageReport(0, kv=_saved("a", _seg(0, 2, "l0", in_place=True))),
            StageReport(1),
            StageReport(2),
        )
    )
    out = m.merge(_step(StageReport(0, finished_sending={"a"}), StageReport(1), StageReport(2)))
    assert out.finished_sending == {"a"}
    assert m.pending() == 0


def test_sends_without_a_recorded_lease_wait_for_every_stage() -> None:
    """A send report for a request whose segments this merger has not seen: the default
    expectation is that every stage holds a lease, so all ``pp_size`` must report."""
    m = StageReportMerger(2)
    out = m.merge(_step(StageReport(0, finished_sending={"a"}), StageReport(1)))
    assert out.finished_sending is None and m.pending() == 1
    out = m.merge(_step(StageReport(0), StageReport(1, finished_sending={"a"})))
    assert out.finished_sending == {"a"} and m.pending() == 0


# -- pass-through, pending, forget -----------------------------------------------------------------
def test_single_worker_output_passes_through_unchanged() -> None:
    m = StageReportMerger(2)
    kv = KVConnectorReport(saved={"a": [_seg(0, 5, "h")]}, bytes_saved=9)
    output = ModelRunnerOutput(
        req_ids=["a"],
        sampled_token_ids=[[3]],
        finished_sending={"s"},
        finished_recving={"r"},
        failed_recving={"f"},
        kv_connector_output=kv,
    )
    merged = m.merge(output)
    assert merged is output
    assert merged.kv_connector_output is kv
    assert merged.finished_sending == {"s"}
    assert merged.finished_recving == {"r"} and merged.failed_recving == {"f"}
    none = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
    assert m.merge(none).kv_connector_output is None
    assert m.pending() == 0


def test_pending_counts_transfers_heard_from_some_stages() -> None:
    m = StageReportMerger(2)
    assert m.pending() == 0
    m.merge(
        _step(
            StageReport(0, finished_recving={"a"}, failed_recving={"b"}, finished_sending={"c"}),
            StageReport(1),
        )
    )
    assert m.pending() == 3
    m.merge(_step(StageReport(0), StageReport(1, finished_recving={"a"})))
    assert m.pending() == 2


def test_forget_drops_partial_reports() -> None:
    m = StageReportMerger(2)
    m.merge(
        _step(
            StageReport(0, finished_recving={"a"}, failed_recving={"b"}),
            StageReport(1, kv=_saved("c", _seg(3, 5, "l1", in_place=True))),
        )
    )
    m.merge(_step(StageReport(0), StageReport(1, finished_sending={"d"})))
    assert m.pending() == 3
    m.forget()
    assert m.pending() == 0
    # The new workers' reports start from scratch: one stage's word is not enough any more,
    # b's old failure does not taint its next load, and c's old lease count is gone.
    out = m.merge(
        _step(
            StageReport(0),
            StageReport(1, finished_recving={"a", "b"}, finished_sending={"c"}),
        )
    )
    assert _loads(out) == (None, None)
    assert out.finished_sending is None
    out = m.merge(
        _step(StageReport(0, finished_recving={"a", "b"}, finished_sending={"c"}), StageReport(1))
    )
    assert _loads(out) == ({"a", "b"}, None)
    assert out.finished_sending == {"c"}
    assert m.pending() == 0


def test_a_load_is_one_record_of_all_its_stages() -> None:
    """Each stage reports its part of a request's KV load; the merged report has one record
    per load -- the slowest stage's time, all the bytes, ok only if every part was -- so a
    failed load counts one recompute and one transfer, not one per stage."""
    m = StageReportMerger(2)

    def loads(*records: tuple[str, float, int, bool]) -> KVConnectorReport:
        return KVConnectorReport(loads=list(records))

    out = m.merge(
        _step(
            StageReport(0, finished_recving={"a"}, kv=loads(("a", 0.1, 100, True))),
            StageReport(1),
        )
    )
    assert out.kv_connector_output.loads == []  # stage 1 still loads
    out = m.merge(
        _step(
            StageReport(0),
            StageReport(1, failed_recving={"a"}, kv=loads(("a", 0.3, 60, False))),
        )
    )
    assert out.failed_recving == {"a"}
    assert out.kv_connector_output.loads == [("a", 0.3, 160, False)]
