"""What the engines report to the ``SchedulerActor`` (``scheduler_actor.py``), one
``EngineReport`` per step: load and prefix-cache events for the router, and per request its
milestones -- finished, prefilled (then the hand-off to its decode instance), lost (then a
move) -- never its tokens."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from cluster.config import ClusterConfig
from cluster.control.adapters import LoRAAdapters
from cluster.control.engine_reports import EngineReport, Prefilled
from cluster.control.flights import Flight, clone_request
from cluster.control.handoffs import HandOffs
from cluster.control.observer import RequestObserver
from cluster.control.restart_triage import end_remade_root
from cluster.control.router import Router
from cluster.control.summaries import InstanceView
from scheduler.outputs import ADAPTER_UNREADABLE
from scheduler.request import FinishReason

logger = logging.getLogger(__name__)


class ReportIntake:
    """The engines' reports to the ``SchedulerActor``."""

    # What of the actor this uses (annotations only: the actor's own or its other mixins').
    config: ClusterConfig
    engines: dict[str, Any]
    views: dict[str, InstanceView]
    router: Router
    observe: RequestObserver
    hand_offs: HandOffs
    lora: LoRAAdapters
    failures: list[dict[str, Any]]
    recovering: bool
    _internal: dict[str, Flight]
    _taken_on: set[str]
    _report_sequences: dict[str, tuple[str, int]]
    _held_reports: list[EngineReport]
    _kick_recovery: Callable[[], None]
    _rejoined: Callable[[str], None]
    _forget: Callable[[Flight], None]
    _lost_root: Callable[[str], bool]
    _end: Callable[..., None]
    _live: Callable[[str], list[InstanceView]]
    _send: Callable[..., None]
    _spawn: Callable[[Any], None]
    _move: Callable[..., Coroutine[Any, Any, None]]

    def report(self, report: EngineReport) -> None:
        """An ``EngineActor``'s report (its instants as ages: ``engine_actor.rebase_report``)."""
        from cluster.control.engine_wire import rebase_report

        if report.sequence is not None:
            incarnation, number = report.sequence
            last = self._report_sequences.get(report.instance_id)
            if last is not None and last[0] == incarnation and number <= last[1]:
                logger.info(
                    "instance %s: report %d came again (applied)", report.instance_id, number
                )
                return
            self._report_sequences[report.instance_id] = report.sequence
        rebase_report(report, time.monotonic())
        if self.recovering:  # applied once the state is rebuilt
            self._held_reports.append(report)
            self._kick_recovery()
            return
        engine = self.engines.get(report.instance_id)
        if engine is not None and engine.remote:
            if engine.dead is not None:  # declared dead, its requests moved: a late report
                return  # (a rejoin) must not bring it back into routing, where ops are lost
            if report.failure is not None:
                engine.failed = report.failure
            if report.rejoined:
                engine.failed = None
        self._on_report(report)

    def _on_report(self, report: EngineReport) -> None:
        iid = report.instance_id
        engine = self.engines.get(iid)
        if engine is None or (engine.remote and engine.dead is not None):
            return  # it left the cluster, or was declared dead (a report held in a rebuild)
        if report.rejoined:
            self._rejoined(iid)
        view = self.views[iid]
        view.update(report.summary)
        if self.hand_offs:  # hand-offs to this engine it now has; any never confirmed
            self._confirm(self.hand_offs.received(iid, report.summary.num_received))
            self._confirm(self.hand_offs.stale(time.monotonic()))
            if report.failure is not None or report.lost:  # its requests move their own way
                self._confirm(self.hand_offs.drop(iid))
        if report.latencies:
            now = time.monotonic()
            for kind, seconds, *span in report.latencies:  # (measured up to its sending)
                view.latency(now, kind, seconds, span[0] if span else seconds)
        for internal in report.finished:
            flight = self._internal.get(internal)
            if flight is not None and flight.instance == iid:
                self._forget(flight)
                outcome = report.outcomes.get(internal)
                lora = flight.request.lora_request
                if lora is not None and outcome is not None and outcome[0] == "error":
                    error = outcome[1]
                    if error is not None and error.startswith(ADAPTER_UNREADABLE):
                        # Its workers could not read the adapter again: loaded there anew
                        # before the next request for it runs (``ensure``).
                        self.lora.unreadable(iid, lora.lora_int_id)
                if flight.trace is not None and outcome is not None and self.engines[iid].remote:
                    flight.trace.finish(*outcome)  # the root span; the engine ended its own
        for internal, ended in report.ended_traces.items():  # (with those of lost reports)
            if internal not in self._internal and self._lost_root(internal):
                self._taken_on.add(internal)  # (once)
                end_remade_root(self, ended)
        for prefilled in report.prefilled:
            flight = self._internal.get(prefilled.internal_id)
            if flight is not None and flight.instance == iid and flight.aborting is None:
                self._hand_off(flight, prefilled)
                self._handed_off(iid, flight, prefilled.internal_id)
            elif not self.engines[iid].remote:  # aborted: nobody will read its KV
                self.engines[iid].release_kv(prefilled.internal_id)
        for internal, source in report.kv_unread:  # the decode side had the prompt cached
            engine = self.engines.get(source)
            if engine is not None:
                engine.release_kv(internal)
            # else: aborted; an engine actor ends it itself (and reports it finished)
        if report.failure is not None:
            view.alive = False
            logger.warning("instance %s failed: %s", iid, report.failure)
            failure = {"instance_id": iid, "event": "failed", "reason": report.failure}
            self.failures.append({**failure, "time": time.time()})
        if report.lost:
            reason = report.failure or self.engines[iid].failed or f"instance {iid} failed"
            self._spawn(self._move(iid, report.lost, reason))

    def _hand_off(self, flight: Flight, prefilled: Prefilled) -> None:
        """The prefill instance sampled the first token (its engine sent it to the client):
        send the request on to its decode instance with that token and the KV handle."""
        request = flight.request
        flight.sent = list(prefilled.first.new_token_ids)
        flight.num_cached_tokens = prefilled.num_cached_tokens
        flight.first_token_at = prefilled.first_token_at
        flight.scheduled_at = prefilled.scheduled_at
        decode = flight.decode_target
        if decode is None or not decode.serves:
            alive = self._live("decode")
            if not alive:
                error = "no live decode instance to continue"
                source = self.engines.get(flight.instance)
                self._end(flight, FinishReason.ERROR, error, tokens=flight.sent)
                if source is not None:  # nobody will read its KV (an engine actor: an op,
                    source.release_kv(prefilled.internal_id)  # before ``handed_off``)
                return
            decode = self.router.best_decode(alive)
        params = prefilled.kv_transfer_params
        self.observe.handed_off(flight, decode, self.config.kv_transfer.transport)
        flight.stage = "decode"
        flight.prefilled_on = flight.instance  # its first token came from there
        part = clone_request(
            request,
            request_id=flight.internal_id,
            output_token_ids=list(flight.sent),
            kv_transfer_params=self.observe.decode_params(flight, params),
        )
        flight.last_token_at = flight.first_token_at
        self._send(decode, flight, part, hand_off=False)

    def _handed_off(self, prefill: str, flight: Flight, internal_id: str) -> None:
        """The prefill engine may drop its copy of ``internal_id`` -- with an engine actor,
        once the decode engine has the request (``HandOffs``)."""
        engine = self.engines[prefill]
        decode = flight.instance
        if not engine.remote or decode == prefill or decode not in self.views:
            engine.handed_off([internal_id])  # (in one process, or it went nowhere)
        else:
            self.hand_offs.expect(decode, self.views[decode].num_sent, prefill, internal_id)

    def _confirm(self, confirmed: dict[str, list[str]]) -> None:
        for prefill, internal_ids in confirmed.items():
            engine = self.engines.get(prefill)
            if engine is not None:
                engine.handed_off(internal_ids)
