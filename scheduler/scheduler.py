"""The scheduler of one model instance (vLLM v1 semantics, DESIGN §3.1 and §4).

There are no prefill/decode phases: every request tries to bring ``num_computed_tokens`` up to
``num_tokens`` within a per-step token budget shared by running, then waiting requests.
Chunked prefill, prefix caching, preemption and remote KV loads all fall out of that invariant.

The engine step is::

    out = scheduler.schedule()
    result = worker.execute_model(out)
    outputs = scheduler.update_from_output(out, result)
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.config import CacheConfig, LoRAConfig, SchedulerConfig
from scheduler.integrity import check_scheduler_integrity
from scheduler.kv_cache_manager import KVCacheManager, cdiv
from scheduler.kv_connector import SchedulerConnector
from scheduler.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats
from scheduler.queues import RequestQueue
from scheduler.remote_kv import RemoteKV
from scheduler.request import FinishReason, PromptLogprob, Request, RequestRejected, RequestStatus
from scheduler.state import SchedulerState
from scheduler.step import StepBuilder
from scheduler.stop import append_and_check_stop, check_stop

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


class Scheduler:
    """Decides, step by step, which tokens of which requests one instance computes.

    Owns its instance's requests, queues, configs and KV cache in ``state`` (a
    ``SchedulerState``: see there), exposed as properties of the same names (``running``,
    ``holding``, ``finished_req_ids`` and ``num_steps`` writable), and the remote-KV
    bookkeeping in ``remote_kv``. Each step is built by a ``StepBuilder`` over the state.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        lora_config: LoRAConfig | None = None,
        connector: SchedulerConnector | None = None,
    ) -> None:
        if cache_config.num_blocks is None:
            raise ValueError("cache_config.num_blocks must be set before building a Scheduler")
        max_len_blocks = cdiv(scheduler_config.max_model_len, cache_config.block_size)
        if max_len_blocks > cache_config.num_blocks:
            # vLLM refuses to start in this case too: one full-length request could never fit.
            raise ValueError(
                f"max_model_len ({scheduler_config.max_model_len}) needs {max_len_blocks} KV "
                f"blocks of {cache_config.block_size} tokens but num_blocks is "
                f"{cache_config.num_blocks}: lower max_model_len or give the cache more blocks."
            )
        kv_cache_manager = KVCacheManager(
            block_size=cache_config.block_size,
            num_blocks=cache_config.num_blocks,
            max_model_len=scheduler_config.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            watermark=scheduler_config.watermark,
        )
        self.state = SchedulerState(
            scheduler_config, cache_config, lora_config, connector, kv_cache_manager
        )
        self.remote_kv = RemoteKV(self.state)

    # -- requests in ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request (``requests``, ``waiting``). Raises ``ValueError`` for one that
        can never be served."""
        state = self.state
        cfg = state.scheduler_config
        if request.request_id in state.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise RequestRejected("prompt_token_ids must not be empty")
        if request.num_prompt_tokens >= cfg.max_model_len:
            raise RequestRejected(
                f"prompt has {request.num_prompt_tokens} tokens but max_model_len is "
                f"{cfg.max_model_len}: the prompt must be shorter, to leave room for output"
            )
        if request.num_tokens >= cfg.max_model_len:
            raise ValueError(
                f"prompt + output_token_ids have {request.num_tokens} tokens but max_model_len "
                f"is {cfg.max_model_len}"
            )
        if request.num_output_tokens >= (request.sampling_params.max_tokens or cfg.max_model_len):
            raise ValueError(
                f"output_token_ids already hold {request.num_output_tokens} tokens, the whole "
                f"max_tokens ({request.sampling_params.max_tokens})"
            )
        if request.sampling_params.n != 1:
            raise ValueError("sampling_params.n must be 1 here: the front end fans out n > 1")
        if request.lora_request is not None and state.lora_config is None:
            raise RequestRejected("lora_request given but LoRA is not enabled (no lora_config)")
        if request.do_remote_prefill and state.connector is None:
            raise ValueError("kv_transfer_params.do_remote_prefill needs a KV connector")
        request.set_limits(cfg.max_model_len)
        if request.output_token_ids and request.output_token_ids[-1] in request.stop_check_ids:
            raise ValueError(
                f"output_token_ids end with stop token {request.output_token_ids[-1]}: "
                "the request has already finished"
            )
        request.status = RequestStatus.WAITING
        state.requests[request.request_id] = request
        state.waiting.add_request(request)

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> None:
        """End requests from outside (abort, a stop string found by the front end): takes
        them out of their queue and frees them (``free_request``).

        Unknown and already finished ids are ignored; ``None`` means all. A request whose
        remote KV is still being loaded keeps its blocks until the load reports done.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status.name} is not a finished status")
        state = self.state
        if request_ids is None:
            request_ids = list(state.requests)
        elif isinstance(request_ids, str):
            request_ids = (request_ids,)
        stopped_running: set[str] = set()
        stopped_waiting: list[Request] = []
        for req_id in request_ids:
            request = state.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                stopped_running.add(req_id)
            elif request in state.holding:
                state.holding.remove(request)
            else:
                stopped_waiting.append(request)
            request.status = finished_status
            self.remote_kv.free_request(request)
        state.drop_from_queues(stopped_running, stopped_waiting)

    def abandon_all(self, finished_status: RequestStatus) -> list[str]:
        """The instance's worker is gone: end every request with ``finished_status`` and forget
        all KV state at once -- no report will come for loads or sends in flight, so nothing
        may wait for one. Returns the ids of the requests that were unfinished."""
        state = self.state
        unfinished = [rid for rid, r in state.requests.items() if not r.is_finished]
        self.finish_requests(None, finished_status)
        for request in list(state.requests.values()):  # still holding blocks for a report
            if request.awaiting_remote_kvs and state.connector is not None:
                # Its load dies with the worker: the source may let the KV go now, not at
                # the lease's expiry (a request not loading yet was told at its finish).
                state.connector.remote_kv_dropped(request)
            request.kv_transfer_params = None  # drop transport handles too
            request.awaiting_remote_kvs = False
            self.remote_kv.free_after_recv.discard(request.request_id)
            state.free_blocks(request)
        state.discarded_in_flight.clear()
        return unfinished

    # -- the step ------------------------------------------------------------------------
    def schedule(self, max_running_reqs: int | None = None) -> SchedulerOutput:
        """Pick this step's tokens. Mutates queues, block tables and, optimistically,
        ``num_computed_tokens`` of every scheduled request (outputs arrive later).

        ``max_running_reqs`` caps how many already-running requests this step continues (a
        pipeline-parallel loop splits them into micro-batches, one per stage in flight; the
        rest go in the next step). Admission is unaffected."""
        step = StepBuilder(self.state, self.remote_kv, max_running_reqs)
        step.schedule_running()
        # A step that preempted for KV space admits nobody: the freed blocks go to the
        # running requests that needed them next step, not to new arrivals.
        if not step.preempted_for_kv:
            step.schedule_waiting()
        out = step.make_output()
        step.commit(out)
        return out

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's results (exactly once per step, in step order): append tokens,
        stop finished requests and free their blocks, and take in the connector's reports.
        Returns one output per request that produced tokens or finished."""
        state, remote_kv = self.state, self.remote_kv
        mro = model_runner_output
        outputs: list[EngineCoreOutput] = []
        if state.connector is not None and mro.kv_connector_output is not None:
            state.connector.update_connector_output(mro.kv_connector_output)
        if mro.failed_recving:
            remote_kv.on_recv_failed(mro.failed_recving, outputs)
        async_scheduling = state.scheduler_config.async_scheduling
        max_model_len = state.scheduler_config.max_model_len
        index = mro.req_id_to_index
        all_sampled = mro.sampled_token_ids
        all_logprobs = mro.logprobs
        if mro.prompt_logprobs:
            _store_prompt_logprobs(state.requests, mro.prompt_logprobs, state.discarded_in_flight)
        requests = state.requests
        stopped_running: set[str] = set()
        stopped_waiting: list[Request] = []
        failed = mro.failed_req_ids
        # The hot loop (once per scheduled request per step): locals, no helper for the
        # common single-token case.
        discarded = state.discarded_in_flight
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            if discarded and req_id in discarded:
                if failed and req_id in failed:  # freed meanwhile: its blocks went back
                    self._forget_step(discarded[req_id][0], scheduler_output, num_scheduled)
                state.drain_discarded(req_id, num_scheduled)
                continue
            request = requests.get(req_id)
            if request is None:
                continue
            request.num_in_flight_tokens -= num_scheduled
            status = request.status
            if status > _PREEMPTED:  # aborted or stopped while this step was in flight
                if failed and req_id in failed:  # (its blocks wait for a send or a load)
                    self._forget_step(request, scheduler_output, num_scheduled)
                continue
            if failed and req_id in failed:
                self._forget_step(request, scheduler_output, num_scheduled)
                outputs.append(
                    self._fail_request(request, failed[req_id], stopped_running, stopped_waiting)
                )
                continue
            i = index.get(req_id)
            if i is None:
                raise ValueError(f"ModelRunnerOutput has no entry for scheduled {req_id!r}")
            sampled = all_sampled[i]
            if not sampled:  # a partial prefill samples nothing
                continue
            # A preempted request still gets the (valid) tokens of a step that was already
            # in flight, but its reset counters are left alone.
            running = status == _RUNNING
            if async_scheduling and running:
                request.num_output_placeholders = max(
                    0, request.num_output_placeholders - len(sampled)
                )
            if len(sampled) == 1:
                kept = sampled
                token = sampled[0]
                request.output_token_ids.append(token)
                all_tokens = request.all_token_ids
                all_tokens.append(token)
                stopped = (
                    token in request.stop_check_ids or len(all_tokens) >= request.max_num_tokens
                ) and check_stop(request, max_model_len)
            else:
                # Tokens after a stop are dropped. No rollback of num_computed_tokens: without
                # speculative decoding, sampled tokens were never counted as computed.
                kept, stopped = append_and_check_stop(request, sampled, max_model_len)
            out = EngineCoreOutput(req_id, kept, None, None, request.num_cached_tokens or 0)
            if request.prompt_logprobs is not None and len(request.output_token_ids) == len(kept):
                # With the first token only; handed over (the scheduler keeps no reference).
                out.prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
            if all_logprobs is not None:
                logprobs = all_logprobs[i]
                if logprobs is not None:
                    out.new_logprobs = logprobs[: len(kept)]
            if stopped:
                out.finish_reason = request.get_finished_reason()
                out.stop_reason = request.stop_reason
                if running:
                    stopped_running.add(req_id)
                else:
                    stopped_waiting.append(request)
                out.kv_transfer_params = remote_kv.free_request(request)
            outputs.append(out)
        state.drop_from_queues(stopped_running, stopped_waiting)
        if remote_kv.sync_loading:
            remote_kv.confirm_sync_loads(scheduler_output)
        for req_id in mro.finished_recving or ():
            remote_kv.on_recv_finished(req_id)
        for req_id in mro.finished_sending or ():
            request = requests.get(req_id)
            if request is not None and request.is_finished:
                state.free_blocks(request)
        return outputs

    def _fail_request(
        self,
        request: Request,
        error: str,
        stopped_running: set[str],
        stopped_waiting: list[Request],
    ) -> EngineCoreOutput:
        """The workers could not compute ``request`` in a step (its LoRA adapter could not be
        read): it ends with ``error`` (its id joins ``stopped_running`` or
        ``stopped_waiting``). The blocks of that step's tokens have lost their hashes
        already (``_forget_step``)."""
        if request.status == _RUNNING:
            stopped_running.add(request.request_id)
        else:  # preempted while the step was in flight (its blocks went back to the pool)
            stopped_waiting.append(request)
        request.status = RequestStatus.FINISHED_ERROR
        return EngineCoreOutput(
            request.request_id,
            [],
            FinishReason.ERROR,
            num_cached_tokens=request.num_cached_tokens or 0,
            kv_transfer_params=self.remote_kv.free_request(request),
            error=error,
        )

    def _forget_step(
        self, request: Request, scheduler_output: SchedulerOutput, num_scheduled: int
    ) -> None:
        """A step could not apply ``request``'s adapter: the blocks its tokens of that step
        (and of later steps in flight) fall in hold KV computed without it, under its
        adapter's hashes. No request may find them again, wherever they are: in its table,
        in the table of a request that hit them (another sample of its prompt, admitted in
        the same step or in one started meanwhile), or back in the free queue (it was
        preempted, aborted or stopped while the step was in flight)."""
        start = _step_start(scheduler_output, request.request_id)
        end = start + num_scheduled
        if request.status == _RUNNING:
            end = max(end, request.num_computed_tokens)  # (later steps in flight)
        self.state.kv_cache_manager.forget_hashes(request, start, end)

    # -- freeing and preemption: done by the state and RemoteKV --------------------------
    def free_request(self, request: Request) -> dict[str, object] | None:
        """A request just finished: tell the connector, free its blocks (``RemoteKV``)."""
        return self.remote_kv.free_request(request)

    def free_blocks(self, request: Request) -> None:
        """Return a finished request's blocks and forget it (``SchedulerState.free_blocks``)."""
        self.state.free_blocks(request)

    def discard_in_flight_output(self, request: Request) -> None:
        """Drop the output of every step in flight for ``request`` (if any)."""
        self.state.discard_in_flight_output(request)

    def pick_victim(self) -> Request:
        """FCFS: the last admitted. Priority: the worst (priority, arrival)."""
        return self.state.pick_victim()

    def running_loras(self) -> set[int]:
        """Adapters of the running requests: each holds one of ``max_loras`` slots."""
        return self.state.running_loras()

    def release_to_waiting(self, request: Request, preemption: bool = False) -> None:
        """A request holding blocks goes back to ``waiting`` (``SchedulerState``)."""
        self.state.release_to_waiting(request, preemption)

    def preempt(self, request: Request) -> None:
        """Evict a running request by recompute (``SchedulerState.preempt``)."""
        self.state.preempt(request)

    # -- queries -------------------------------------------------------------------------
    def get_num_unfinished_requests(self) -> int:
        """Requests waiting, holding blocks, or running."""
        state = self.state
        return len(state.waiting) + len(state.holding) + len(state.running)

    def has_unfinished_requests(self) -> bool:
        """At least one request is waiting, holding blocks, or running."""
        return self.get_num_unfinished_requests() > 0

    def has_requests(self) -> bool:
        """``holds_requests``, or finished requests whose end the workers have not heard of
        (``finished_req_ids``: vLLM's ``has_finished_requests``; without it an instance that
        went idle kept the last requests' state in every worker until the next arrival): an
        engine loop must keep stepping (and collecting reports) while True."""
        return self.holds_requests() or bool(self.state.finished_req_ids)

    def holds_requests(self) -> bool:
        """Unfinished requests, or finished ones whose blocks wait for a KV send or load to
        report, or instructions for the worker that no request carries (the connector's
        ``has_pending``). (A drain waits for this: not for ``finished_req_ids``, which a
        failed instance, never stepped again, keeps for ever.)"""
        state = self.state
        return bool(state.requests) or (
            state.connector is not None and state.connector.has_pending()
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (see ``KVCacheManager.reset_prefix_cache``)."""
        return self.state.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        """Gauges now, counters since the previous call (resets the preemption counter)."""
        state = self.state
        prefix = state.kv_cache_manager.make_prefix_cache_stats()
        num_preemptions, state.num_preemptions = state.num_preemptions, 0
        num_remote = sum(1 for r in state.holding if r.awaiting_remote_kvs)
        return SchedulerStats(
            num_running_reqs=len(state.running),
            num_waiting_reqs=len(state.waiting) + len(state.holding),
            num_waiting_for_remote_kvs=num_remote,
            kv_cache_usage=state.kv_cache_manager.usage,
            prefix_cache_requests=prefix.requests,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=num_preemptions,
            num_steps=state.num_steps,
        )

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the queues, statuses or block tables disagree."""
        check_scheduler_integrity(self.state, self.remote_kv)

    # -- the state, by its old names -----------------------------------------------------
    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.state.scheduler_config

    @property
    def cache_config(self) -> CacheConfig:
        return self.state.cache_config

    @property
    def lora_config(self) -> LoRAConfig | None:
        return self.state.lora_config

    @property
    def connector(self) -> SchedulerConnector | None:
        return self.state.connector

    @property
    def block_size(self) -> int:
        return self.state.block_size

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        return self.state.kv_cache_manager

    @property
    def requests(self) -> dict[str, Request]:
        return self.state.requests

    @property
    def waiting(self) -> RequestQueue:
        return self.state.waiting

    @property
    def discarded_in_flight(self) -> dict[str, list[Request]]:
        return self.state.discarded_in_flight

    @property
    def holding(self) -> list[Request]:
        return self.state.holding

    @holding.setter
    def holding(self, value: list[Request]) -> None:
        self.state.holding = value

    @property
    def running(self) -> list[Request]:
        return self.state.running

    @running.setter
    def running(self, value: list[Request]) -> None:
        self.state.running = value

    @property
    def finished_req_ids(self) -> set[str]:
        return self.state.finished_req_ids

    @finished_req_ids.setter
    def finished_req_ids(self, value: set[str]) -> None:
        self.state.finished_req_ids = value

    @property
    def num_steps(self) -> int:
        return self.state.num_steps

    @num_steps.setter
    def num_steps(self, value: int) -> None:
        self.state.num_steps = value


def _step_start(scheduler_output: SchedulerOutput, req_id: str) -> int:
    """Where ``req_id``'s tokens of the step begin (its computed tokens when it was
    scheduled; its counters may have moved since: later steps, a preemption)."""
    for new in scheduler_output.scheduled_new_reqs:
        if new.req_id == req_id:
            return new.num_computed_tokens
    cached = scheduler_output.scheduled_cached_reqs
    return cached.num_computed_tokens[cached.req_ids.index(req_id)]


def _store_prompt_logprobs(
    requests: dict[str, Request],
    entries: dict[str, tuple[int, list[PromptLogprob]]],
    discarded: dict[str, list[Request]],
) -> None:
    """Write a step's prompt logprobs into their requests, by position (a chunk computed
    again after a preemption overwrites what it computed before). An id in ``discarded``
    names a request whose output of this step is dropped (``drain_discarded``): its entries
    are dropped with it -- the request now holding the id may be another one."""
    for req_id, (start, items) in entries.items():
        if req_id in discarded:
            continue
        request = requests.get(req_id)
        if request is None or request.prompt_logprobs is None:
            continue
        request.prompt_logprobs[start : start + len(items)] = items
