"""One ``schedule()`` call: the running pass, the waiting passes and the output.

``StepBuilder`` holds the per-step scratch state (budget, what was scheduled, what was
preempted) and works on its ``Scheduler``'s queues directly; it lives only for one step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from scheduler.admission import Admitter
from scheduler.kv_cache_manager import NO_BLOCKS
from scheduler.kv_cache_utils import KVCacheBlocks
from scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


class StepBuilder:
    def __init__(
        self,
        scheduler: Scheduler,
        token_budget: int,
        threshold: int,
        max_running_reqs: int | None = None,
    ) -> None:
        self.s = scheduler
        self.max_running_reqs = max_running_reqs
        self.cfg = scheduler.scheduler_config
        self.kv = scheduler.kv_cache_manager
        self.token_budget = token_budget
        self.threshold = threshold
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_blocks: dict[str, KVCacheBlocks] = {}
        self.new_reqs: list[Request] = []
        self.resumed_reqs: list[Request] = []
        self.running_reqs: list[Request] = []
        self.preempted: list[Request] = []
        self.preempted_for_kv = False
        self.loras: set[int] = set()

    # -- bookkeeping ---------------------------------------------------------------------
    def _schedule(self, request: Request, n: int, new_blocks: KVCacheBlocks) -> None:
        self.num_scheduled_tokens[request.request_id] = n
        self.new_blocks[request.request_id] = new_blocks
        self.token_budget -= n

    def preempt(self, victim: Request) -> None:
        """Preempt ``victim``, undoing its part of this step if it was already scheduled."""
        n = self.num_scheduled_tokens.pop(victim.request_id, None)
        if n is not None:  # scheduled earlier in this step: give the budget back
            self.token_budget += n
            del self.new_blocks[victim.request_id]
            for scheduled in (self.running_reqs, self.new_reqs, self.resumed_reqs):
                if victim in scheduled:
                    scheduled.remove(victim)
                    break
            # Blocks hashed for this step's tokens will never be computed.
            self.kv.uncache_uncomputed_blocks(victim, victim.num_computed_tokens)
        self.s.preempt(victim)
        self.preempted.append(victim)
        if self.s.lora_config is not None:
            self.loras = self.s.running_loras()

    def clip(self, n: int) -> int:
        """Apply the long-prefill threshold and the remaining budget to ``n`` tokens."""
        if 0 < self.threshold < n:
            n = self.threshold
        return min(n, self.token_budget)

    # -- running -------------------------------------------------------------------------
    @staticmethod
    def _release_loaded(s: Scheduler) -> bool:
        """KV is short: a request whose remote KV has arrived but that waits for a running
        slot gives its blocks back before any running request is preempted (its blocks stay
        hashed, so it may find them again). True if one was released."""
        for request in reversed(s.holding):
            if not request.awaiting_remote_kvs:
                s.holding.remove(request)
                s.release_to_waiting(request, preemption=True)
                return True
        return False

    def schedule_running(self) -> None:
        """Give each running request its next tokens, preempting on KV pressure.

        The hot loop of the scheduler (once per running request per step): locals only."""
        s, cfg = self.s, self.cfg
        append_slots = self.kv.append_slots
        async_scheduling = cfg.async_scheduling
        lookahead = cfg.num_lookahead_slots
        max_computed = cfg.max_model_len - 1  # the last position never needs computing
        threshold = self.threshold
        running = s.running
        num_scheduled = self.num_scheduled_tokens
        new_blocks_of = self.new_blocks
        running_reqs = self.running_reqs
        budget = self.token_budget
        cap = len(running) if self.max_running_reqs is None else self.max_running_reqs
        i = 0
        while i < len(running) and budget > 0 and len(running_reqs) < cap:
            request = running[i]
            placeholders = request.num_output_placeholders
            if async_scheduling:
                # Every remaining output is already on its way.
                if placeholders and (
                    len(request.output_token_ids) + placeholders >= request.max_tokens
                ):
                    i += 1
                    continue
            elif request.num_in_flight_tokens:
                # Sync pipelining: a request is in at most one in-flight batch.
                i += 1
                continue
            computed = request.num_computed_tokens
            n = len(request.all_token_ids) + placeholders - computed
            if 0 < threshold < n:
                n = threshold
            if n > budget:
                n = budget
            if n > max_computed - computed:
                n = max_computed - computed
            if n <= 0:
                i += 1
                continue
            end = computed + n
            if end + lookahead <= request.kv_slots and end < request.kv_hash_boundary:
                new_blocks: KVCacheBlocks | None = NO_BLOCKS  # fits its blocks, fills none
            else:
                new_blocks = None
            while new_blocks is None:
                new_blocks = append_slots(request, n, lookahead)
                if new_blocks is not None:
                    break
                if self._release_loaded(s):
                    continue
                victim = s.pick_victim()
                if running.index(victim) < i:
                    i -= 1
                self.token_budget = budget
                self.preempt(victim)  # may give back budget of an already scheduled victim
                budget = self.token_budget
                self.preempted_for_kv = True
                if victim is request:
                    break
            if new_blocks is None:
                if cfg.policy == "fcfs":
                    break  # it was the last running request; nothing behind it
                continue  # running[i] is now the next request
            running_reqs.append(request)
            num_scheduled[request.request_id] = n
            new_blocks_of[request.request_id] = new_blocks
            budget -= n
            i += 1
        self.token_budget = budget
        if s.lora_config is not None:  # adapters of every running request hold a slot
            self.loras = s.running_loras()

    def admit(self, request: Request, n: int, num_computed: int, blocks: KVCacheBlocks) -> None:
        """Move an admitted request into ``running`` and schedule ``n`` of its tokens."""
        resumed = request.status == RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        request.num_skipped_steps = 0
        self.s.running.append(request)
        (self.resumed_reqs if resumed else self.new_reqs).append(request)
        if request.lora_request is not None:
            self.loras.add(request.lora_int_id)
        self._schedule(request, n, blocks)

    def schedule_waiting(self) -> None:
        """Admission: requests holding blocks, then the waiting queue (see admission.py)."""
        admitter = Admitter(self)
        admitter.schedule_holding()
        admitter.schedule_waiting()
        admitter.release_if_deadlocked()

    # -- output --------------------------------------------------------------------------
    def make_output(self) -> SchedulerOutput:
        """Package the step for the workers. Runs before ``num_computed_tokens`` advances."""
        s, kv = self.s, self.kv
        new_reqs = [
            NewRequestData.from_request(r, kv.get_block_ids(r.request_id)) for r in self.new_reqs
        ]
        cached = CachedRequestData()
        req_ids, resumed_flags = cached.req_ids, cached.resumed_from_preemption
        new_token_ids, new_block_ids = cached.new_token_ids, cached.new_block_ids
        num_computed = cached.num_computed_tokens
        num_scheduled = self.num_scheduled_tokens
        for request in self.running_reqs:
            req_id = request.request_id
            start = request.num_computed_tokens
            blocks = self.new_blocks[req_id].blocks
            req_ids.append(req_id)
            new_token_ids.append(request.all_token_ids[start : start + num_scheduled[req_id]])
            new_block_ids.append([b.block_id for b in blocks] if blocks else None)
            num_computed.append(start)
        resumed_flags.extend([False] * len(req_ids))
        for request in self.resumed_reqs:
            req_id = request.request_id
            start = request.num_computed_tokens
            req_ids.append(req_id)
            resumed_flags.append(True)
            new_token_ids.append(request.all_token_ids[start : start + num_scheduled[req_id]])
            new_block_ids.append(kv.get_block_ids(req_id))
            num_computed.append(start)
            cached.resumed_token_ids[req_id] = list(request.all_token_ids)
        finished, s.finished_req_ids = s.finished_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=self.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(self.num_scheduled_tokens.values()),
            preempted_req_ids={r.request_id for r in self.preempted},
            finished_req_ids=finished,
            step_id=s.num_steps,
        )
