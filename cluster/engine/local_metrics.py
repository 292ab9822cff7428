"""The in-process engine's request-level metrics (``AsyncLLM``): the series the SchedulerActor
records for a cluster -- time to first token, inter-token latency, queue time, end-to-end
latency, tokens per request, finish reasons, goodput, tokens per step -- on its one instance,
so ``/metrics`` reads the same in front of one process as in front of a cluster.

Fed from the event loop: a request when it is added, then each step's outcome (the samples
scheduled for the first time, the step's tokens, the outputs it changed). Times are taken
where the loop sees them, as the SchedulerActor's are where it sees an engine's outputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cluster.config import MetricsConfig
from cluster.engine.outputs import RequestOutput
from cluster.observability.metrics import ClusterMetrics, RequestTimes
from scheduler import SamplingParams


@dataclass
class _Sample:
    scheduled: float | None = None  # its first step
    first: float | None = None  # its first token
    last: float | None = None  # its latest token
    num_tokens: int = 0  # made so far
    done: bool = False


@dataclass
class _Request:
    arrival: float
    num_prompt_tokens: int
    max_tokens: int | None
    samples: list[_Sample] = field(default_factory=list)


class LocalMetrics:
    """One engine's requests, as one instance's series (``instance``, role ``both``).
    Goodput is judged against ``slo`` (``metrics`` of a ``ClusterConfig``; its defaults, as
    a cluster's, when not given): without SLOs every request served counted as good, and
    ``goodput_requests_total`` read as ``request_success_total``."""

    def __init__(
        self,
        model_name: str,
        instance: str,
        role: str = "both",
        slo: MetricsConfig | None = None,
    ) -> None:
        slo = MetricsConfig() if slo is None else slo
        ttft, tpot = slo.slo_ttft_ms, slo.slo_tpot_ms
        self.metrics = ClusterMetrics(
            model_name,
            None if ttft is None else ttft / 1000,
            None if tpot is None else tpot / 1000,
            vllm_names=slo.vllm_names,
        )
        self.instance, self.role = instance, role
        self.metrics.add_instance(instance, role)
        self._requests: dict[str, _Request] = {}

    def added(self, request_id: str, num_prompt_tokens: int, params: SamplingParams) -> None:
        """A request was taken (its samples: ``{id}#{i}`` when ``n`` > 1, as the engine's)."""
        request = _Request(time.monotonic(), num_prompt_tokens, params.max_tokens)
        request.samples = [_Sample() for _ in range(params.n)]
        self._requests[request_id] = request

    def forgotten(self, request_id: str) -> None:
        """A request whose end will never be reported (aborted, its final output dropped)."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            now = time.monotonic()
            for index, sample in enumerate(request.samples):
                if not sample.done:
                    self._finished(request, index, sample, "abort", sample.num_tokens, now)

    def failed_all(self) -> None:
        """The engine died: every request it held ended with an error (no step will report
        their ends; they were missing from the finished and end-to-end series)."""
        now = time.monotonic()
        for request in self._requests.values():
            for index, sample in enumerate(request.samples):
                if not sample.done:
                    self._finished(request, index, sample, "error", sample.num_tokens, now)
        self._requests.clear()

    def stepped(
        self, scheduled_new: list[str], num_tokens: int, outputs: list[RequestOutput]
    ) -> None:
        """A step ran: ``scheduled_new`` (sample ids) took their first step, it computed
        ``num_tokens`` tokens, and changed ``outputs``."""
        now = time.monotonic()
        histograms = self.metrics.per_step(self.instance, self.role)
        if num_tokens > 0:
            histograms.iteration_tokens.observe(num_tokens)
        for sample_id in scheduled_new:
            found = self._sample(sample_id)
            if found is not None and found[1].scheduled is None:
                found[1].scheduled = now
                histograms.queue.observe(max(now - found[0].arrival, 0.0))
        for out in outputs:
            request = self._requests.get(out.request_id)
            if request is None:
                continue
            for completion in out.outputs:
                sample = request.samples[completion.index]
                if sample.done:
                    continue
                if completion.new_token_ids:
                    if sample.first is None:
                        sample.first = now
                        histograms.ttft.observe(now - request.arrival)
                    elif sample.last is not None:
                        histograms.itl.observe(now - sample.last)
                    sample.last = now
                    sample.num_tokens = len(completion.token_ids)
                if completion.finish_reason is not None:
                    reason, num = completion.finish_reason, len(completion.token_ids)
                    self._finished(request, completion.index, sample, reason, num, now)
            if all(s.done for s in request.samples):
                del self._requests[out.request_id]

    def render(self, stats: dict[str, object]) -> str:
        return self.metrics.render(stats)

    def _sample(self, sample_id: str) -> tuple[_Request, _Sample] | None:
        request = self._requests.get(sample_id)
        if request is not None:
            return request, request.samples[0]
        parent, _, index = sample_id.rpartition("#")
        request = self._requests.get(parent)
        if request is None or not index.isdigit() or int(index) >= len(request.samples):
            return None
        return request, request.samples[int(index)]

    def _finished(
        self, request: _Request, index: int, sample: _Sample, reason: str, num: int, now: float
    ) -> None:
        sample.done = True
        first, scheduled = sample.first, sample.scheduled
        self.metrics.request_finished(
            self.instance,
            self.role,
            reason,
            RequestTimes.of(request.arrival, scheduled, first, now, num, sample.last),
            request.num_prompt_tokens,
            num,
            request.max_tokens,
            len(request.samples) if index == 0 else None,  # n, once per request
        )
