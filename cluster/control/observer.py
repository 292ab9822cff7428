"""What the SchedulerActor records about each request: Prometheus metrics (TTFT, inter-token
latency, queue time, end-to-end latency, goodput, KV transfers) and, with tracing on, the
request's spans (``RequestTrace``). The actor calls one method per event of a request's life;
nothing here changes what happens to the request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Protocol

from cluster.config import ClusterConfig, served_model_name
from cluster.control.flights import Flight, later_sample
from cluster.control.placement import InstanceSpec
from cluster.control.summaries import InstanceView
from cluster.observability.metrics import ClusterMetrics, RequestTimes
from scheduler.outputs import EngineCoreOutput
from scheduler.request import FinishReason


class Instance(Protocol):
    """What the observer needs of where a request is: an engine or a view of one."""

    @property
    def instance_id(self) -> str: ...

    @property
    def role(self) -> str: ...


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
            vllm_names=slo.vllm_names,
        )
        self.metrics.add_central()
        from kv_transfer.tracing import init_tracing

        self.tracer = init_tracing(config.tracing, "scheduler")  # None while tracing is off
        self._roles = roles
        self._specs = specs
        self._recompute = config.kv_transfer.failure_policy == "recompute"
        # Engine actors make their own spans (children of the root, by context).
        self._engines_trace = config.engine_actors
        # (instance, "ttft" or "tpot", seconds) of each request, where it was measured: the
        # autoscaler's latency signals (``control/autoscaler.py``).
        # (instance, "ttft" or "tpot", seconds, the seconds it was measured over)
        self.latency_sink: Callable[[str, str, float, float], None] | None = None

    def add_instance(self, instance_id: str, role: str) -> None:
        self.metrics.add_instance(instance_id, role)

    def remove_instance(self, instance_id: str, role: str) -> None:
        self.metrics.remove_instance(instance_id, role)

    def render(self, stats: dict[str, Any], others: list[str] | None = None) -> str:
        """Prometheus exposition text (``/metrics``), with other processes' request metrics
        (``others``: engine actors') merged in."""
        return self.metrics.render(stats, others)

    async def flush(self) -> None:
        """Export the buffered spans now (the actor is killed after shutdown: no exit hook)."""
        if self.tracer is not None:
            from kv_transfer.tracing import flush

            await asyncio.to_thread(flush)

    def node(self, instance_id: str) -> str | None:
        spec = self._specs.get(instance_id)
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
            root_only=self._engines_trace,
        )

    def scheduled(self, where: Instance, held: Any) -> None:
        """A step of instance ``where`` took the request (the first one anywhere ends its
        queue time)."""
        iid = where.instance_id
        if held.trace is not None:
            held.trace.scheduled(iid, where.role, self.node(iid))
        if held.scheduled_at is None:
            held.scheduled_at = now = time.monotonic()
            if held.placement.scheduled_at is None:
                queued = now - held.request.arrival_time
                histograms = self.metrics.per_step(iid, where.role)
                histograms.queue.observe(max(queued, 0.0))

    def step(self, where: Instance, num_tokens: int) -> None:
        """Instance ``where`` started a step of ``num_tokens`` tokens (none: a step that only
        carries instructions to the workers, or waits for KV loads -- not an iteration, as
        in vLLM; a decode instance waiting on loads made thousands a second)."""
        if num_tokens > 0:
            self.metrics.per_step(where.instance_id, where.role).iteration_tokens.observe(
                num_tokens
            )

    def tokens_out(self, held: Any, where: Instance, num: int) -> None:
        """``num`` tokens of the request, sampled on instance ``where``, go to the client."""
        if num <= 0:
            return
        iid = where.instance_id
        if held.trace is not None:
            held.trace.tokens(num, held.num_cached_tokens, iid, self.node(iid))
        now = time.monotonic()
        histograms = self.metrics.per_step(iid, where.role)
        if held.first_token_at is None:
            held.first_token_at = now
            ttft = now - held.request.arrival_time
            histograms.ttft.observe(ttft)
            if self.latency_sink is not None:
                self.latency_sink(iid, "ttft", ttft, ttft)
        elif held.last_token_at is not None:
            histograms.itl.observe(now - held.last_token_at)
        held.last_token_at = now

    def handed_off(self, flight: Flight, decode: InstanceView, transport: str) -> None:
        """The prefilled request goes on to ``decode``; its KV follows."""
        if flight.trace is None or self._engines_trace:  # (the decode engine's spans)
            return
        iid = decode.instance_id
        block_size = self._specs[iid].info["block_size"]
        num_blocks = -(-flight.request.num_prompt_tokens // block_size)
        flight.trace.handed_off(iid, self.node(iid), transport, num_blocks)

    def decode_params(self, flight: Flight, params: Any) -> dict[str, Any] | None:
        """The decode request's ``kv_transfer_params``, with the transfer span's context so
        that the decode worker's load joins the trace."""
        if not params:
            return None
        result = dict(params)
        if flight.trace is not None and flight.trace.transfer is not None:  # (one process)
            from kv_transfer.tracing import inject

            result["trace_context"] = inject(flight.trace.transfer)
        return result

    def kv_loads(
        self,
        where: Instance,
        loads: list[tuple[str, float, int, bool]],
        held: dict[str, Any],
    ) -> None:
        """KV loads that ended on instance ``where``'s workers: (internal id, seconds, bytes,
        ok)."""
        self.metrics.kv_loads(where.instance_id, where.role, loads, self._recompute)
        for req_id, seconds, num_bytes, ok in loads:
            record = held.get(req_id)
            if record is not None and record.trace is not None:
                record.trace.kv_loaded(seconds, num_bytes, ok)

    def preempted(self, where: Instance, held: Any) -> None:
        """Instance ``where`` preempted the request (its KV is freed; it will be recomputed)."""
        if held.trace is not None:
            held.trace.preempted(where.instance_id)

    def moved(self, flight: Flight, reason: str) -> None:
        """The request's instance failed; it is placed again."""
        if flight.trace is not None:
            flight.trace.moved(reason)

    def finished(self, record: Any, final: EngineCoreOutput, where: Instance | None) -> None:
        """The request ended (``record``: its engine's, or the actor's flight when no engine
        held it), last on instance ``where`` (None: on no instance's series -- never placed,
        its instance gone, or ended by the central actor beside engine actors)."""
        if final.finish_reason is None:
            return
        if record.trace is not None:
            record.trace.finish(final.finish_reason.value, final.error)
        now = time.monotonic()
        first = record.first_token_at
        request = record.request
        arrival = request.arrival_time
        num = len(record.sent)
        scheduled = record.first_scheduled_at
        params = request.sampling_params  # (a prefill part's are not its client's: max 1)
        placement = getattr(record, "placement", None)
        if placement is not None and placement.client_params is not None:
            params = placement.client_params
        # (errors and aborts say nothing of the pool's speed)
        normal = final.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
        sink = self.latency_sink
        if sink is not None and normal and where is not None:
            # The pool's pace: from the first token made on its instance, not the client's
            # first (a decode part's came from the prefill instance, a KV hand-off before:
            # more decode instances would not shorten that, and the pool grew on it).
            since, before = getattr(record, "made_here_from", None) or (first, 0)
            if since is not None and num - before > 1:
                sink(where.instance_id, "tpot", (now - since) / (num - before - 1), now - since)
        # Its last token's instant: an engine's record has it; a central flight's is only
        # as of its last hand-off or move (its engine actor's tokens do not pass here).
        last = None if isinstance(record, Flight) else getattr(record, "last_token_at", None)
        self.metrics.request_finished(
            "" if where is None else where.instance_id,
            "" if where is None else where.role,
            final.finish_reason.value,
            RequestTimes.of(arrival, scheduled, first, now, num, last),
            request.num_prompt_tokens,
            num,
            params.max_tokens,
            # n, once per user request: on its first sample ("{id}#0", or the only one)
            None if later_sample(request) else request.num_samples,
        )
