"""What the SchedulerActor records about each request: Prometheus metrics (TTFT, inter-token
latency, queue time, end-to-end latency, goodput, KV transfers) and, with tracing on, the
request's spans (``RequestTrace``). The actor calls one method per event of a request's life;
nothing here changes what happens to the request."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from cluster.config import ClusterConfig, served_model_name
from cluster.control.engine_loop import EngineLoop
from cluster.control.flights import Flight
from cluster.control.placement import InstanceSpec
from cluster.control.summaries import InstanceView
from cluster.observability.metrics import ClusterMetrics
from scheduler.outputs import EngineCoreOutput


class RequestObserver:
    """Metrics and traces of the requests of one cluster.

    ``roles`` and ``specs`` are the actor's own dicts (filled at start, read here)."""

    def __init__(
        self, config: ClusterConfig, roles: dict[str, str], specs: dict[str, InstanceSpec]
    ) -> None:
        slo = config.metrics
        self.metrics = ClusterMetrics(
            served_model_name(config),
            None if slo.slo_ttft_ms is None else slo.slo_ttft_ms / 1000,
            None if slo.slo_tpot_ms is None else slo.slo_tpot_ms / 1000,
        )
        from kv_transfer.tracing import init_tracing

        self.tracer = init_tracing(config.tracing, "scheduler")  # None while tracing is off
        self._roles = roles
        self._specs = specs
        self._recompute = config.kv_transfer.failure_policy == "recompute"

    def add_instance(self, instance_id: str, role: str) -> None:
        self.metrics.add_instance(instance_id, role)

    def render(self, stats: dict[str, Any]) -> str:
        """Prometheus exposition text (``/metrics``)."""
        return self.metrics.render(stats)

    async def flush(self) -> None:
        """Export the buffered spans now (the actor is killed after shutdown: no exit hook)."""
        if self.tracer is not None:
            from kv_transfer.tracing import flush

            await asyncio.to_thread(flush)

    def _role(self, loop: EngineLoop) -> str:
        return self._roles.get(loop.instance_id, "")

    def node(self, loop: EngineLoop | InstanceView) -> str | None:
        spec = self._specs.get(loop.instance_id)
        return None if spec is None else spec.info.get("node_id")

    # -- a request's events, in order --------------------------------------------------------
    def arrived(self, flight: Flight, trace_context: dict[str, str] | None) -> None:
        """Start the request's trace (a child of the caller's context, if it sent one)."""
        if self.tracer is None:
            return
        from cluster.observability.request_trace import RequestTrace
        from kv_transfer.tracing import extract

        request = flight.request
        flight.trace = RequestTrace(
            self.tracer,
            extract(trace_context),
            request.request_id,
            request.num_prompt_tokens,
            request.arrival_time,
        )

    def scheduled(self, loop: EngineLoop, flight: Flight) -> None:
        """A step of ``loop`` took the request (the first one ends its queue time)."""
        if flight.trace is not None:
            flight.trace.scheduled(loop.instance_id, self._role(loop), self.node(loop))
        if flight.scheduled_at is None:
            flight.scheduled_at = now = time.monotonic()
            queued = now - flight.request.arrival_time
            histograms = self.metrics.per_step(loop.instance_id, self._role(loop))
            histograms.queue.observe(max(queued, 0.0))

    def tokens_out(self, flight: Flight, loop: EngineLoop, num: int) -> None:
        """``num`` tokens of the request, sampled by ``loop``, go to the client."""
        if num <= 0:
            return
        if flight.trace is not None:
            flight.trace.tokens(num, flight.num_cached_tokens, loop.instance_id, self.node(loop))
        now = time.monotonic()
        histograms = self.metrics.per_step(loop.instance_id, self._role(loop))
        if flight.first_token_at is None:
            flight.first_token_at = now
            histograms.ttft.observe(now - flight.request.arrival_time)
        elif flight.last_token_at is not None:
            histograms.itl.observe(now - flight.last_token_at)
        flight.last_token_at = now

    def handed_off(self, flight: Flight, decode: InstanceView, transport: str) -> None:
        """The prefilled request goes on to ``decode``; its KV follows."""
        if flight.trace is None:
            return
        block_size = self._specs[decode.instance_id].info["block_size"]
        num_blocks = -(-flight.request.num_prompt_tokens // block_size)
        flight.trace.handed_off(decode.instance_id, self.node(decode), transport, num_blocks)

    def decode_params(self, flight: Flight, params: Any) -> dict[str, Any] | None:
        """The decode request's ``kv_transfer_params``, with the transfer span's context so
        that the decode worker's load joins the trace."""
        if not params:
            return None
        result = dict(params)
        if flight.trace is not None and flight.trace.transfer is not None:
            from kv_transfer.tracing import inject

            result["trace_context"] = inject(flight.trace.transfer)
        return result

    def kv_loads(
        self,
        loop: EngineLoop,
        loads: list[tuple[str, float, int, bool]],
        flights: dict[str, Flight],
    ) -> None:
        """KV loads that ended on ``loop``'s workers: (internal id, seconds, bytes, ok)."""
        self.metrics.kv_loads(loop.instance_id, self._role(loop), loads, self._recompute)
        for req_id, seconds, num_bytes, ok in loads:
            flight = flights.get(req_id)
            if flight is not None and flight.trace is not None:
                flight.trace.kv_loaded(seconds, num_bytes, ok)

    def preempted(self, loop: EngineLoop, flight: Flight) -> None:
        """``loop`` preempted the request (its KV is freed; it will be recomputed)."""
        if flight.trace is not None:
            flight.trace.preempted(loop.instance_id)

    def moved(self, flight: Flight, reason: str) -> None:
        """The request's instance failed; it is placed again."""
        if flight.trace is not None:
            flight.trace.moved(reason)

    def finished(self, flight: Flight, final: EngineCoreOutput) -> None:
        if final.finish_reason is None:
            return
        if flight.trace is not None:
            flight.trace.finish(final.finish_reason.value, final.error)
        now = time.monotonic()
        first = flight.first_token_at
        ttft = None if first is None else first - flight.request.arrival_time
        num = len(flight.sent)
        tpot = (now - first) / (num - 1) if first is not None and num > 1 else None
        self.metrics.request_finished(
            flight.loop.instance_id,
            self._role(flight.loop),
            final.finish_reason.value,
            now - flight.request.arrival_time,
            ttft,
            tpot,
        )
