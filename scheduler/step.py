"""One ``schedule()`` call: the running pass, the waiting passes and the output.

``StepBuilder`` holds the per-step scratch state (budget, what was scheduled, what was
preempted) and works on its ``Scheduler``'s queues directly; it lives only for one step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scheduler.kv_cache_manager import NO_BLOCKS
from scheduler.kv_cache_utils import KVCacheBlocks
from scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler


class _Verdict(enum.Enum):
    ADMITTED = enum.auto()  # scheduled this step, or its remote KV load started
    SKIP = enum.auto()  # not now; keep scanning the queue
    STOP = enum.auto()  # not now; nobody behind it either (head-of-line)


@dataclass
class _Plan:
    """How a waiting request would be admitted in this step."""

    hits: KVCacheBlocks
    num_local: int  # prefix-cache hit, tokens
    num_external: int  # tokens a connector provides
    load_async: bool  # the external tokens arrive later (WAITING_FOR_REMOTE_KVS)
    n: int  # tokens to compute this step


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
            for scheduled in (self.running_reqs, self.new_reqs, self.resumed_reqs):
                if victim in scheduled:
                    scheduled.remove(victim)
                    break
            # Blocks hashed for this step's tokens will never be computed.
            self.kv.uncache_uncomputed_blocks(victim, victim.num_computed_tokens)
        self.s.preempt(victim)
        self.preempted.append(victim)
        if self.s.lora_config is not None:
            self.loras = {r.lora_int_id for r in self.s.running if r.lora_request is not None}

    def _clip(self, request: Request, n: int) -> int:
        if 0 < self.threshold < n:
            n = self.threshold
        return min(n, self.token_budget)

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
            end = computed + n
            if end + lookahead <= request.kv_slots and end < request.kv_hash_boundary:
                new_blocks: KVCacheBlocks | None = NO_BLOCKS  # fits its blocks, fills none
            else:
                new_blocks = None
            while new_blocks is None:
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
        passed over ``max_skip_steps`` times (then it blocks the queue, as in vLLM).

        With the priority policy, a full set of running slots does not end the pass: a
        better-priority request preempts the worst running one (DESIGN §4.4), but only when
        it is sure to be admitted in its place."""
        s, cfg = self.s, self.cfg
        skipped: list[Request] = []
        while s.waiting and self.token_budget > 0:
            if len(s.running) >= cfg.max_num_seqs and not (
                cfg.policy == "priority" and self._make_room_for(s.waiting.peek_request())
            ):
                break
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

    def _plan(self, request: Request, token_budget: int) -> _Plan | None:
        """How ``request`` would be admitted now (prefix hit, external tokens, tokens to
        schedule). No state change. None: the connector asks to wait, or (chunked prefill
        off) the prompt does not fit the budget."""
        hits, num_local = self.kv.get_computed_blocks(request)
        num_external, load_async = 0, False
        if self.s.connector is not None:
            matched, load_async = self.s.connector.get_num_new_matched_tokens(request, num_local)
            if matched is None:
                return None
            num_external = matched
        n = 0
        if not load_async:
            if num_local + num_external >= request.num_tokens:
                # Loaded tokens cover everything: compute the last one here for its logits.
                num_external = request.num_tokens - 1 - num_local
            n = request.num_tokens - num_local - num_external
            if not self.cfg.enable_chunked_prefill and n > token_budget:
                return None
            if 0 < self.threshold < n:
                n = self.threshold
            n = min(n, token_budget)
        return _Plan(hits, num_local, num_external, load_async, n)

    def _allocation_args(self, plan: _Plan) -> dict[str, Any]:
        return {
            "num_new_computed_tokens": plan.num_local,
            "new_computed_blocks": plan.hits,
            "num_lookahead_tokens": 0 if plan.load_async else self.cfg.num_lookahead_slots,
            "num_external_computed_tokens": plan.num_external,
            "full_sequence_must_fit": self.cfg.scheduler_reserve_full_isl,
            "has_scheduled_reqs": bool(self.s.running),
        }

    def _try_admit(self, request: Request) -> _Verdict:
        s, kv = self.s, self.kv
        if request.num_in_flight_tokens or self._lora_full(request) or request in self.preempted:
            # Stale output still to come / no adapter slot / just preempted for a better one.
            return _Verdict.SKIP
        plan = self._plan(request, self.token_budget)
        if plan is None:
            # The connector asks to wait (skip), or the unchunked prompt does not fit.
            return _Verdict.SKIP if self.cfg.enable_chunked_prefill else self._cannot_fit(request)
        blocks = kv.allocate_slots(
            request, plan.n, delay_cache_blocks=plan.load_async, **self._allocation_args(plan)
        )
        if blocks is None:
            return self._cannot_fit(request)
        num_computed = plan.num_local + plan.num_external
        if s.connector is not None:
            s.connector.update_state_after_alloc(
                request, kv.get_blocks(request.request_id), plan.num_external
            )
        kv.record_prefix_hit(request, plan.num_local)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_computed
        if plan.load_async:
            request.preempted_before_load = request.status == RequestStatus.PREEMPTED
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.num_computed_tokens = num_computed
            request.num_skipped_steps = 0
            request.awaiting_remote_kvs = True
            s.holding.append(request)
            return _Verdict.ADMITTED
        self._admit(request, plan.n, num_computed, blocks)
        return _Verdict.ADMITTED

    def _make_room_for(self, candidate: Request) -> bool:
        """Preempt the worst running request for ``candidate`` if the candidate has strictly
        better priority and would certainly be admitted in its place: adapter slot, budget,
        blocks (incl. watermark and blocks the running pass took) checked as admission
        checks them, with the victim's budget and blocks given back."""
        s, kv = self.s, self.kv
        # Never a request admitted in this step (e.g. one whose remote KV just arrived):
        # that would throw away the work that admitted it.
        admitted = {id(r) for r in self.new_reqs} | {id(r) for r in self.resumed_reqs}
        victims = [r for r in s.running if id(r) not in admitted]
        if not victims:
            return False
        victim = max(victims, key=lambda r: (r.priority, r.arrival_time))
        if candidate.priority >= victim.priority:
            return False
        if candidate.num_in_flight_tokens or candidate in self.preempted:
            return False
        if not kv.uncomputed_blocks_unshared(victim, victim.num_computed_tokens):
            return False  # someone hit blocks it fills this step: they must be computed
        lora = s.lora_config
        if lora is not None and candidate.lora_request is not None:
            others = {r.lora_int_id for r in s.running if r is not victim and r.lora_request}
            if candidate.lora_int_id not in others and len(others) >= lora.max_loras:
                return False
        budget = self.token_budget + self.num_scheduled_tokens.get(victim.request_id, 0)
        plan = self._plan(candidate, budget)
        if plan is None or not kv.can_allocate(
            candidate, plan.n, freeing=victim.request_id, **self._allocation_args(plan)
        ):
            return False
        self._preempt(victim)
        return True

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
