"""One ``schedule()`` call: the running pass, the waiting passes and the output.

``StepBuilder`` holds the per-step scratch state (budget, what was scheduled, what was
preempted) and works on its ``Scheduler``'s queues directly; it lives only for one step.
"""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

from scheduler.kv_cache_manager import cdiv
from scheduler.kv_cache_utils import KVCacheBlocks
from scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


class _Verdict(enum.Enum):
    ADMITTED = enum.auto()  # scheduled this step, or its remote KV load started
    SKIP = enum.auto()  # not now; keep scanning the queue
    STOP = enum.auto()  # not now; nobody behind it either (head-of-line)


class StepBuilder:
    def __init__(self, scheduler: Scheduler, token_budget: int, threshold: int) -> None:
        self.s = scheduler
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

    def _preempt(self, victim: Request) -> None:
        n = self.num_scheduled_tokens.pop(victim.request_id, None)
        if n is not None:  # scheduled earlier in this step: give the budget back
            self.token_budget += n
            del self.new_blocks[victim.request_id]
            self.running_reqs.remove(victim)
            # Blocks hashed for this step's tokens will never be computed.
            self.kv.uncache_uncomputed_blocks(victim, victim.num_computed_tokens)
        self.s.preempt(victim)
        self.preempted.append(victim)

    def _clip(self, request: Request, n: int) -> int:
        if 0 < self.threshold < n:
            n = self.threshold
        return min(n, self.token_budget)

    # -- priority preemption at max_num_seqs (DESIGN §4.4) ------------------------------
    def preempt_for_priority(self) -> None:
        """Running slots are full but better-priority requests wait: preempt the worst
        running requests for them, one each, when the newcomer's blocks would then fit.
        Done before anything is scheduled, so no scheduled work is thrown away."""
        s = self.s
        if len(s.running) < self.cfg.max_num_seqs or not s.waiting:
            return
        free = self.kv.block_pool.num_free_blocks
        for candidate in list(itertools.islice(s.waiting, len(s.running))):
            victim = s.pick_victim()
            if candidate.priority >= victim.priority:
                break
            if candidate.num_in_flight_tokens:
                continue
            freed = self.kv.num_blocks_freed_by(victim.request_id)
            need = cdiv(min(candidate.num_tokens, self.cfg.max_model_len), s.block_size)
            if need > free + freed:
                break
            free += freed - need
            self._preempt(victim)

    # -- running -------------------------------------------------------------------------
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
        i = 0
        while i < len(running) and budget > 0:
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
            while True:
                new_blocks = append_slots(request, n, lookahead)
                if new_blocks is not None:
                    break
                victim = s.pick_victim()
                if running.index(victim) < i:
                    i -= 1
                self.token_budget = budget
                self._preempt(victim)  # may give back budget of an already scheduled victim
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
            self.loras = {r.lora_int_id for r in running if r.lora_request is not None}

    # -- waiting -------------------------------------------------------------------------
    def _lora_full(self, request: Request) -> bool:
        lora = self.s.lora_config
        return (
            request.lora_request is not None
            and lora is not None
            and request.lora_int_id not in self.loras
            and len(self.loras) >= lora.max_loras
        )

    def _admit(self, request: Request, n: int, num_computed: int, blocks: KVCacheBlocks) -> None:
        resumed = request.status == RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        request.num_skipped_steps = 0
        self.s.running.append(request)
        (self.resumed_reqs if resumed else self.new_reqs).append(request)
        if request.lora_request is not None:
            self.loras.add(request.lora_int_id)
        self._schedule(request, n, blocks)

    def schedule_holding(self) -> None:
        """Requests that hold blocks go before any that do not (no deadlock on blocks held
        by a request stuck behind one that cannot fit). Promote finished remote loads."""
        s = self.s
        if not s.holding:
            return
        still: list[Request] = []
        for request in s.holding:
            if request.awaiting_remote_kvs:
                if request.request_id not in s.finished_recving_kv_req_ids:
                    still.append(request)
                    continue
                s.promote_loaded_request(request)
            remaining = request.num_tokens - request.num_computed_tokens
            n = self._clip(request, remaining)
            if (
                n <= 0
                or len(s.running) >= self.cfg.max_num_seqs
                or self._lora_full(request)
                or (not self.cfg.enable_chunked_prefill and n < remaining)
            ):
                still.append(request)
                continue
            blocks = self.kv.append_slots(request, n, self.cfg.num_lookahead_slots)
            if blocks is None:
                still.append(request)
                continue
            self._admit(request, n, request.num_computed_tokens, blocks)
        s.holding = still

    def schedule_waiting(self) -> None:
        """Admit queued requests while budget and slots last. One that cannot be admitted
        is skipped so smaller ones behind it run, unless ``strict_fcfs`` or it has been
        passed over ``max_skip_steps`` times (then it blocks the queue, as in vLLM)."""
        s, cfg = self.s, self.cfg
        skipped: list[Request] = []
        while s.waiting and self.token_budget > 0 and len(s.running) < cfg.max_num_seqs:
            request = s.waiting.pop_request()
            verdict = self._try_admit(request)
            if verdict is _Verdict.SKIP:
                skipped.append(request)
            elif verdict is _Verdict.STOP:
                s.waiting.prepend_request(request)
                break
        if skipped:
            s.waiting.prepend_requests(skipped)

    def _cannot_fit(self, request: Request) -> _Verdict:
        if self.cfg.strict_fcfs or request.num_skipped_steps >= self.cfg.max_skip_steps:
            return _Verdict.STOP
        request.num_skipped_steps += 1
        return _Verdict.SKIP

    def _try_admit(self, request: Request) -> _Verdict:
        s, cfg, kv = self.s, self.cfg, self.kv
        if request.num_in_flight_tokens or self._lora_full(request) or request in self.preempted:
            # Stale output still to come / no adapter slot / just preempted for a better one.
            return _Verdict.SKIP
        hit_blocks, num_local = kv.get_computed_blocks(request)
        num_external, load_async = 0, False
        if s.connector is not None:
            matched, load_async = s.connector.get_num_new_matched_tokens(request, num_local)
            if matched is None:
                return _Verdict.SKIP
            num_external = matched
        n = 0
        if not load_async:
            if num_local + num_external >= request.num_tokens:
                # Loaded tokens cover everything: compute the last one here for its logits.
                num_external = request.num_tokens - 1 - num_local
            n = request.num_tokens - num_local - num_external
            if not cfg.enable_chunked_prefill and n > self.token_budget:
                return self._cannot_fit(request)
            n = self._clip(request, n)
        blocks = kv.allocate_slots(
            request,
            n,
            num_new_computed_tokens=num_local,
            new_computed_blocks=hit_blocks,
            num_lookahead_tokens=0 if load_async else cfg.num_lookahead_slots,
            num_external_computed_tokens=num_external,
            delay_cache_blocks=load_async,
            full_sequence_must_fit=cfg.scheduler_reserve_full_isl,
            has_scheduled_reqs=bool(s.running),
        )
        if blocks is None:
            return self._cannot_fit(request)
        if s.connector is not None:
            s.connector.update_state_after_alloc(
                request, kv.get_blocks(request.request_id), num_external
            )
        kv.record_prefix_hit(request, num_local)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_local + num_external
        if load_async:
            request.preempted_before_load = request.status == RequestStatus.PREEMPTED
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.num_computed_tokens = num_local + num_external
            request.num_skipped_steps = 0
            request.awaiting_remote_kvs = True
            s.holding.append(request)
            return _Verdict.ADMITTED
        self._admit(request, n, num_local + num_external, blocks)
        return _Verdict.ADMITTED

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
            resumed_flags.append(False)
            new_token_ids.append(request.all_token_ids[start : start + num_scheduled[req_id]])
            new_block_ids.append([b.block_id for b in blocks] if blocks else None)
            num_computed.append(start)
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
