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
from scheduler.queues import create_request_queue, priority_key
from scheduler.remote_kv import RemoteKV, status_before_load
from scheduler.request import Request, RequestStatus
from scheduler.step import StepBuilder
from scheduler.stop import append_and_check_stop, check_stop

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED


class Scheduler:
    """Decides, step by step, which tokens of which requests one instance computes.

    Owns the requests of its instance: ``waiting`` (a FCFS or priority queue of requests that
    hold no blocks), ``holding`` (waiting requests that hold blocks: remote KV being loaded or
    loaded), and ``running``. ``requests`` also keeps finished requests whose blocks are not
    free yet (delayed free on the prefill side, or a load still writing into them).
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
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.lora_config = lora_config
        self.connector = connector
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            block_size=cache_config.block_size,
            num_blocks=cache_config.num_blocks,
            max_model_len=scheduler_config.max_model_len,
            enable_caching=cache_config.enable_prefix_caching,
            watermark=scheduler_config.watermark,
        )
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.holding: list[Request] = []
        self.running: list[Request] = []
        # Shipped to the workers with the next SchedulerOutput.
        self.finished_req_ids: set[str] = set()
        self.remote_kv = RemoteKV(self)
        # Requests whose in-flight output must be dropped, oldest first per id: ones freed
        # while a step naming them was in flight (the id may even be in use again), and
        # ones whose synchronously loaded KV turned out bad.
        self.discarded_in_flight: dict[str, list[Request]] = {}
        self.num_steps = 0
        self._num_preemptions = 0  # since the last make_stats()

    # -- requests in ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises ``ValueError`` for one that can never be served."""
        cfg = self.scheduler_config
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt_token_ids must not be empty")
        if request.num_prompt_tokens >= cfg.max_model_len:
            raise ValueError(
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
        if request.lora_request is not None and self.lora_config is None:
            raise ValueError("lora_request given but LoRA is not enabled (no lora_config)")
        if request.do_remote_prefill and self.connector is None:
            raise ValueError("kv_transfer_params.do_remote_prefill needs a KV connector")
        request.set_limits(cfg.max_model_len)
        if request.output_token_ids and request.output_token_ids[-1] in request.stop_check_ids:
            raise ValueError(
                f"output_token_ids end with stop token {request.output_token_ids[-1]}: "
                "the request has already finished"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> None:
        """End requests from outside (abort, a stop string found by the front end).

        Unknown and already finished ids are ignored; ``None`` means all. A request whose
        remote KV is still being loaded keeps its blocks until the load reports done.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status.name} is not a finished status")
        if request_ids is None:
            request_ids = list(self.requests)
        elif isinstance(request_ids, str):
            request_ids = (request_ids,)
        stopped_running: set[str] = set()
        stopped_waiting: list[Request] = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                stopped_running.add(req_id)
            elif request in self.holding:
                self.holding.remove(request)
            else:
                stopped_waiting.append(request)
            request.status = finished_status
            self.free_request(request)
        self._drop_from_queues(stopped_running, stopped_waiting)

    def abandon_all(self, finished_status: RequestStatus) -> list[str]:
        """The instance's worker is gone: end every request with ``finished_status`` and forget
        all KV state at once -- no report will come for loads or sends in flight, so nothing
        may wait for one. Returns the ids of the requests that were unfinished."""
        unfinished = [rid for rid, r in self.requests.items() if not r.is_finished]
        self.finish_requests(None, finished_status)
        for request in list(self.requests.values()):  # still holding blocks for a report
            request.kv_transfer_params = None  # drop transport handles too
            request.awaiting_remote_kvs = False
            self.remote_kv.free_after_recv.discard(request.request_id)
            self.free_blocks(request)
        self.discarded_in_flight.clear()
        return unfinished

    # -- the step ------------------------------------------------------------------------
    def schedule(self, max_running_reqs: int | None = None) -> SchedulerOutput:
        """Pick this step's tokens. Mutates queues, block tables and, optimistically,
        ``num_computed_tokens`` of every scheduled request (outputs arrive later).

        ``max_running_reqs`` caps how many already-running requests this step continues (a
        pipeline-parallel loop splits them into micro-batches, one per stage in flight; the
        rest go in the next step). Admission is unaffected."""
        cfg = self.scheduler_config
        num_present = len(self.running) + len(self.waiting) + len(self.holding)
        threshold = cfg.long_prefill_token_threshold if num_present > 1 else 0
        step = StepBuilder(self, cfg.max_num_batched_tokens, threshold, max_running_reqs)
        step.schedule_running()
        # A step that preempted for KV space admits nobody: the freed blocks go to the
        # running requests that needed them next step, not to new arrivals.
        if not step.preempted_for_kv:
            step.schedule_waiting()
        out = step.make_output()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self._update_after_schedule(out)
        return out

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        async_scheduling = self.scheduler_config.async_scheduling
        requests = self.requests
        for req_id, n in out.num_scheduled_tokens.items():
            request = requests[req_id]
            request.num_computed_tokens += n
            request.num_in_flight_tokens += n
            # Async: a step that reaches the end of the known tokens samples one more; count
            # it now so the next schedule() can run the following decode before it returns.
            if async_scheduling and request.num_computed_tokens >= (
                len(request.all_token_ids) + request.num_output_placeholders
            ):
                request.num_output_placeholders += 1
        self.num_steps += 1

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's results (exactly once per step, in step order): append tokens,
        stop finished requests and free their blocks, and take in the connector's reports.
        Returns one output per request that produced tokens or finished."""
        mro = model_runner_output
        outputs: list[EngineCoreOutput] = []
        if self.connector is not None and mro.kv_connector_output is not None:
            self.connector.update_connector_output(mro.kv_connector_output)
        if mro.failed_recving:
            self.remote_kv.on_recv_failed(mro.failed_recving, outputs)
        async_scheduling = self.scheduler_config.async_scheduling
        max_model_len = self.scheduler_config.max_model_len
        index = mro.req_id_to_index
        all_sampled = mro.sampled_token_ids
        all_logprobs = mro.logprobs
        requests = self.requests
        stopped_running: set[str] = set()
        stopped_waiting: list[Request] = []
        # The hot loop (once per scheduled request per step): locals, no helper for the
        # common single-token case.
        discarded = self.discarded_in_flight
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            if discarded and req_id in discarded:
                self._drain_discarded(req_id, num_scheduled)
                continue
            request = requests.get(req_id)
            if request is None:
                continue
            request.num_in_flight_tokens -= num_scheduled
            status = request.status
            if status > _PREEMPTED:  # aborted or stopped while this step was in flight
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
                out.kv_transfer_params = self.free_request(request)
            outputs.append(out)
        self._drop_from_queues(stopped_running, stopped_waiting)
        if self.remote_kv.sync_loading:
            self.remote_kv.confirm_sync_loads(scheduler_output)
        for req_id in mro.finished_recving or ():
            self.remote_kv.on_recv_finished(req_id)
        for req_id in mro.finished_sending or ():
            request = self.requests.get(req_id)
            if request is not None and request.is_finished:
                self.free_blocks(request)
        return outputs

    # -- freeing -------------------------------------------------------------------------
    def free_request(self, request: Request) -> dict[str, object] | None:
        """A request just finished: tell the connector, then free its blocks now, after its
        KV has been sent (delay_free), or after a load into them has ended."""
        delay_free, kv_transfer_params = False, None
        if self.connector is not None:
            num_blocks = cdiv(request.num_computed_tokens, self.block_size)
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[:num_blocks]
            delay_free, kv_transfer_params = self.connector.request_finished(request, block_ids)
        self.finished_req_ids.add(request.request_id)
        self.remote_kv.sync_loading.discard(request.request_id)
        if not self.remote_kv.hold_until_load_ends(request) and not delay_free:
            self.free_blocks(request)
        return kv_transfer_params

    def free_blocks(self, request: Request) -> None:
        """Return a finished request's blocks and forget it."""
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        if request.num_in_flight_tokens > 0:
            # A step naming it is still in flight: that step's output must drain into this
            # object, not into a new request that reuses the id.
            self.discard_in_flight_output(request)

    def discard_in_flight_output(self, request: Request) -> None:
        """Drop the output of every step in flight for ``request`` (if any)."""
        if request.num_in_flight_tokens > 0:
            queue = self.discarded_in_flight.setdefault(request.request_id, [])
            if not any(r is request for r in queue):
                queue.append(request)

    def _drain_discarded(self, req_id: str, num_scheduled: int) -> None:
        queue = self.discarded_in_flight[req_id]
        queue[0].num_in_flight_tokens -= num_scheduled
        if queue[0].num_in_flight_tokens <= 0:
            queue.pop(0)
            if not queue:
                del self.discarded_in_flight[req_id]

    def _drop_from_queues(self, running_ids: set[str], waiting: list[Request]) -> None:
        if running_ids:
            self.running = [r for r in self.running if r.request_id not in running_ids]
        if waiting:
            self.waiting.remove_requests(waiting)

    # -- preemption ----------------------------------------------------------------------
    def pick_victim(self) -> Request:
        """FCFS: the last admitted. Priority: the worst (priority, arrival)."""
        if self.scheduler_config.policy == "priority":
            return max(self.running, key=priority_key)
        return self.running[-1]

    def running_loras(self) -> set[int]:
        """Adapters of the running requests: each holds one of ``max_loras`` slots."""
        return {r.lora_int_id for r in self.running if r.lora_request is not None}

    def release_to_waiting(self, request: Request, preemption: bool = False) -> None:
        """Send a request that holds blocks but is not running back to the front of the
        waiting queue with nothing computed: after a failed load, or evicted to end a
        deadlock (``preemption``: counted as one)."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        if preemption:
            request.num_preemptions += 1
            self._num_preemptions += 1
        request.status = status_before_load(request)
        self.waiting.prepend_request(request)

    def preempt(self, request: Request) -> None:
        """Evict a running request by recompute: free its blocks, send it back to the front
        of the waiting queue with nothing computed."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.prepend_request(request)

    # -- queries -------------------------------------------------------------------------
    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.holding) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def has_requests(self) -> bool:
        """Unfinished requests, or finished ones whose blocks wait for a KV send or load to
        report: an engine loop must keep stepping (and collecting reports) while True."""
        return bool(self.requests)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        """Gauges now, counters since the previous call."""
        prefix = self.kv_cache_manager.make_prefix_cache_stats()
        num_preemptions, self._num_preemptions = self._num_preemptions, 0
        num_remote = sum(1 for r in self.holding if r.awaiting_remote_kvs)
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.holding),
            num_waiting_for_remote_kvs=num_remote,
            kv_cache_usage=self.kv_cache_manager.usage,
            prefix_cache_requests=prefix.requests,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=num_preemptions,
            num_steps=self.num_steps,
        )

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the queues, statuses or block tables disagree."""
        check_scheduler_integrity(self)
