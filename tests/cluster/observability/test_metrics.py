"""``ClusterMetrics``: goodput against the SLOs, and the exposition text (no Ray)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from cluster.observability.metrics import ClusterMetrics, RequestTimes


def _finish(
    m: ClusterMetrics, reason: str, e2e: float, ttft: float | None, tpot: float | None
) -> None:
    times = RequestTimes(e2e, ttft, tpot, ttft, None if ttft is None else e2e - ttft, e2e)
    m.request_finished("d-0", "decode", reason, times, 16, 8, 32)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_goodput_counts_requests_meeting_both_slos() -> None:
    m = ClusterMetrics("m", slo_ttft_s=1.0, slo_tpot_s=0.1)
    _finish(m, "length", 2.0, 0.5, 0.05)  # good
    _finish(m, "stop", 2.0, 1.5, 0.05)  # slow start
    _finish(m, "stop", 2.0, 0.5, 0.2)  # slow decode
    _finish(m, "abort", 2.0, 0.1, 0.01)  # not served
    _finish(m, "length", 0.3, 0.3, None)  # one token
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
    _finish(m, "stop", 9.0, 5.0, 3.0)
    _finish(m, "error", 9.0, None, None)
    samples = _samples(m.render({"instances": {}}))
    labels = (("instance", "d-0"), ("model_name", "m"), ("role", "decode"))
    assert samples[("tandem:goodput_requests_total", labels)] == 1


def test_vllm_request_series() -> None:
    """vLLM's per-request and per-step series: prefill, decode and inference times, prompt and
    generation tokens, max_tokens, tokens per step."""
    m = ClusterMetrics("m", slo_ttft_s=None, slo_tpot_s=None)
    m.add_instance("d-0", "decode")
    times = RequestTimes(2.0, 0.5, 0.1, prefill_s=0.4, decode_s=1.5, inference_s=1.9)
    m.request_finished("d-0", "decode", "stop", times, 100, 16, 64)
    m.per_step("d-0", "decode").iteration_tokens.observe(300)
    samples = _samples(m.render({"instances": {}}))
    labels = (("instance", "d-0"), ("model_name", "m"), ("role", "decode"))
    for name, value in (
        ("tandem:request_prefill_time_seconds_sum", 0.4),
        ("tandem:request_decode_time_seconds_sum", 1.5),
        ("tandem:request_inference_time_seconds_sum", 1.9),
        ("tandem:request_prompt_tokens_sum", 100),
        ("tandem:request_generation_tokens_sum", 16),
        ("tandem:request_params_max_tokens_sum", 64),
        ("tandem:iteration_tokens_total_sum", 300),
    ):
        assert samples[(name, labels)] == value, name
    bucket = "tandem:iteration_tokens_total_bucket"
    assert samples[(bucket, tuple(sorted((*labels, ("le", "500.0")))))] == 1
    assert samples[(bucket, tuple(sorted((*labels, ("le", "200.0")))))] == 0


def test_cache_config_info_and_vllm_names() -> None:
    m = ClusterMetrics("m", slo_ttft_s=None, slo_tpot_s=None, vllm_names=True)
    m.add_instance("d-0", "decode")
    stats = {
        "instances": {
            "d-0": {
                "role": "decode",
                "block_size": 16,
                "num_blocks": 100,
                "enable_prefix_caching": True,
                "num_running": 3,
            }
        }
    }
    samples = _samples(m.render(stats))
    info = (
        ("block_size", "16"),
        ("enable_prefix_caching", "True"),
        ("instance", "d-0"),
        ("model_name", "m"),
        ("num_gpu_blocks", "100"),
        ("role", "decode"),
    )
    labels = (("instance", "d-0"), ("model_name", "m"), ("role", "decode"))
    for prefix in ("tandem", "vllm"):  # every series under both names
        assert samples[(f"{prefix}:cache_config_info", info)] == 1
        assert samples[(f"{prefix}:num_requests_running", labels)] == 3
        assert (f"{prefix}:time_to_first_token_seconds_count", labels) in samples
    assert not ClusterMetrics("m", None, None).vllm_names


def test_vllm_names_rename_metric_names_only_and_keep_vllms_old_cache_name() -> None:
    """Under vLLM's names a label value holding "tandem:" (a model or adapter name) stays
    as it is, and KV usage is also ``vllm:gpu_cache_usage_perc`` (vLLM's older name, which
    gateways and vLLM's own dashboard still read)."""
    m = ClusterMetrics("tandem:m", slo_ttft_s=None, slo_tpot_s=None, vllm_names=True)
    m.add_instance("d-0", "decode")
    stats = {"instances": {"d-0": {"role": "decode", "kv_cache_usage": 0.5}}}
    samples = _samples(m.render(stats))
    labels = (("instance", "d-0"), ("model_name", "tandem:m"), ("role", "decode"))
    for name in ("tandem:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"):
        assert samples[(name, labels)] == 0.5
    assert samples[("vllm:gpu_cache_usage_perc", labels)] == 0.5
    assert not any(dict(labels_).get("model_name") == "vllm:m" for _, labels_ in samples)


def test_request_params_n_and_lora_requests_info() -> None:
    """vLLM's request_params_n (once per user request: given with its first sample only)
    and lora_requests_info (an instance's adapters, in labels)."""
    m = ClusterMetrics("m", slo_ttft_s=None, slo_tpot_s=None, vllm_names=True)
    m.add_instance("d-0", "decode")
    times = RequestTimes(2.0, 0.5, 0.1, prefill_s=0.4, decode_s=1.5, inference_s=1.9)
    m.request_finished("d-0", "decode", "stop", times, 10, 4, 8, n=3)  # sample 0 of n=3
    for _ in range(2):  # samples 1 and 2 count nothing here
        m.request_finished("d-0", "decode", "stop", times, 10, 4, 8, n=None)
    stats = {
        "instances": {
            "d-0": {
                "role": "decode",
                "max_loras": 2,
                "running_loras": ["a", "b"],
                "waiting_loras": [],
            }
        }
    }
    samples = _samples(m.render(stats))
    labels = (("instance", "d-0"), ("model_name", "m"), ("role", "decode"))
    assert samples[("vllm:request_params_n_count", labels)] == 1
    assert samples[("vllm:request_params_n_sum", labels)] == 3
    info = tuple(
        sorted(
            (
                *labels,
                ("max_lora", "2"),
                ("running_lora_adapters", "a,b"),
                ("waiting_lora_adapters", ""),
            )
        )
    )
    assert samples[("vllm:lora_requests_info", info)] > 1.7e9  # the scrape time


def test_only_a_first_sample_counts_n() -> None:
    """By the index its client set, not by its id (a client may name a request "job#2")."""
    from cluster.control.flights import clone_request, later_sample
    from scheduler import Request, SamplingParams

    def request(rid: str, index: int) -> Request:
        return Request(rid, [1, 2], SamplingParams(), num_samples=3, sample_index=index)

    assert not later_sample(request("job#2", 0)) and later_sample(request("x", 1))
    assert later_sample(clone_request(request("y#1", 1), request_id="y#1@7"))


def test_an_instance_that_left_leaves_the_exposition() -> None:
    """A retired instance's series go (an autoscaler's instances, each with a new id, piled
    up in every scrape); the others' stay as they were."""
    m = ClusterMetrics("m", slo_ttft_s=None, slo_tpot_s=None)
    m.add_instance("d-0", "decode")
    m.add_instance("d-1", "decode")
    _finish(m, "stop", 2.0, 0.5, 0.05)
    m.per_step("d-0", "decode").itl.observe(0.01)
    m.per_step("d-1", "decode").itl.observe(0.01)
    m.kv_loads("d-0", "decode", [("a", 0.01, 100, True)], recompute=True)
    before = _samples(m.render({"instances": {}}))
    m.remove_instance("d-0", "decode")
    after = _samples(m.render({"instances": {}}))
    assert not [key for key in after if ("instance", "d-0") in key[1]]
    assert [key for key in before if ("instance", "d-0") in key[1]]  # (there before)
    d1 = {k: v for k, v in before.items() if ("instance", "d-1") in k[1]}
    assert d1 and all(after[k] == v for k, v in d1.items())
    m.per_step("d-0", "decode").itl.observe(0.01)  # a late observation makes it anew
    assert (
        "tandem:inter_token_latency_seconds_count",
        (("instance", "d-0"), ("model_name", "m"), ("role", "decode")),
    ) in _samples(m.render({"instances": {}}))


def test_request_times_end_the_decode_at_the_last_token() -> None:
    """``last`` (the last token) bounds the decode, inference and per-token times, as in
    vLLM; without it (not known) the end does."""
    times = RequestTimes.of(0.0, 1.0, 2.0, 10.0, 5, last=3.0)
    assert times.e2e_s == 10.0 and times.ttft_s == 2.0 and times.prefill_s == 1.0
    assert times.decode_s == 1.0 and times.inference_s == 2.0 and times.tpot_s == 0.25
    assert RequestTimes.of(0.0, 1.0, 2.0, 10.0, 5).decode_s == 8.0
    assert RequestTimes.of(0.0, 1.0, None, 10.0, 0, last=None).inference_s == 9.0


def test_the_in_process_engines_goodput_is_judged_against_the_slos() -> None:
    """The in-process engine (``AsyncLLM``) serves the cluster's series, goodput with them:
    judged against the same SLOs (the cluster's defaults, 2 s TTFT and 200 ms TPOT) -- it
    had none, so every request served counted as good, however slow."""
    from cluster.config import MetricsConfig
    from cluster.engine.local_metrics import LocalMetrics

    def goodput(local: LocalMetrics, ttft: float) -> float:
        times = RequestTimes(ttft + 1.0, ttft, 0.05, ttft, 1.0, ttft + 1.0)
        local.metrics.request_finished("local", "both", "length", times, 4, 21, 21)
        labels = (("instance", "local"), ("model_name", "m"), ("role", "both"))
        return _samples(local.render({"instances": {}}))[("tandem:goodput_requests_total", labels)]

    assert goodput(LocalMetrics("m", "local"), 5.0) == 0  # past the default 2 s TTFT
    assert goodput(LocalMetrics("m", "local"), 0.5) == 1
    lax = MetricsConfig(slo_ttft_ms=None, slo_tpot_ms=None)
    assert goodput(LocalMetrics("m", "local", slo=lax), 5.0) == 1


def test_the_slos_are_bucket_bounds_of_their_histograms() -> None:
    """The share of requests within the TTFT / TPOT SLO reads exactly off the histograms:
    each SLO is a bound (2 s fell inside vLLM's 1-2.5 s TTFT bucket, 40 ms inside its
    25-50 ms TPOT one); vLLM's bounds all stay."""
    from cluster.observability.histograms import ITL_BUCKETS, TTFT_BUCKETS

    m = ClusterMetrics("m", slo_ttft_s=2.0, slo_tpot_s=0.04)
    m.add_instance("d-0", "decode")
    bounds: dict[str, set[float]] = {}
    for family in text_string_to_metric_families(m.render({"instances": {}})):
        for s in family.samples:
            if s.name.endswith("_bucket") and s.labels.get("instance") == "d-0":
                bounds.setdefault(s.name, set()).add(float(s.labels["le"]))
    ttft = bounds["tandem:time_to_first_token_seconds_bucket"]
    tpot = bounds["tandem:request_time_per_output_token_seconds_bucket"]
    assert 2.0 in ttft and set(TTFT_BUCKETS) <= ttft
    assert 0.04 in tpot and set(ITL_BUCKETS) <= tpot
    assert 0.04 not in bounds["tandem:inter_token_latency_seconds_bucket"]  # (vLLM's as they are)


def test_the_in_process_engine_takes_its_metrics_settings() -> None:
    """``AsyncLLM(..., metrics=MetricsConfig(...))``: its SLOs and vLLM's names (it always
    had the defaults: no SLO could be set, nor vllm_names turned on)."""
    from cluster.config import MetricsConfig
    from cluster.engine.async_llm import AsyncLLM

    settings = MetricsConfig(slo_ttft_ms=500, slo_tpot_ms=None, vllm_names=True)
    metrics = AsyncLLM(None, "m", settings).metrics.metrics  # type: ignore[arg-type]
    assert metrics.slo_ttft_s == 0.5 and metrics.slo_tpot_s is None and metrics.vllm_names
    assert AsyncLLM(None, "m").metrics.metrics.slo_ttft_s == 2.0  # type: ignore[arg-type]
