"""The scheduler side of Tandem's P/D connector, and the per-step metadata it sends to workers.

One class serves both roles, because an instance may be both a hand-off source and a target:

Prefill side (the request carries ``do_remote_decode``)::

    admitted ─▶ ... ─▶ the step that computes its last prompt token: SaveSpec in the metadata
            worker: saves the prompt's blocks (transport), reports ``finished_sending`` and the
                    handle in ``kv_connector_output``
    request_finished ─▶ (delay_free=False, kv_transfer_params with the handle): the data is
            already out of the blocks, so they are freed at once (a transport that serves
            the blocks in place, like gRPC, would delay the free until ``finished_sending``)

Decode side (the request carries ``do_remote_prefill`` and ``remote_num_tokens``)::

    get_num_new_matched_tokens ─▶ the prompt tokens not already in the local prefix cache,
                                  loaded asynchronously (WAITING_FOR_REMOTE_KVS)
    update_state_after_alloc   ─▶ LoadSpec: the handle, the destination blocks, the timeout
            worker: fetches in the background, writes the blocks between steps, reports
                    ``finished_recving`` (or ``failed_recving`` past the timeout)

Nothing here imports a transport: handles are opaque. Transports live in ``kv_transfer/``
modules of their own and are picked by name (``kv_transfer.registry``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from scheduler.kv_connector import SchedulerConnector
from scheduler.request import RequestStatus

if TYPE_CHECKING:
    from scheduler.kv_cache_utils import KVCacheBlocks
    from scheduler.outputs import SchedulerOutput
    from scheduler.request import Request


class KVReadStuck(RuntimeError):
    """A worker's KV read runs on past its deadline with its source disconnected: its blocks
    may still be written at any time, so the worker's cache cannot be handed out again. The
    worker's step raises it; the instance's engine then ends the worker's process, as a hung
    worker's (``cluster/control/engine_loop.py``)."""


@dataclass(frozen=True)
class SaveSpec:
    """Prefill side: save the KV of the first ``num_tokens`` positions of ``req_id`` at the end
    of this step (the worker knows the request's block table)."""

    req_id: str
    num_tokens: int
    trace_context: dict[str, str] | None = field(default=None, compare=False)  # W3C carrier


@dataclass(frozen=True)
class KVSegment:
    """Where the KV of model layers ``[first_layer, last_layer)`` of one saved request is:
    a transport handle. A request's saved KV is a list of segments, one per pipeline stage of
    the prefill instance; each decode stage fetches the segments that overlap its own layers.

    ``in_place``: the source serves the blocks themselves (gRPC lease), so the prefill side
    must keep them until the source reports the send finished (``finished_sending``)."""

    first_layer: int
    last_layer: int
    handle: Any
    in_place: bool = False

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.last_layer)


@dataclass(frozen=True)
class LoadSpec:
    """Decode side: fetch ``handle`` and write its blocks ``[first_block, first_block +
    len(block_ids))`` into the local ``block_ids``; give up after ``timeout_s``."""

    req_id: str
    handle: list[KVSegment]
    block_ids: list[int]
    first_block: int
    timeout_s: float
    trace_context: dict[str, str] | None = None  # the KV transfer's span (W3C), if traced


@dataclass
class KVConnectorMetadata:
    """The connector's instructions for one step (``SchedulerOutput.kv_connector_metadata``)."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)
    # Prefill side: requests whose saved KV nobody will take (no hand-off): a transport that
    # serves blocks in place ends their leases now instead of at expiry.
    releases: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.releases)


@dataclass
class KVConnectorReport:
    """What a worker tells the scheduler side after a step (``kv_connector_output``)."""

    # req_id -> where its saved KV is (a pipeline instance's stages each add their segment)
    saved: dict[str, list[KVSegment]] = field(default_factory=dict)
    bytes_saved: int = 0
    bytes_loaded: int = 0
    # Loads that ended this step, for metrics and traces: (req_id, seconds from start to the
    # data in the blocks, bytes written, succeeded). A pipeline instance has one per stage.
    loads: list[tuple[str, float, int, bool]] = field(default_factory=list)


class PDConnector(SchedulerConnector):
    """Scheduler-side connector of one instance (``instance_id``) for prefill/decode hand-off."""

    def __init__(self, instance_id: str, block_size: int, timeout_s: float) -> None:
        self.instance_id = instance_id
        self.block_size = block_size
        self.timeout_s = timeout_s
        self._to_save: dict[str, int] = {}  # prefill side: req_id -> prompt length
        self._save_traces: dict[str, dict[str, str]] = {}  # req_id -> its trace (if traced)
        self._saving: set[str] = set()  # save requested from the worker, no handle yet
        self._saved: dict[str, Any] = {}  # handles of saved requests, until they finish
        self._loads: list[LoadSpec] = []  # built since the last step
        self._releases: list[str] = []  # saved KV no decode instance will take
        # Decode side: (request, source instance) of handles dropped unread (the local prefix
        # cache had the prompt): the source can let their blocks go (``take_unread``).
        self._unread: list[tuple[str, str]] = []
        self.num_saves = 0
        self.num_loads = 0

    # -- decode side -----------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not request.do_remote_prefill:
            return 0, False
        params = request.kv_transfer_params or {}
        if params.get("handle") is None:
            return 0, False  # nothing to load from: compute locally
        remote = min(int(params.get("remote_num_tokens", 0)), request.num_prompt_tokens)
        count = max(remote - num_computed_tokens, 0)
        return count, count > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params or {}
        if params.get("do_remote_decode"):
            self._to_save[request.request_id] = request.num_prompt_tokens
            if params.get("trace_context"):
                self._save_traces[request.request_id] = params["trace_context"]
        if num_external_tokens <= 0:
            if request.do_remote_prefill and "handle" in params:
                # Nothing to load (the local prefix cache covers the prompt): let the source's
                # copy go now rather than when the request ends.
                request.kv_transfer_params = {k: v for k, v in params.items() if k != "handle"} | {
                    "do_remote_prefill": False
                }
                source = params.get("remote_instance_id")
                if source is not None and any(s.in_place for s in params["handle"]):
                    self._unread.append((request.request_id, str(source)))
            return
        remote = min(int(params["remote_num_tokens"]), request.num_prompt_tokens)
        # The external tokens are the positions just before ``remote``; the local prefix hit
        # is block-aligned, so they start on a block boundary.
        first = (remote - num_external_tokens) // self.block_size
        last = -(-remote // self.block_size)
        self._loads.append(
            LoadSpec(
                req_id=request.request_id,
                handle=params["handle"],
                block_ids=blocks.get_block_ids()[first:last],
                first_block=first,
                timeout_s=self.timeout_s,
                trace_context=params.get("trace_context"),
            )
        )
        self.num_loads += 1

    # -- both ------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._loads, releases=self._releases)
        self._loads, self._releases = [], []
        if self._to_save:
            new_reqs = scheduler_output.scheduled_new_reqs
            starts = {new.req_id: new.num_computed_tokens for new in new_reqs}
            cached = scheduler_output.scheduled_cached_reqs
            starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            for req_id, n in scheduler_output.num_scheduled_tokens.items():
                num_prompt = self._to_save.get(req_id)
                if num_prompt is not None and starts[req_id] + n >= num_prompt:
                    trace = self._save_traces.pop(req_id, None)
                    meta.saves.append(SaveSpec(req_id, num_prompt, trace))
                    del self._to_save[req_id]
                    self._saving.add(req_id)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        if not isinstance(connector_output, KVConnectorReport):
            return
        for req_id, handle in connector_output.saved.items():
            if req_id in self._saving:
                self._saving.discard(req_id)
                self._saved[req_id] = handle
                self.num_saves += 1
            elif any(segment.in_place for segment in handle):
                # Its request was aborted or preempted while the saving step ran: nobody
                # will read this save. Its lease ends at the next step, not at expiry (a
                # copy-out save goes with the dropped handle).
                self._releases.append(req_id)

    def request_preempted(self, request: Request) -> bool:
        # A save in flight is of the blocks the preemption just freed (an in-place lease
        # would hand a decode instance another request's KV): it is released when it comes,
        # and the request saves again when its recomputed prompt completes (its admission
        # puts it back in ``_to_save``). A save already made goes the same way.
        req_id = request.request_id
        handle = self._saved.pop(req_id, None)
        if handle is not None and any(segment.in_place for segment in handle):
            self._releases.append(req_id)
        if req_id in self._saving:
            self._saving.discard(req_id)
            return True
        return False

    def remote_kv_dropped(self, request: Request) -> None:
        params = request.kv_transfer_params or {}
        handle, source = params.get("handle"), params.get("remote_instance_id")
        if handle and source is not None and any(segment.in_place for segment in handle):
            self._unread.append((request.request_id, str(source)))

    def has_pending(self) -> bool:
        return bool(self._releases)

    # -- prefill side ----------------------------------------------------------------------
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._to_save.pop(req_id, None)
        self._save_traces.pop(req_id, None)
        self._saving.discard(req_id)
        handle = self._saved.pop(req_id, None)
        if handle is None:
            params = request.kv_transfer_params or {}
            if params.get("do_remote_prefill") and not request.awaiting_remote_kvs:
                # Decode side, finished before its load (aborted while queued): the source
                # lets the prompt's KV go now.
                self.remote_kv_dropped(request)
            return False, None
        # A copy-out transport's data is independent of the blocks, so they are freed now; a
        # transport serving the blocks in place keeps them until it reports the send done
        # (pulled, or its lease expired), even when the request did not end normally: the
        # lease is already out.
        delay_free = any(segment.in_place for segment in handle)
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            # Nothing to hand off (the first token ended it -- EOS, a stop string -- or it was
            # aborted, or failed), as in vLLM: the KV goes. Blocks served in place wait for
            # the worker to end their lease, which it does at the next step.
            if delay_free:
                self._releases.append(req_id)
            return delay_free, None
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_instance_id": self.instance_id,
            "remote_block_ids": block_ids,
            "remote_num_tokens": request.num_prompt_tokens,
            "handle": handle,
            "deadline": time.time() + self.timeout_s,
        }
        return delay_free, params

    def num_pending(self) -> int:
        """Saves requested or done whose request has not finished yet (0 when idle)."""
        return (
            len(self._to_save)
            + len(self._saving)
            + len(self._saved)
            + len(self._loads)
            + len(self._releases)
        )

    def take_unread(self) -> list[tuple[str, str]]:
        """Decode side: (request id, source instance) of the handles dropped unread since the
        last call. The control plane tells each source to ``release`` them."""
        unread, self._unread = self._unread, []
        return unread

    def drop_releases(self) -> None:
        """Forget the releases not sent yet (the worker they were for is gone)."""
        self._releases = []

    def release(self, req_id: str) -> None:
        """The engine will not hand ``req_id`` off after all (its saved KV was returned in
        ``kv_transfer_params``): its lease ends at the next step."""
        self._releases.append(req_id)
