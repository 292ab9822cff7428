"""How an ``EngineActor`` (``engine_actor.py``) reports to its central scheduler: one
``EngineReport`` per step, coalesced while the last is on its way, sent again while the central
actor cannot be reached (a connection lost for a while, the actor restarting)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import replace
from typing import Any

from cluster.control.engine_reports import EndedTrace, EngineReport, Prefilled
from cluster.control.engine_wire import Route, coalesce, plain, rebase_report
from cluster.observability.request_trace import wall_ns
from kv_transfer.tracing import sampled

logger = logging.getLogger(__name__)

MAX_UNSENT_TRACES = 16384  # ended traces kept while no central actor hears the reports
# A report the central actor could not be reached for is sent again after these waits (the
# last one repeated), for at most REPORT_RETRY_FOR_S; then it is dropped.
REPORT_RETRY_WAITS_S = (0.05, 0.1, 0.25, 0.5, 1.0)
REPORT_RETRY_FOR_S = 120.0


class ReportSender:
    """``EngineActor``'s reports (its state is set up by the actor)."""

    instance_id: str
    central: Any
    num_report_retries: int
    _latencies: list[tuple[str, float, float]]
    _awaiting: dict[str, Prefilled]
    _routes: dict[str, Route]
    _outgoing: deque[EngineReport]
    _wake: asyncio.Event
    _unsent_traces: dict[str, EndedTrace]
    _incarnation: str
    _num_reports: int

    def _on_report(self, report: EngineReport) -> None:
        if self._latencies:
            report.latencies, self._latencies = self._latencies, []
        for prefilled in report.prefilled:  # (a copy: the report's is rebased when sent)
            self._awaiting[prefilled.internal_id] = replace(prefilled)
        for internal in report.finished:
            route = self._routes.pop(internal, None)
            if route is not None and route.trace_context and sampled(route.trace_context):
                report.ended_traces[internal] = EndedTrace(
                    route.trace_context,
                    route.client_request_id,
                    route.request.num_prompt_tokens,
                    wall_ns(route.arrival_time),
                    time.time_ns(),
                    report.outcomes.get(internal),
                )
        for lost in report.lost:
            self._routes.pop(lost.internal_id, None)
        queue = self._outgoing
        # (Never into one already sent: the central actor may have applied it.)
        if queue and queue[-1].sequence is None and plain(queue[-1]) and plain(report):
            queue[-1] = coalesce(queue[-1], report)
        else:
            queue.append(report)
        self._wake.set()

    async def _send_reports(self) -> None:
        """Forever: send the reports in order, one at a time; those made meanwhile are merged
        into one (a slow central scheduler gets fewer, larger reports, never a backlog). One
        the central actor could not be reached for (a connection lost for a while, the actor
        restarting) goes back to the queue's head and is sent again: its milestones (a
        prefill done, requests lost, finished) are what the central actor acts on. Its
        ``sequence`` stays: should the first try have been applied, the central actor drops
        the second."""
        from ray.exceptions import ActorUnavailableError, RayActorError

        failing_since: float | None = None
        tries = 0  # of this outage
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._outgoing:
                report = self._outgoing.popleft()
                if self._unsent_traces:
                    report.ended_traces = {**self._unsent_traces, **report.ended_traces}
                    self._unsent_traces = {}
                if report.sequence is None:
                    self._num_reports += 1
                    report.sequence = (self._incarnation, self._num_reports)
                sent_at = time.monotonic()
                rebase_report(report, -sent_at)  # ages as of now: it leaves now
                try:
                    await self.central.report.remote(report)
                    failing_since, tries = None, 0
                except (ActorUnavailableError, RayActorError) as exc:
                    failing_since = failing_since or sent_at
                    tries += 1
                    if time.monotonic() - failing_since < REPORT_RETRY_FOR_S:
                        rebase_report(report, sent_at)  # its instants again: it waits here
                        self._outgoing.appendleft(report)
                        del report
                        self.num_report_retries += 1
                        logger.info(
                            "instance %s: report not sent, again: %s", self.instance_id, exc
                        )
                        waits = REPORT_RETRY_WAITS_S
                        await asyncio.sleep(waits[min(tries, len(waits)) - 1])
                        continue
                    failing_since, tries = None, 0
                    self._lost_report(report, exc)
                except Exception as exc:  # the central actor refused it: sending again won't do
                    failing_since, tries = None, 0  # (it answered: the outage, if any, ended)
                    self._lost_report(report, exc)
                # Not kept while idle: its KV handles (object references) pin their objects.
                del report

    def _lost_report(self, report: EngineReport, exc: BaseException) -> None:
        """A report given up on: its ended traces go with the next one (the newest kept)."""
        logger.warning("instance %s: a report was lost: %s", self.instance_id, exc)
        self._unsent_traces.update(report.ended_traces)
        while len(self._unsent_traces) > MAX_UNSENT_TRACES:
            del self._unsent_traces[next(iter(self._unsent_traces))]
