"""A request in flight through the SchedulerActor, where its outputs go, and the request
copies it hands to instances.

The client's ``Request`` is never given to a scheduler: each instance gets its own copy under
the flight's internal id -- the prefill instance a one-token copy that saves its KV
(``prefill_request``), the decode instance one that carries the first token and the KV handle.

Outputs go to the flight's own queue (``SchedulerActor.generate``: one stream per request) or
to its client's ``Outbox`` (``submit`` / ``subscribe``: one stream per client, one batch per
step for all of the client's requests).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cluster.engine.streams import Mailbox
from scheduler import Request
from scheduler.outputs import EngineCoreOutput, merge_outputs
from scheduler.request import FinishReason

if TYPE_CHECKING:
    from cluster.control.summaries import InstanceView


Submission = int | str  # a client's tag of one submit (the request id when it gives none)
# How a request ended, as its client saw it: (finish reason, error, tokens delivered).
Outcome = tuple[str, str | None, int]


class Outbox:
    """The outputs bound for one client (an ingress replica, a driver), batched: what its
    requests produced since it last took a batch, merged into one output per submission (so
    a stale output of an earlier request with the same id is never merged into a new one),
    each with the output position of its first token (``index``; None: unknown, deliver as
    it comes) by which a client that hears one request from several engines orders them."""

    def __init__(self) -> None:
        self.pending: dict[Submission, EngineCoreOutput] = {}
        self.index: dict[Submission, int | None] = {}  # the first pending output's position
        self._merged: set[Submission] = set()  # pending outputs this outbox made (its own)
        # Outputs that do not continue their submission's pending one (by position).
        self.apart: list[tuple[Submission, EngineCoreOutput, int | None]] = []
        self.ready = asyncio.Event()
        self.closed = False
        self.streams = 0  # generators streaming it to its client now (engine actors)
        # Asks for the client's tokens of its requests on a dead engine: (instance, submissions).
        self.resume: list[tuple[str, list[Submission]]] = []
        self.notice: dict[str, Any] | None = None  # for the client, before its next batch

    def put(self, submission: Submission, out: EngineCoreOutput, index: int | None = None) -> None:
        pending = self.pending
        before = pending.get(submission)
        if before is None:
            pending[submission] = out
            self.index[submission] = index
        elif not self._continues(submission, before, out, index):
            # Not where the pending one ends (the central actor's replay of a moved request
            # from position 0, say): it goes as it is; the client orders them by position.
            self.apart.append((submission, out, index))
        elif submission in self._merged:  # its own copy: grows in place, no re-copy
            _extend(before, out)
        else:
            pending[submission] = merge_outputs(before, out)
            self._merged.add(submission)
        if not self.ready.is_set():
            self.ready.set()

    def _continues(
        self,
        submission: Submission,
        before: EngineCoreOutput,
        out: EngineCoreOutput,
        index: int | None,
    ) -> bool:
        """``out`` (at ``index``) begins where the pending output of ``submission`` ends (or
        a position is unknown), and both or neither carry logprobs: the two merge into one."""
        mixed = (before.new_logprobs is None) != (out.new_logprobs is None)
        if before.new_token_ids and out.new_token_ids and mixed:
            return False  # a refill (no logprobs) and an engine's output: kept apart
        start = self.index.get(submission)
        return start is None or index is None or index == start + len(before.new_token_ids)

    async def take(self) -> list[tuple[Submission, EngineCoreOutput, int | None]]:
        """Wait for outputs (or ``close``), then take them all, each with its submission and
        position."""
        await self.ready.wait()
        self.ready.clear()
        index = self.index
        batch = [(tag, out, index[tag]) for tag, out in self.pending.items()]
        if self.apart:
            batch += self.apart
            self.apart = []
        self.pending, self.index = {}, {}
        self._merged.clear()
        return batch

    def close(self) -> None:
        self.closed = True
        self.ready.set()


def made_after(submission: Any, than: Any) -> bool:
    """Whether a client made ``submission`` after ``than`` (its tags count up; a tag that is a
    request id, not a count, is never later)."""
    return isinstance(submission, int) and isinstance(than, int) and submission > than


@dataclass(frozen=True)
class Stopped:
    """A client's op: its request met a stop string (found as the client detokenizes): it
    ends as ``stop``, not ``abort``, so metrics, goodput and its trace count it as vLLM
    does."""

    request_id: str


@dataclass(frozen=True)
class Abort:
    """A client's op: abort its submit ``submission`` of ``request_id`` -- that one only,
    never a later submit of the id (a batch sent again after the central actor's restart
    carries its aborts again, when the id may be a new request's); ``stopped``: it met a
    stop string (it ends as ``stop``)."""

    request_id: str
    submission: Submission
    stopped: bool = False


@dataclass
class Flight:
    """A request between ``generate`` / ``submit`` and its final output."""

    request: Request  # as the client sent it
    queue: Mailbox[EngineCoreOutput] | None  # its own stream (``generate``), or
    outbox: Outbox | None  # its client's batched stream (``submit``)
    instance: str  # the instance it was last given to ("" before it is placed)
    stage: str  # "prefill" (on P, to be handed off) or "decode" (running to the end)
    internal_id: str = ""  # the id the schedulers know it by
    num_cached_tokens: int | None = None  # the prefix hit where the prompt was computed
    decode_target: InstanceView | None = None  # chosen by the Router at arrival
    prefilled_on: str = ""  # the instance that sampled its first token (after a hand-off)
    # The tokens its client has, as of its last hand-off or move (the engines stream the
    # tokens; the actor learns them only when the request changes instance).
    sent: list[int] = field(default_factory=list)
    num_moves: int = 0  # times it moved off a failed instance
    # A move is under way (``Migration._move``; its placement may wait for an adapter to
    # load): ``instance`` still names the one it left until it is placed again.
    moving: bool = False
    # For metrics (time.monotonic()), as its engines reported them:
    first_token_at: float | None = None
    last_token_at: float | None = None  # as of its last hand-off or move
    scheduled_at: float | None = None  # its first step anywhere
    trace: Any = None  # a RequestTrace while tracing is on
    submission: Submission | None = None  # the client's tag of its submit (outbox only)
    client_id: str | None = None  # its client's (outbox only)
    # An abort (or a stop) went to its engine in another process, which answers; if that
    # engine no longer holds it, whoever takes it next ends it with this reason.
    aborting: FinishReason | None = None
    # Its submit's outcome while it is being placed (``Intake._submit``): the same submit
    # sent again meanwhile (its client had no answer) waits for it. None: rebuilt.
    placing: asyncio.Future[None] | None = None

    @property
    def first_scheduled_at(self) -> float | None:
        """Its first step anywhere (as ``Held.first_scheduled_at``)."""
        return self.scheduled_at

    @property
    def tag(self) -> Submission:
        """What its client's outputs are tagged with."""
        return self.request.request_id if self.submission is None else self.submission

    def deliver(self, out: EngineCoreOutput, index: int | None = None) -> None:
        """Hand an output to whoever streams this request (``index``: its first token's
        position in the request's output, when known)."""
        if self.outbox is not None:
            self.outbox.put(self.tag, out, index)
        else:
            assert self.queue is not None
            self.queue.put_nowait(out)


def admitted_with_another(request: Request) -> bool:
    """Part of a user request whose first part decides its admission: a sample after the
    first of its ``n``, or a prompt after the first of a batch."""
    return request.sample_index > 0 or request.prompt_index > 0


def later_sample(request: Request) -> bool:
    """True for sample i > 0 of a request fanned out into n (by the index its client set,
    not by its id: a client may name a request "job#2")."""
    return request.sample_index > 0


def clone_request(request: Request, **overrides: Any) -> Request:
    """A fresh scheduler request with the client's fields (schedulers own their copies)."""
    args: dict[str, Any] = dict(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        sampling_params=request.sampling_params,
        eos_token_id=request.eos_token_id,
        arrival_time=request.arrival_time,
        priority=request.priority,
        lora_request=request.lora_request,
        kv_transfer_params=None,
        cache_salt=request.cache_salt,
        output_token_ids=list(request.output_token_ids),
        num_samples=request.num_samples,
        sample_index=request.sample_index,
        prompt_index=request.prompt_index,
    )
    args.update(overrides)
    return Request(**args)


def prefill_request(request: Request, request_id: str) -> Request:
    """The prefill instance's part: compute the prompt, sample the first token, save the KV."""
    params = request.sampling_params
    first = params.model_copy(update={"max_tokens": 1, "min_tokens": min(params.min_tokens, 1)})
    return clone_request(
        request,
        request_id=request_id,
        sampling_params=first,
        kv_transfer_params={"do_remote_decode": True},
    )


# One output on the wire of a client's batched stream: (submission, request id, new token
# ids, finish reason's value or None, stop reason, cached tokens, new logprobs, error, prompt
# logprobs, position of its first token or None). Plain tuples pickle about 20x faster than
# the dataclass (0.1 vs 2.4 us an output with Ray's cloudpickle) -- per token, that is most
# of the stream's cost.
WireOutput = tuple[
    Submission, str, list[int], str | None, Any, int, Any, str | None, Any, int | None
]


def pack_batch(batch: list[tuple[Submission, EngineCoreOutput, int | None]]) -> list[WireOutput]:
    return [
        (
            tag,
            o.request_id,
            o.new_token_ids,
            None if o.finish_reason is None else o.finish_reason.value,
            o.stop_reason,
            o.num_cached_tokens,
            o.new_logprobs,
            o.error,
            o.prompt_logprobs,
            index,
        )
        for tag, o, index in batch
    ]


def unpack_batch(wire: list[WireOutput]) -> list[tuple[Submission, EngineCoreOutput]]:
    return [(tag, out) for tag, out, _ in unpack_indexed(wire)]


def unpack_indexed(
    wire: list[WireOutput],
) -> list[tuple[Submission, EngineCoreOutput, int | None]]:
    """The batch's outputs with their submissions and positions."""
    return [
        (
            tag,
            EngineCoreOutput(
                rid,
                tokens,
                None if reason is None else FinishReason(reason),
                stop,
                cached,
                None,
                logprobs,
                error,
                prompt_logprobs,
            ),
            index,
        )
        for tag, rid, tokens, reason, stop, cached, logprobs, error, prompt_logprobs, index in wire
    ]


def _extend(into: EngineCoreOutput, b: EngineCoreOutput) -> None:
    """``merge_outputs`` in place, into an output nobody else holds."""
    into.new_token_ids.extend(b.new_token_ids)
    if b.new_logprobs is not None:
        into.new_logprobs = (into.new_logprobs or []) + b.new_logprobs
    into.finish_reason = b.finish_reason
    into.stop_reason = b.stop_reason
    into.num_cached_tokens = b.num_cached_tokens or into.num_cached_tokens
    into.error = b.error
    if into.prompt_logprobs is None:
        into.prompt_logprobs = b.prompt_logprobs
