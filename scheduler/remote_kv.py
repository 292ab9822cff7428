"""The remote-KV lifecycle of one scheduler's requests (DESIGN §3.2, reference §4.3–4.5).

Decode side: a request whose KV is loaded asynchronously waits in ``holding`` with
``WAITING_FOR_REMOTE_KVS`` until the worker reports ``finished_recving`` (promote) or
``failed_recving`` (recompute or fail). A load into blocks must end before the blocks are
reused, so a request finished meanwhile keeps them until the report. A synchronous load
(done inside the step) is confirmed when the step's output arrives; its blocks are hashed
only then, so a failed load never becomes a prefix hit for anyone.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler.kv_cache_manager import cdiv
from scheduler.outputs import EngineCoreOutput, SchedulerOutput
from scheduler.request import FinishReason, Request, RequestStatus
from scheduler.state import SchedulerState, status_before_load


def _stop_remote_prefill(request: Request) -> None:
    # Connectors read this to decide whether to load (again): after a failure, recompute.
    # The transport's handle goes too: the source's copy is no longer needed, and dropping
    # the reference lets the transport release it (an object store entry, a lease).
    params = dict(request.kv_transfer_params or {})
    params.pop("handle", None)
    params["do_remote_prefill"] = False
    request.kv_transfer_params = params


def _already_released(request: Request) -> None:
    """A request preempted while its loading step was in flight holds no blocks."""


class RemoteKV:
    """Load bookkeeping, and the end of a request's life, for one scheduler's ``state``.

    Owns the sets below; mutates the state's ``requests``, ``holding``, ``running``,
    ``waiting``, ``finished_req_ids`` and block tables through its primitives.
    """

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.finished_recving: set[str] = set()  # reported done; promoted next schedule()
        self.free_after_recv: set[str] = set()  # finished while loading; freed at the report
        self.sync_loading: set[str] = set()  # admitted with a synchronous load, unconfirmed

    # -- reports from the worker ---------------------------------------------------------
    def on_recv_finished(self, req_id: str) -> None:
        """The worker finished loading ``req_id``'s KV: promote it at the next step
        (``finished_recving``), or free its blocks now if it finished meanwhile."""
        request = self.state.requests.get(req_id)
        if request is None or not request.awaiting_remote_kvs:
            return
        if req_id in self.free_after_recv:
            self.free_after_recv.discard(req_id)
            request.awaiting_remote_kvs = False
            self.state.free_blocks(request)
        else:
            self.finished_recving.add(req_id)

    def on_recv_failed(self, req_ids: set[str], outputs: list[EngineCoreOutput]) -> None:
        """A load failed or timed out: recompute locally (default: the request goes back to
        ``waiting`` with nothing computed) or fail it (its output joins ``outputs``)."""
        for req_id in req_ids:
            request = self.state.requests.get(req_id)
            if request is None or (request.is_finished and not request.awaiting_remote_kvs):
                continue
            if request.awaiting_remote_kvs:
                request.awaiting_remote_kvs = False
                self.finished_recving.discard(req_id)
                if req_id in self.free_after_recv:  # aborted meanwhile: the load has ended
                    self.free_after_recv.discard(req_id)
                    self._drop_remote(request)
                    self.state.free_blocks(request)
                    continue
                self.state.holding.remove(request)
                self._fail_or_recompute(request, outputs, release=self.state.release_to_waiting)
            elif req_id in self.sync_loading:
                self.sync_loading.discard(req_id)
                request.kv_hash_deferred = False
                # This step's sample was computed from bad KV: drop it (and any other step
                # in flight), then treat the request as if the load never happened. If it was
                # preempted meanwhile, its blocks are already gone.
                self.state.discard_in_flight_output(request)
                running = request.status == RequestStatus.RUNNING
                self._fail_or_recompute(
                    request, outputs, release=self.state.preempt if running else _already_released
                )

    def _fail_or_recompute(
        self,
        request: Request,
        outputs: list[EngineCoreOutput],
        release: Callable[[Request], None],
    ) -> None:
        if self.state.scheduler_config.kv_load_failure_policy == "fail":
            if request.status == RequestStatus.RUNNING:
                self.state.running.remove(request)
            elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.state.waiting.remove_request(request)
            request.status = RequestStatus.FINISHED_ERROR
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ERROR,
                    kv_transfer_params=self.free_request(request),
                    error="remote KV load failed (kv_load_failure_policy='fail')",
                )
            )
            return
        self._drop_remote(request)
        _stop_remote_prefill(request)
        request.num_cached_tokens = None  # counted again at the local re-admission
        release(request)

    def _drop_remote(self, request: Request) -> None:
        """A load of ``request`` failed: its source may let the KV go now, not at expiry."""
        if self.state.connector is not None:
            self.state.connector.remote_kv_dropped(request)

    def confirm_sync_loads(self, scheduler_output: SchedulerOutput) -> None:
        """The step that ran a synchronous load returned without a failure: its blocks are
        good, so make them findable (hashes them; takes them out of ``sync_loading``)."""
        for req_id in [r for r in self.sync_loading if r in scheduler_output.num_scheduled_tokens]:
            self.sync_loading.discard(req_id)
            request = self.state.requests.get(req_id)
            if request is None:
                continue
            # The source's copy is consumed, as in promote -- also for a request preempted
            # while the step was in flight: it must recompute, not read that copy again.
            if request.do_remote_prefill:
                _stop_remote_prefill(request)
            if request.status == RequestStatus.RUNNING:
                request.kv_hash_deferred = False
                # Later steps may be in flight (async): hash only known, computed tokens.
                self.state.kv_cache_manager.cache_blocks(
                    request, min(request.num_computed_tokens, request.num_tokens)
                )

    # -- the end of a request ------------------------------------------------------------
    def free_request(self, request: Request) -> dict[str, object] | None:
        """A request just finished: tell the connector, then free its blocks now, after its
        KV has been sent (delay_free), or after a load into them has ended. Mutates the
        state's ``finished_req_ids`` (and ``requests`` and block tables if freed now).
        Returns the connector's ``kv_transfer_params`` for the request's last output."""
        state = self.state
        delay_free, kv_transfer_params = False, None
        connector = state.connector
        if connector is not None:
            num_blocks = cdiv(request.num_computed_tokens, state.block_size)
            block_ids = state.kv_cache_manager.get_block_ids(request.request_id)[:num_blocks]
            delay_free, kv_transfer_params = connector.request_finished(request, block_ids)
        state.finished_req_ids.add(request.request_id)
        self.sync_loading.discard(request.request_id)
        if not self.hold_until_load_ends(request) and not delay_free:
            state.free_blocks(request)
        return kv_transfer_params

    # -- transitions ---------------------------------------------------------------------
    def promote(self, request: Request) -> None:
        """Remote KV for ``request`` has arrived: make its blocks findable and let it run.
        When the whole sequence arrived, the last token is recomputed to get its logits."""
        self.finished_recving.discard(request.request_id)
        request.awaiting_remote_kvs = False
        request.kv_hash_deferred = False
        num_loaded = min(request.num_computed_tokens, request.num_tokens)
        self.state.kv_cache_manager.cache_blocks(request, num_loaded)
        request.num_computed_tokens = min(num_loaded, request.num_tokens - 1)
        # A prefill instance's copy has been consumed (and freed there): a later preemption
        # recomputes locally or hits the local prefix cache. (Other connectors, such as an
        # offload store, may serve the same KV again; their params are left alone.)
        if request.do_remote_prefill:
            _stop_remote_prefill(request)
        request.status = status_before_load(request)

    def hold_until_load_ends(self, request: Request) -> bool:
        """``request`` just finished. True if a load may still write into its blocks (they
        are freed at the load's report instead of now)."""
        if not request.awaiting_remote_kvs:
            return False
        if request.request_id in self.finished_recving:
            self.finished_recving.discard(request.request_id)
            request.awaiting_remote_kvs = False
            return False
        self.free_after_recv.add(request.request_id)
        return True

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the load bookkeeping disagrees with the requests."""
        requests = self.state.requests
        for req_id in self.free_after_recv:
            r = requests.get(req_id)
            assert r is not None and r.is_finished and r.awaiting_remote_kvs, (
                f"{req_id} waits to be freed after a load but is not a finished loading request"
            )
        for req_id in self.finished_recving:
            r = requests.get(req_id)
            assert r is not None and r.awaiting_remote_kvs, f"{req_id} loaded but not loading"
        for r in requests.values():
            if not r.is_finished:
                assert r.awaiting_remote_kvs == (
                    r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                ), f"{r} awaiting_remote_kvs disagrees with its status"
