"""Prometheus metrics, named like vLLM's with a ``tandem:`` prefix and ``model_name`` /
``instance`` / ``role`` labels (DESIGN §6).

Two sources, rendered together by ``SchedulerActor.metrics_text()`` (so every ingress replica
serves the same cluster-wide numbers on ``/metrics``):

- ``ClusterMetrics`` (here): per-request histograms and counters the SchedulerActor observes
  as requests move (TTFT, inter-token latency, TPOT, end-to-end latency, queue time, KV
  transfer durations, finished requests, goodput against ``metrics.slo_ttft_ms`` /
  ``slo_tpot_ms``);
- the instances' own gauges and counters (``EngineLoop.stats()``), read at scrape time
  (``exposition.py``).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from cluster.observability.exposition import LABELS, merge_expositions, render_stats
from cluster.observability.histograms import (
    E2E_BUCKETS,
    ITL_BUCKETS,
    N_BUCKETS,
    TOKEN_BUCKETS,
    TRANSFER_BUCKETS,
    TTFT_BUCKETS,
    StepHistogramCollector,
    StepHistogramFamily,
    StepHistograms,
)

FINISH_REASONS = ("stop", "length", "abort", "error")  # (scheduler.request.FinishReason)


@dataclass(frozen=True)
class RequestTimes:
    """A finished request's durations (seconds; None where it never got that far)."""

    e2e_s: float
    ttft_s: float | None
    tpot_s: float | None
    prefill_s: float | None  # its first step to its first token
    decode_s: float | None  # its first token to its last
    inference_s: float | None  # its first step to its last token

    @classmethod
    def of(
        cls,
        arrival: float,
        scheduled: float | None,
        first: float | None,
        now: float,
        num_tokens: int,
        last: float | None = None,
    ) -> RequestTimes:
        """From a request's instants (one clock): arrived, first step, first token, ended;
        ``num_tokens`` it generated; ``last``: its last token, when known. As vLLM's, the
        decode and inference times and the TPOT end at the last token, not at the end: a
        request aborted or failed long after its last token (preempted and waiting, a client
        that gave up) read as a slow decode, in the histograms that SLOs are judged by."""
        end = now if first is None or last is None else max(last, first)
        return cls(
            e2e_s=now - arrival,
            ttft_s=None if first is None else first - arrival,
            tpot_s=(end - first) / (num_tokens - 1)
            if first is not None and num_tokens > 1
            else None,
            prefill_s=None if first is None or scheduled is None else first - scheduled,
            decode_s=None if first is None else end - first,
            inference_s=None if scheduled is None else end - scheduled,
        )


def with_bound(buckets: tuple[float, ...], slo_s: float | None) -> tuple[float, ...]:
    """vLLM's bucket bounds, and the SLO's: a dashboard or an alert reads the share of
    requests within the SLO from the histogram exactly (the default 2 s TTFT fell inside
    vLLM's 1-2.5 s bucket, a 40 ms TPOT inside its 25-50 ms one). Every process of a
    cluster builds its histograms from the one config: their bounds agree when merged."""
    if slo_s is None or slo_s in buckets:
        return buckets
    return tuple(sorted((*buckets, slo_s)))


class ClusterMetrics:
    """The SchedulerActor's request-level metrics (one registry per actor)."""

    def __init__(
        self,
        model_name: str,
        slo_ttft_s: float | None,
        slo_tpot_s: float | None,
        vllm_names: bool = False,
    ) -> None:
        self.model_name = model_name
        self.vllm_names = vllm_names  # every series also as vllm:... (render)
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_s = slo_tpot_s
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = StepHistogramFamily(
            "tandem:time_to_first_token_seconds",
            "Time to first token (arrival to the first token, from the instance that sampled it).",
            with_bound(TTFT_BUCKETS, slo_ttft_s),
        )
        self.itl = StepHistogramFamily(
            "tandem:inter_token_latency_seconds",
            "Time between two outputs of a request.",
            ITL_BUCKETS,
        )
        self.tpot = Histogram(
            "tandem:request_time_per_output_token_seconds",
            "A request's mean time per output token after the first.",
            LABELS,
            registry=r,
            buckets=with_bound(ITL_BUCKETS, slo_tpot_s),
        )
        self.e2e = Histogram(
            "tandem:e2e_request_latency_seconds",
            "Arrival to the last token.",
            LABELS,
            registry=r,
            buckets=E2E_BUCKETS,
        )
        self.queue = StepHistogramFamily(
            "tandem:request_queue_time_seconds",
            "Arrival to the request's first step.",
            E2E_BUCKETS,
        )
        # vLLM's request-level series (its names, tandem: prefix).
        self.iteration_tokens = StepHistogramFamily(
            "tandem:iteration_tokens_total",
            "Tokens scheduled in one engine step.",
            TOKEN_BUCKETS,
        )
        self.prefill_time = StepHistogramFamily(
            "tandem:request_prefill_time_seconds",
            "A request's first step to its first token.",
            E2E_BUCKETS,
        )
        self.decode_time = StepHistogramFamily(
            "tandem:request_decode_time_seconds",
            "A request's first token to its last.",
            E2E_BUCKETS,
        )
        self.inference_time = StepHistogramFamily(
            "tandem:request_inference_time_seconds",
            "A request's first step to its last token.",
            E2E_BUCKETS,
        )
        self.prompt_tokens = StepHistogramFamily(
            "tandem:request_prompt_tokens", "Prompt tokens of a finished request.", TOKEN_BUCKETS
        )
        self.generation_tokens = StepHistogramFamily(
            "tandem:request_generation_tokens",
            "Tokens generated for a finished request.",
            TOKEN_BUCKETS,
        )
        self.params_max_tokens = StepHistogramFamily(
            "tandem:request_params_max_tokens",
            "The max_tokens of a finished request.",
            TOKEN_BUCKETS,
        )
        self.params_n = StepHistogramFamily(
            "tandem:request_params_n",
            "The n of a finished request (counted once, with its first sample).",
            N_BUCKETS,
        )
        families = [self.ttft, self.itl, self.queue, self.iteration_tokens, self.prefill_time]
        families += [self.decode_time, self.inference_time, self.prompt_tokens]
        families += [self.generation_tokens, self.params_max_tokens, self.params_n]
        r.register(StepHistogramCollector(families))
        self._step_families = families
        self.transfer = Histogram(
            "tandem:kv_transfer_duration_seconds",
            "One KV load, start to data in the blocks (failed ones too).",
            [*LABELS, "outcome"],
            registry=r,
            buckets=TRANSFER_BUCKETS,
        )
        self.finished = Counter(
            "tandem:request_success",
            "Finished requests by finish reason.",
            [*LABELS, "finished_reason"],
            registry=r,
        )
        self.goodput = Counter(
            "tandem:goodput_requests",
            "Finished requests (stop or length) that met the TTFT "
            "and TPOT SLOs (compare with tandem:requests_finished).",
            LABELS,
            registry=r,
        )
        self.total = Counter(
            "tandem:requests_finished",
            "Finished requests, any reason (goodput's total).",
            LABELS,
            registry=r,
        )
        self.recompute = Counter(
            "tandem:kv_recompute_fallbacks",
            "Decode-side recomputes after a failed KV load.",
            LABELS,
            registry=r,
        )
        self._per_step: dict[tuple[str, str], StepHistograms] = {}
        self._labelled = [self.tpot, self.e2e, self.transfer, self.finished, self.goodput]
        self._labelled += [self.total, self.recompute]

    def add_instance(self, instance: str, role: str) -> None:
        """Export every series of an instance from the start, at 0 (a dashboard's rate() of a
        series that appears only at its first event misses that event)."""
        labels = self.labels(instance, role)
        for metric in (self.ttft, self.itl, self.tpot, self.e2e, self.queue):
            metric.labels(*labels)
        for family in (self.iteration_tokens, self.prefill_time, self.decode_time):
            family.labels(*labels)
        for family in (self.inference_time, self.prompt_tokens, self.generation_tokens):
            family.labels(*labels)
        self.params_max_tokens.labels(*labels)
        self.params_n.labels(*labels)
        for counter in (self.goodput, self.total, self.recompute):
            counter.labels(*labels)
        for outcome in ("ok", "failed"):
            self.transfer.labels(*labels, outcome)
        for reason in FINISH_REASONS:
            self.finished.labels(*labels, reason)

    def add_central(self) -> None:
        """Export the outcome counters of the requests ended by the central scheduler (none of
        its instances' doing: never placed, aborted between instances, every end under
        engine actors) from the start, at 0 -- under ``instance=""`` -- as ``add_instance``
        does an instance's: the first abort or error of each central actor's life was lost
        to rate(). (Its histograms stay created at their first request: an instance's set
        is some 35 KB a scrape.)"""
        labels = self.labels("", "")
        for counter in (self.goodput, self.total):
            counter.labels(*labels)
        for reason in FINISH_REASONS:
            self.finished.labels(*labels, reason)

    def remove_instance(self, instance: str, role: str) -> None:
        """Stop exporting an instance's series (it left the cluster): without this, every
        instance an autoscaler ever made stayed in each scrape (some 35 KB apiece)."""
        labels = self.labels(instance, role)
        self._per_step.pop((instance, role), None)
        for family in self._step_families:
            family.children.pop(labels, None)
        for metric in self._labelled:
            extra: list[tuple[str, ...]] = [()]
            if metric is self.transfer:
                extra = [("ok",), ("failed",)]
            elif metric is self.finished:
                extra = [(reason,) for reason in FINISH_REASONS]
            for more in extra:
                with contextlib.suppress(KeyError):
                    metric.remove(*labels, *more)

    def labels(self, instance: str, role: str) -> tuple[str, str, str]:
        return (self.model_name, instance, role)

    def per_step(self, instance: str, role: str) -> StepHistograms:
        """The labelled histograms observed on every step of a request, looked up once per
        instance (``labels()`` costs a lock and a dict look-up per call)."""
        key = (instance, role)
        found = self._per_step.get(key)
        if found is None:
            labels = self.labels(instance, role)
            found = self._per_step[key] = StepHistograms(
                self.ttft.labels(*labels),
                self.itl.labels(*labels),
                self.queue.labels(*labels),
                self.iteration_tokens.labels(*labels),
            )
        return found

    def request_finished(
        self,
        instance: str,
        role: str,
        reason: str,
        times: RequestTimes,
        num_prompt_tokens: int,
        num_output_tokens: int,
        max_tokens: int | None,
        n: int | None = None,
    ) -> None:
        """``n``: the user request's ``n``, given for one of its samples only."""
        labels = self.labels(instance, role)
        e2e_s, ttft_s, tpot_s = times.e2e_s, times.ttft_s, times.tpot_s
        for family, value in (
            (self.prefill_time, times.prefill_s),
            (self.decode_time, times.decode_s),
            (self.inference_time, times.inference_s),
            (self.params_max_tokens, max_tokens),
            (self.params_n, n),
        ):
            if value is not None:
                family.labels(*labels).observe(value)
        self.prompt_tokens.labels(*labels).observe(num_prompt_tokens)
        self.generation_tokens.labels(*labels).observe(num_output_tokens)
        self.e2e.labels(*labels).observe(e2e_s)
        self.finished.labels(*labels, reason).inc()
        self.total.labels(*labels).inc()
        if tpot_s is not None:
            self.tpot.labels(*labels).observe(tpot_s)
        good = reason in ("stop", "length") and ttft_s is not None
        if good and self.slo_ttft_s is not None:
            good = ttft_s is not None and ttft_s <= self.slo_ttft_s
        if good and self.slo_tpot_s is not None and tpot_s is not None:
            good = tpot_s <= self.slo_tpot_s
        if good:
            self.goodput.labels(*labels).inc()

    def kv_loads(
        self,
        instance: str,
        role: str,
        loads: list[tuple[str, float, int, bool]],
        recompute: bool,
    ) -> None:
        labels = self.labels(instance, role)
        for _, seconds, _, ok in loads:
            self.transfer.labels(*labels, "ok" if ok else "failed").observe(seconds)
            if not ok and recompute:
                self.recompute.labels(*labels).inc()

    def render_registry(self) -> str:
        """The request-level series alone (an engine actor's part of ``/metrics``)."""
        return generate_latest(self.registry).decode()

    def render(self, stats: dict[str, Any], others: list[str] | None = None) -> str:
        """``/metrics``: this registry's series summed with ``others`` (other processes'
        ``render_registry``), then the instances' gauges from ``stats``."""
        own = generate_latest(self.registry).decode()
        if others:
            own = merge_expositions([own, *others])
        text = own + render_stats(stats, self.model_name)[0]
        if self.vllm_names:  # the same series under vLLM's names (ours are vLLM's, prefixed)
            text += vllm_named(text)
        return text


# A metric's name where the exposition format puts one: a sample's start, a HELP / TYPE line.
_NAMES = re.compile(r"^(# (?:HELP|TYPE) )?tandem:([a-zA-Z0-9_:]*)", re.MULTILINE)
# vLLM names a series had before its present one, still read by gateways and dashboards.
_VLLM_OLD_NAMES = {"kv_cache_usage_perc": "gpu_cache_usage_perc"}


def vllm_named(text: str) -> str:
    """``text``'s series under vLLM's names: the ``tandem:`` prefix of each metric's name
    becomes ``vllm:`` (a label value or help text holding "tandem:" -- an adapter's name --
    stays as it is), and the series vLLM renamed are there under the old name too."""
    out = [_NAMES.sub(lambda m: f"{m[1] or ''}vllm:{m[2]}", text)]
    for line in text.splitlines(keepends=True):  # (a family's lines stay together)
        m = _NAMES.match(line)
        if m is not None and m[2] in _VLLM_OLD_NAMES:
            out.append(f"{m[1] or ''}vllm:{_VLLM_OLD_NAMES[m[2]]}{line[m.end() :]}")
    return "".join(out)
