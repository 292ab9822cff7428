"""``ClusterMetrics``: goodput against the SLOs, and the exposition text (no Ray)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from cluster.observability.metrics import ClusterMetrics


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_goodput_counts_requests_meeting_both_slos() -> None:
    m = ClusterMetrics("m", slo_ttft_s=1.0, slo_tpot_s=0.1)
    m.request_finished("d-0", "decode", "length", 2.0, ttft_s=0.5, tpot_s=0.05)  # good
    m.request_finished("d-0", "decode", "stop", 2.0, ttft_s=1.5, tpot_s=0.05)  # slow start
    m.request_finished("d-0", "decode", "stop", 2.0, ttft_s=0.5, tpot_s=0.2)  # slow decode
    m.request_finished("d-0", "decode", "abort", 2.0, ttft_s=0.1, tpot_s=0.01)  # not served
    m.request_finished("d-0", "decode", "length", 0.3, ttft_s=0.3, tpot_s=None)  # one token
    m.kv_loads("d-0", "decode", [("a", 0.01, 100, True), ("b", 2.0, 0, False)], recompute=True)
    samples = _samples(m.render({"instances": {}}))
    labels = (("instance", "d-0"), ("model_name", "m"), ("role", "decode"))
    assert samples[("tandem:goodput_requests_total", labels)] == 2
    assert samples[("tandem:requests_finished_total", labels)] == 5
    assert samples[("tandem:e2e_request_latency_seconds_count", labels)] == 5
    assert samples[("tandem:request_time_per_output_token_seconds_count", labels)] == 4
    reason = (("finished_reason", "abort"), *labels)
    assert samples[("tandem:request_success_total", tuple(sorted(reason)))] == 1
    failed = tuple(sorted((*labels, ("outcome", "failed"))))
    assert samples[("tandem:kv_transfer_duration_seconds_count", failed)] == 1
    assert samples[("tandem:kv_recompute_fallbacks_total", labels)] == 1


def test_no_slo_means_every_served_request_is_good() -> None:
    m = ClusterMetrics("m", slo_ttft_s=None, slo_tpot_s=None)
    m.request_finished("d-0", "decode", "stop", 9.0, ttft_s=5.0, tpot_s=3.0)
    m.request_finished("d-0", "decode", "error", 9.0, ttft_s=None, tpot_s=None)
    samples = _samples(m.render({"instances": {}}))
    labels = (("instance", "d-0"), ("model_name", "m"), ("role", "decode"))
    assert samples[("tandem:goodput_requests_total", labels)] == 1
