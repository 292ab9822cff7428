"""``RequestObserver``: what it records of a request's events (no Ray, no engine)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from cluster.config import default_cluster_config
from cluster.control.observer import RequestObserver
from scheduler import Request, SamplingParams
from scheduler.outputs import EngineCoreOutput
from scheduler.request import FinishReason


def _sums(observer: RequestObserver) -> dict[str, float]:
    text = observer.render({"instances": {}})
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("instance") == "p-0"
    }


def test_a_request_ended_on_its_prefill_instance_counts_its_clients_max_tokens() -> None:
    """A prefill part runs with max_tokens 1; ended there (an EOS first, an abort), the
    request's max_tokens is what its client asked, not 1."""
    observer = RequestObserver(default_cluster_config(), {}, {})
    where = SimpleNamespace(instance_id="p-0", role="prefill")
    observer.add_instance("p-0", "prefill")
    part = Request("r", [1, 2, 3], SamplingParams(max_tokens=1), eos_token_id=2)
    now = time.monotonic()
    record = SimpleNamespace(
        request=part,
        trace=None,
        sent=[2],
        first_token_at=now,
        first_scheduled_at=now,
        placement=SimpleNamespace(client_params=SamplingParams(max_tokens=64)),
    )
    observer.finished(record, EngineCoreOutput("r", [2], FinishReason.STOP), where)
    assert _sums(observer)["tandem:request_params_max_tokens_sum"] == 64


def test_a_step_that_computes_nothing_is_no_iteration() -> None:
    """Steps that only carry instructions (finished ids, KV releases) or wait for loads are
    not iterations (vLLM records none): they flooded the lowest bucket."""
    observer = RequestObserver(default_cluster_config(), {}, {})
    where = SimpleNamespace(instance_id="p-0", role="prefill")
    observer.add_instance("p-0", "prefill")
    for tokens in (0, 0, 0, 48):
        observer.step(where, tokens)
    sums = _sums(observer)
    assert sums["tandem:iteration_tokens_total_count"] == 1
    assert sums["tandem:iteration_tokens_total_sum"] == 48


def test_the_autoscalers_tpot_is_the_pace_on_the_decode_instance_alone() -> None:
    """A decode part's first token came from the prefill instance, a hand-off before its
    second: the pool's TPOT signal starts at the first token made on the decode instance
    (more decode instances would not shorten a KV transfer). The client-facing TPOT metric
    still counts from the client's first token."""
    observer = RequestObserver(default_cluster_config(), {}, {})
    observer.add_instance("p-0", "decode")
    signals: list[tuple[str, str, float, float]] = []
    observer.latency_sink = lambda iid, kind, value, span: signals.append((iid, kind, value, span))
    where = SimpleNamespace(instance_id="p-0", role="decode")
    now = time.monotonic()
    record = SimpleNamespace(
        request=Request("r", [1, 2, 3], SamplingParams(max_tokens=4)),
        trace=None,
        sent=[5, 6, 7, 8],  # the first from the prefill instance, 1 s ago (a slow hand-off)
        first_token_at=now - 1.0,
        first_scheduled_at=now - 1.1,
        made_here_from=(now - 0.06, 1),  # then 3 tokens here, 30 ms apart
        placement=SimpleNamespace(client_params=None),
    )
    observer.finished(record, EngineCoreOutput("r", [8], FinishReason.LENGTH), where)
    ((iid, kind, tpot, _),) = signals
    assert (iid, kind) == ("p-0", "tpot") and 0.03 <= tpot < 0.1
    assert _sums(observer)["tandem:request_time_per_output_token_seconds_sum"] >= 0.33


def test_decode_time_and_tpot_end_at_the_last_token_not_at_an_abort() -> None:
    """As vLLM's (decode time = last token - first token): a request that made 3 tokens
    50 ms apart, then waited (preempted, its client gone) 5 s before its abort, decoded for
    0.1 s at 50 ms per token -- not for 5.1 s at 2.55 s per token."""
    observer = RequestObserver(default_cluster_config(), {}, {})
    observer.add_instance("p-0", "decode")
    where = SimpleNamespace(instance_id="p-0", role="decode")
    now = time.monotonic()
    record = SimpleNamespace(
        request=Request("r", [1, 2, 3], SamplingParams(max_tokens=64)),
        trace=None,
        sent=[5, 6, 7],
        first_token_at=now - 5.2,
        last_token_at=now - 5.1,
        first_scheduled_at=now - 5.3,
        placement=SimpleNamespace(client_params=None),
    )
    observer.finished(record, EngineCoreOutput("r", [], FinishReason.ABORT), where)
    sums = _sums(observer)
    assert 0.04 <= sums["tandem:request_time_per_output_token_seconds_sum"] < 0.1
    assert 0.09 <= sums["tandem:request_decode_time_seconds_sum"] < 0.2
    assert 0.19 <= sums["tandem:request_inference_time_seconds_sum"] < 0.3
    assert sums["tandem:e2e_request_latency_seconds_sum"] >= 5.2  # (the end: the abort)


def test_the_central_schedulers_outcome_counters_are_exported_from_the_start() -> None:
    """Requests the central scheduler ends count under ``instance=""``: those counters are
    there at 0 from the start, as an instance's are (a series that appears only at its
    first event loses that event to rate())."""
    observer = RequestObserver(default_cluster_config(), {}, {})
    central = {
        (s.name, s.labels.get("finished_reason"))
        for family in text_string_to_metric_families(observer.render({"instances": {}}))
        for s in family.samples
        if s.labels.get("instance") == "" and s.value == 0
    }
    for reason in ("stop", "length", "abort", "error"):
        assert ("tandem:request_success_total", reason) in central, central
    assert ("tandem:goodput_requests_total", None) in central
    assert ("tandem:requests_finished_total", None) in central


def test_a_prefilled_request_ended_before_its_hand_off_decoded_for_no_time() -> None:
    """Engine actors: a prefilled request aborted while it waited for its hand-off has one
    token, its last: no decode time, however long after its abort came (it ran to the
    abort)."""
    from cluster.control.engine_actor import _EndedPrefilled

    observer = RequestObserver(default_cluster_config(), {}, {})
    observer.add_instance("p-0", "prefill")
    now = time.monotonic()
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=8))
    route = SimpleNamespace(request=request, client_params=None)
    prefilled = SimpleNamespace(
        first=EngineCoreOutput("r", [5], None), first_token_at=now - 5.0, scheduled_at=now - 5.1
    )
    ended = _EndedPrefilled(route, prefilled)  # type: ignore[arg-type]
    where = SimpleNamespace(instance_id="p-0", role="prefill")
    observer.finished(ended, EngineCoreOutput("r", [], FinishReason.ABORT), where)
    sums = _sums(observer)
    assert sums["tandem:request_decode_time_seconds_sum"] < 0.01
    assert sums["tandem:request_inference_time_seconds_sum"] < 0.2
