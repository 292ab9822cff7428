"""The state one scheduler's helpers share: its configs, its KV cache, its requests and their
queues, and the few mutations of them that more than one helper needs.

``Scheduler`` owns one ``SchedulerState``; the step (``StepBuilder``, ``StepBatch``,
``Admitter``), the remote-KV bookkeeping (``RemoteKV``) and the integrity check are handed
this state explicitly instead of their owner, so none of them depends on ``Scheduler``.
"""

from __future__ import annotations

from scheduler.config import CacheConfig, LoRAConfig, SchedulerConfig
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.kv_connector import SchedulerConnector
from scheduler.queues import create_request_queue, priority_key
from scheduler.request import Request, RequestStatus


def status_before_load(request: Request) -> RequestStatus:
    """The status a request that held blocks goes back to the waiting queue with."""
    # A request preempted before its (re)load goes back as PREEMPTED, so that the worker,
    # which already knows it, gets it as resumed rather than new.
    return RequestStatus.PREEMPTED if request.preempted_before_load else RequestStatus.WAITING


class SchedulerState:
    """The requests of one instance and where each one is.

    ``waiting`` (a FCFS or priority queue of requests that hold no blocks), ``holding``
    (waiting requests that hold blocks: remote KV being loaded or loaded) and ``running``.
    ``requests`` also keeps finished requests whose blocks are not free yet (delayed free on
    the prefill side, or a load still writing into them). ``running`` and ``holding`` may be
    replaced by a new list (not only mutated): read them from here, not from a stale copy.
    """

    __slots__ = (
        "block_size",
        "cache_config",
        "connector",
        "discarded_in_flight",
        "finished_req_ids",
        "holding",
        "kv_cache_manager",
        "lora_config",
        "num_preemptions",
        "num_steps",
        "requests",
        "running",
        "scheduler_config",
        "waiting",
    )

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        lora_config: LoRAConfig | None,
        connector: SchedulerConnector | None,
        kv_cache_manager: KVCacheManager,
    ) -> None:
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.lora_config = lora_config
        self.connector = connector
        self.block_size = cache_config.block_size
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduler_config.policy)
        self.holding: list[Request] = []
        self.running: list[Request] = []
        # Shipped to the workers with the next SchedulerOutput.
        self.finished_req_ids: set[str] = set()
        # Requests whose in-flight output must be dropped, oldest first per id: ones freed
        # while a step naming them was in flight (the id may even be in use again), and
        # ones whose synchronously loaded KV turned out bad.
        self.discarded_in_flight: dict[str, list[Request]] = {}
        self.num_steps = 0
        self.num_preemptions = 0  # since the last SchedulerStats

    # -- preemption ----------------------------------------------------------------------
    def pick_victim(self) -> Request:
        """The running request to preempt next. FCFS: the last admitted. Priority: the worst
        (priority, arrival)."""
        if self.scheduler_config.policy == "priority":
            return max(self.running, key=priority_key)
        return self.running[-1]

    def running_loras(self) -> set[int]:
        """Adapters of the running requests: each holds one of ``max_loras`` slots."""
        return {r.lora_int_id for r in self.running if r.lora_request is not None}

    def preempt(self, request: Request) -> None:
        """Evict a running request by recompute: free its blocks, send it back to the front
        of the waiting queue with nothing computed. The output of its steps in flight is
        still delivered (the tokens are valid), unless a save of its KV is among them
        (``SchedulerConnector.request_preempted``): then it is dropped. Mutates ``running``,
        ``waiting``, the block tables, the request and the preemption counter."""
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend_request(request)
        if self.connector is not None and self.connector.request_preempted(request):
            self.discard_in_flight_output(request)

    def release_to_waiting(self, request: Request, preemption: bool = False) -> None:
        """Send a request that holds blocks but is not running (the caller has taken it out
        of ``holding``) back to the front of the waiting queue with nothing computed: after
        a failed load, or evicted to end a deadlock (``preemption``: counted as one).
        Mutates ``waiting``, the block tables and the request."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        if preemption:
            request.num_preemptions += 1
            self.num_preemptions += 1
        request.status = status_before_load(request)
        self.waiting.prepend_request(request)

    # -- freeing -------------------------------------------------------------------------
    def free_blocks(self, request: Request) -> None:
        """Return a finished request's blocks and forget it (``requests``); output still in
        flight for it goes to ``discarded_in_flight``."""
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        if request.num_in_flight_tokens > 0:
            # A step naming it is still in flight: that step's output must drain into this
            # object, not into a new request that reuses the id.
            self.discard_in_flight_output(request)

    def drop_from_queues(self, running_ids: set[str], waiting: list[Request]) -> None:
        """Take stopped requests out of ``running`` (by id) and ``waiting``."""
        if running_ids:
            self.running = [r for r in self.running if r.request_id not in running_ids]
        if waiting:
            self.waiting.remove_requests(waiting)

    # -- output of steps in flight -------------------------------------------------------
    def discard_in_flight_output(self, request: Request) -> None:
        """Drop the output of every step in flight for ``request`` (if any): queues it in
        ``discarded_in_flight``."""
        if request.num_in_flight_tokens > 0:
            queue = self.discarded_in_flight.setdefault(request.request_id, [])
            if not any(r is request for r in queue):
                queue.append(request)

    def drain_discarded(self, req_id: str, num_scheduled: int) -> None:
        """One step's output for a discarded ``req_id`` arrived: count it off the oldest
        discarded request of that id (mutates ``discarded_in_flight``)."""
        queue = self.discarded_in_flight[req_id]
        queue[0].num_in_flight_tokens -= num_scheduled
        if queue[0].num_in_flight_tokens <= 0:
            queue.pop(0)
            if not queue:
                del self.discarded_in_flight[req_id]
