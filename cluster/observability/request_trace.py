"""A request's spans in the SchedulerActor (child of the ingress span, which sends its context
with ``generate``)::

    <ingress>  chat {model}                             gen_ai.* request/response/usage
      └ tandem.request                                  events: first_token, preemption,
          ├ tandem.queue        arrival → first step      moved, abort, recompute_fallback
          ├ tandem.prefill      first step → first token  instance, node, prompt/cached tokens,
          │                                               preemptions
          ├ tandem.kv_transfer  hand-off → KV loaded      transport, bytes, blocks, outcome
          └ tandem.decode       hand-off → last token     instance, node, output tokens,
                                                          preemptions

A colocated request (no hand-off) has no kv_transfer span; its decode span starts at its first
token on the same instance.

With engine actors (``engine_actors``) the spans are made where the events happen: the central
scheduler's ``RequestTrace`` is the root alone (``root_only``: ended when an engine reports the
request finished), and each engine that runs a part of the request keeps a ``part`` trace whose
spans are children of the root by context -- queue and prefill on the prefill instance,
kv_transfer and decode on the decode instance; the root's events go on the part's open span.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer


def wall_ns(monotonic: float) -> int:
    """A ``time.monotonic()`` instant as the wall-clock nanoseconds spans use."""
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


class RequestTrace:
    def __init__(
        self,
        tracer: Tracer,
        parent: Any,
        request_id: str,
        prompt_tokens: int,
        arrival: float,
        *,
        root_only: bool = False,
        part: bool = False,
        output_tokens: int = 0,
    ) -> None:
        """``root_only``: the root span alone (a central scheduler with engine actors).
        ``part``: an engine's part of a request whose root is ``parent`` (a context); its
        first part (no ``output_tokens`` yet) starts with the queue span."""
        from opentelemetry.trace import SpanKind

        self.tracer = tracer
        self.prompt_tokens = prompt_tokens
        self.root: Span | None = None
        self._context = parent
        if not part:
            self.root = tracer.start_span(
                "tandem.request",
                context=parent,
                kind=SpanKind.INTERNAL,
                start_time=wall_ns(arrival),
                attributes={
                    "tandem.request_id": request_id,
                    "gen_ai.usage.input_tokens": prompt_tokens,
                },
            )
        self.queue: Span | None = None
        if not root_only and output_tokens == 0:
            self.queue = self._child("tandem.queue", start=arrival)
        self.prefill: Span | None = None
        self.transfer: Span | None = None
        self.decode: Span | None = None
        self.output_tokens = output_tokens
        self.hand_off = False  # a prefill part that continues elsewhere: no decode span here
        self.kv_bytes = 0
        self.prefill_preemptions = 0  # before the first token
        self.decode_preemptions = 0  # after it

    def _child(self, name: str, start: float | None = None, **attributes: Any) -> Span:
        from opentelemetry.trace import set_span_in_context

        context = self._context if self.root is None else set_span_in_context(self.root)
        return self.tracer.start_span(
            name,
            context=context,
            start_time=None if start is None else wall_ns(start),
            attributes={k.replace("__", "."): v for k, v in attributes.items() if v is not None},
        )

    def _event(self, name: str, attributes: dict[str, Any] | None = None) -> None:
        """An event of the request: on its root, or (a part) on the part's open span."""
        span = self.root
        if span is None:
            for candidate in (self.decode, self.transfer, self.prefill, self.queue):
                if candidate is not None and candidate.is_recording():
                    span = candidate
                    break
        if span is not None:
            span.add_event(name, attributes)

    @staticmethod
    def _end(span: Span | None, end_time: int | None = None) -> None:
        if span is not None and span.is_recording():
            span.end(end_time)

    def scheduled(self, instance: str, role: str, node: str | None) -> None:
        """The request's first step on ``instance`` (ends the queue, starts prefill)."""
        if self.queue is not None:
            self.queue.set_attribute("tandem.instance", instance)
            self._end(self.queue)
            self.queue = None
        if self.root is None and self.output_tokens and self.decode is self.transfer is None:
            # A part placed with tokens already sent and no hand-off (moved off a failed
            # instance: prompt and tokens computed again here): it decodes here.
            self.decode = self._child(
                "tandem.decode", tandem__instance=instance, tandem__node_id=node, tandem__moved=True
            )
        if self.prefill is None and self.output_tokens == 0:  # (a decode part has none)
            self.prefill = self._child(
                "tandem.prefill",
                tandem__instance=instance,
                tandem__role=role,
                tandem__node_id=node,
                tandem__prompt_tokens=self.prompt_tokens,
            )

    def tokens(self, num: int, cached_tokens: int | None, instance: str, node: str | None) -> None:
        if num <= 0:
            return
        if self.output_tokens == 0:
            self._event("first_token")
            if self.prefill is not None:
                self.prefill.set_attribute("tandem.cached_tokens", cached_tokens or 0)
                self.prefill.set_attribute("tandem.preemptions", self.prefill_preemptions)
                self._end(self.prefill)
            if self.decode is None and self.transfer is None and not self.hand_off:
                # colocated: decode goes on here
                self.decode = self._child(
                    "tandem.decode", tandem__instance=instance, tandem__node_id=node
                )
        elif self.transfer is not None:  # tokens from the decode instance: the KV is in
            self._end(self.transfer)
        self.output_tokens += num

    def handed_off(
        self, instance: str, node: str | None, transport: str, blocks: int | None
    ) -> None:
        self.transfer = self._child(
            "tandem.kv_transfer",
            tandem__kv__transport=transport,
            tandem__kv__blocks=blocks,
            tandem__kv__target_instance=instance,
        )
        self.decode = self._child("tandem.decode", tandem__instance=instance, tandem__node_id=node)

    def kv_loaded(self, seconds: float, num_bytes: int, ok: bool) -> None:
        span = self.transfer
        if span is None or not span.is_recording():
            return
        self.kv_bytes += num_bytes
        span.set_attribute("tandem.kv.duration_s", seconds)
        span.set_attribute("tandem.kv.bytes", self.kv_bytes)
        span.set_attribute("tandem.kv.outcome", "ok" if ok else "failed")
        if not ok:
            self._event("recompute_fallback")
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, "KV load failed: recomputed"))
        self._end(span)

    def preempted(self, instance: str) -> None:
        """Preempted by recompute on ``instance`` (an event; counted on the phase's span)."""
        self._event("preemption", {"tandem.instance": instance})
        if self.output_tokens == 0:
            self.prefill_preemptions += 1
        else:
            self.decode_preemptions += 1

    def moved(self, reason: str) -> None:
        self._event("moved", {"tandem.reason": reason})
        span = self.transfer
        if span is not None and span.is_recording():
            # Moved while its KV loaded: that hand-off never ended (the next token, from
            # the instance it moved to, would have closed the span as a long clean load).
            from opentelemetry.trace import Status, StatusCode

            span.set_attribute("tandem.kv.outcome", "abandoned")
            span.set_status(Status(StatusCode.ERROR, f"moved before its KV loaded: {reason}"))
            self._end(span)

    def left(self, reason: str) -> None:
        """An engine's part whose instance lost the request (it failed, or left its pool):
        the request goes on elsewhere, as another part with spans of its own, so this part's
        open spans end here, as errors that say why. (A whole trace -- one process -- goes
        on with the request: nothing ends.)"""
        if self.root is not None:
            return
        from opentelemetry.trace import Status, StatusCode

        if self.decode is not None and self.decode.is_recording():
            self.decode.set_attribute("gen_ai.usage.output_tokens", self.output_tokens)
            self.decode.set_attribute("tandem.preemptions", self.decode_preemptions)
        if self.transfer is not None and self.transfer.is_recording():
            # Lost while its KV loaded: that hand-off never ended (``moved`` marks it so in
            # one process).
            self.transfer.set_attribute("tandem.kv.outcome", "abandoned")
        for span in (self.queue, self.prefill, self.transfer, self.decode):
            if span is not None and span.is_recording():
                span.add_event("moved", {"tandem.reason": reason})
                span.set_status(Status(StatusCode.ERROR, reason))
                span.end()

    def finish(
        self,
        reason: str,
        error: str | None,
        output_tokens: int | None = None,
        end_time: int | None = None,
    ) -> None:
        """The request ended (``output_tokens``: its count when another process streamed
        them: a root-only trace; ``end_time``: when, in wall-clock ns, if not now)."""
        from opentelemetry.trace import Status, StatusCode

        if output_tokens is not None:
            self.output_tokens = output_tokens
        if reason == "abort":
            self._event("abort")
        if self.decode is not None:
            self.decode.set_attribute("gen_ai.usage.output_tokens", self.output_tokens)
            self.decode.set_attribute("tandem.preemptions", self.decode_preemptions)
        if self.root is not None:
            self.root.set_attribute("gen_ai.usage.output_tokens", self.output_tokens)
            self.root.set_attribute("gen_ai.response.finish_reasons", [reason])
            if error:
                self.root.set_status(Status(StatusCode.ERROR, error))
        for span in (self.queue, self.prefill, self.transfer, self.decode, self.root):
            self._end(span, end_time)
