"""The waiting passes of one step: requests that hold blocks first, then the waiting queue.

Admission is where Tandem departs most from vLLM (DESIGN §4): a request that cannot be
admitted is skipped rather than stopping the queue (with an aging bound), a better-priority
request may preempt at ``max_num_seqs``, and remote-KV loads start without a running slot.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scheduler.kv_cache_utils import KVCacheBlocks
from scheduler.queues import priority_key
from scheduler.request import Request, RequestStatus

if TYPE_CHECKING:
    from scheduler.step import StepBuilder


class Verdict(enum.Enum):
    ADMITTED = enum.auto()  # scheduled this step, or its remote KV load started
    SKIP = enum.auto()  # not now; keep scanning the queue
    STOP = enum.auto()  # not now; nobody behind it either (head-of-line)


class _NoFit(enum.Enum):
    CONNECTOR_WAIT = enum.auto()  # the connector asks to be asked again later
    BUDGET = enum.auto()  # chunked prefill off and the prompt exceeds the budget


@dataclass
class Plan:
    """How a waiting request would be admitted in this step."""

    hits: KVCacheBlocks
    num_local: int  # prefix-cache hit, tokens
    num_external: int  # tokens a connector provides
    load_async: bool  # the external tokens arrive later (WAITING_FOR_REMOTE_KVS)
    n: int  # tokens to compute this step


class Admitter:
    """Admits waiting requests into one step (``StepBuilder``)."""

    def __init__(self, step: StepBuilder) -> None:
        self.step = step
        self.s = step.s
        self.cfg = step.cfg
        self.kv = step.kv

    # -- holding: remote KV loaded (or loading) ------------------------------------------
    def schedule_holding(self) -> None:
        """Requests that hold blocks go before any that do not, so blocks are never held by
        a request stuck behind one that cannot fit. Promote finished remote loads."""
        s = self.s
        if not s.holding:
            return
        still: list[Request] = []
        for request in s.holding:
            if request.awaiting_remote_kvs:
                if request.request_id not in s.remote_kv.finished_recving:
                    still.append(request)
                    continue
                s.remote_kv.promote(request)
            if not self._admit_holding(request):
                still.append(request)
        s.holding = still

    def _admit_holding(self, request: Request) -> bool:
        step, cfg = self.step, self.cfg
        remaining = request.num_tokens - request.num_computed_tokens
        n = step.clip(remaining)
        if n <= 0 or (not cfg.enable_chunked_prefill and n < remaining):
            return False
        if self._lora_full(request):
            return False
        if len(self.s.running) >= cfg.max_num_seqs and not (
            cfg.policy == "priority" and self._make_room_for(request, self._holding_plan(request))
        ):
            return False
        # No watermark: the watermark keeps room for running requests when admitting new
        # work, and this request already holds its prompt's blocks.
        blocks = self.kv.allocate_slots(
            request, n, num_lookahead_tokens=cfg.num_lookahead_slots, has_scheduled_reqs=False
        )
        if blocks is None:
            return False
        step.admit(request, n, request.num_computed_tokens, blocks)
        return True

    def _holding_plan(self, request: Request) -> Plan:
        n = self.step.clip(request.num_tokens - request.num_computed_tokens)
        return Plan(KVCacheBlocks(), 0, 0, False, n)

    def release_if_deadlocked(self) -> None:
        """Nothing runs, yet loaded requests cannot get the blocks to continue (they hold
        blocks and are never preempted): send the newest back to the waiting queue. Its
        blocks are hashed, so it recomputes little when the cache still has them."""
        s = self.s
        if s.running or self.step.num_scheduled_tokens:
            return
        loaded = [r for r in s.holding if not r.awaiting_remote_kvs]
        if loaded:
            victim = loaded[-1]
            s.holding.remove(victim)
            s.release_to_waiting(victim, preemption=True)

    # -- the waiting queue ---------------------------------------------------------------
    def schedule_waiting(self) -> None:
        """Admit queued requests while budget lasts. One that cannot be admitted is skipped
        so smaller ones behind it run, unless ``strict_fcfs`` or it has been passed over
        ``max_skip_steps`` times (then it blocks the queue, as in vLLM)."""
        s = self.s
        skipped: list[Request] = []
        while s.waiting and self.step.token_budget > 0:
            request = s.waiting.pop_request()
            verdict = self._try_admit(request)
            if verdict is Verdict.SKIP:
                skipped.append(request)
            elif verdict is Verdict.STOP:
                s.waiting.prepend_request(request)
                break
        if skipped:
            s.waiting.prepend_requests(skipped)

    def _skip_or_stop(self, request: Request, strict: bool) -> Verdict:
        """Skip with aging: after ``max_skip_steps`` skipped steps the request blocks the
        queue, so it cannot starve."""
        if strict or request.num_skipped_steps >= self.cfg.max_skip_steps:
            return Verdict.STOP
        request.num_skipped_steps += 1
        return Verdict.SKIP

    def _try_admit(self, request: Request) -> Verdict:
        s, cfg, kv, step = self.s, self.cfg, self.kv, self.step
        if request.num_in_flight_tokens or request in step.preempted:
            return Verdict.SKIP  # stale output still to come / just preempted for another
        if (
            len(s.running) >= cfg.max_num_seqs
            and s.connector is None  # no remote load could start without a slot
            and not (
                cfg.policy == "priority" and request.priority < max(r.priority for r in s.running)
            )
        ):
            return Verdict.STOP  # decided without planning (prefix look-ups cost)
        plan = self.plan(request, step.token_budget)
        if plan is _NoFit.CONNECTOR_WAIT:
            return Verdict.SKIP
        if plan is _NoFit.BUDGET:
            return self._skip_or_stop(request, cfg.strict_fcfs)
        assert isinstance(plan, Plan)
        # A remote load needs neither a running slot nor an adapter slot; computing does.
        if not plan.load_async:
            if len(s.running) >= cfg.max_num_seqs:
                if not (cfg.policy == "priority" and self._make_room_for(request, plan)):
                    return Verdict.STOP
            elif self._lora_full(request):
                # vLLM skips with no bound; the aging bound keeps a rare adapter from starving.
                return self._skip_or_stop(request, strict=False)
        blocks = kv.allocate_slots(
            request,
            plan.n,
            # Loaded blocks are hashed only once the load is known good.
            delay_cache_blocks=plan.num_external > 0,
            **self._allocation_args(plan),
        )
        if blocks is None:
            return self._skip_or_stop(request, cfg.strict_fcfs)
        num_computed = plan.num_local + plan.num_external
        if s.connector is not None:
            s.connector.update_state_after_alloc(
                request, kv.get_blocks(request.request_id), plan.num_external
            )
        kv.record_prefix_hit(request, plan.num_local)
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_computed
        request.num_skipped_steps = 0
        if plan.load_async:
            request.preempted_before_load = request.status == RequestStatus.PREEMPTED
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            request.num_computed_tokens = num_computed
            request.awaiting_remote_kvs = True
            s.holding.append(request)
        else:
            if plan.num_external > 0:  # loaded inside this step: confirmed by its output
                s.remote_kv.sync_loading.add(request.request_id)
            step.admit(request, plan.n, num_computed, blocks)
        return Verdict.ADMITTED

    def plan(self, request: Request, token_budget: int) -> Plan | _NoFit:
        """How ``request`` would be admitted now: prefix hit, external tokens, tokens to
        compute. No change to the cache or the queues."""
        hits, num_local = self.kv.get_computed_blocks(request)
        num_external, load_async = 0, False
        if self.s.connector is not None:
            matched, load_async = self.s.connector.get_num_new_matched_tokens(request, num_local)
            if matched is None:
                return _NoFit.CONNECTOR_WAIT
            # Never more than the request has, whatever the connector claims.
            num_external = max(0, min(matched, request.num_tokens - num_local))
            load_async = load_async and num_external > 0
        n = 0
        if not load_async:
            if num_local + num_external >= request.num_tokens:
                # Loaded tokens cover everything: compute the last one here for its logits.
                num_external = request.num_tokens - 1 - num_local
            n = request.num_tokens - num_local - num_external
            if not self.cfg.enable_chunked_prefill and n > token_budget:
                return _NoFit.BUDGET
            n = min(self.step.clip(n), token_budget)
        return Plan(hits, num_local, num_external, load_async, n)

    def _allocation_args(self, plan: Plan) -> dict[str, Any]:
        return {
            "num_new_computed_tokens": plan.num_local,
            "new_computed_blocks": plan.hits,
            "num_lookahead_tokens": self.cfg.num_lookahead_slots,
            "num_external_computed_tokens": plan.num_external,
            "full_sequence_must_fit": self.cfg.scheduler_reserve_full_isl,
            "has_scheduled_reqs": bool(self.s.running),
        }

    # -- LoRA and priority ---------------------------------------------------------------
    def _lora_full(self, request: Request) -> bool:
        lora = self.s.lora_config
        return (
            request.lora_request is not None
            and lora is not None
            and request.lora_int_id not in self.step.loras
            and len(self.step.loras) >= lora.max_loras
        )

    def _make_room_for(self, candidate: Request, plan: Plan) -> bool:
        """At ``max_num_seqs``, preempt the worst running request for ``candidate`` if the
        candidate has strictly better priority and will certainly be admitted in its place:
        adapter slot, budget and blocks (incl. watermark, full-prompt fit and the blocks the
        running pass took) checked as admission checks them, with the victim's budget and
        blocks given back (DESIGN §4.4)."""
        s, kv, step = self.s, self.kv, self.step
        if candidate.num_in_flight_tokens or candidate in step.preempted:
            return False
        # Never a request admitted in this step (one whose remote KV just arrived, say):
        # that would throw away the work that admitted it.
        admitted = {id(r) for r in step.new_reqs} | {id(r) for r in step.resumed_reqs}
        victims = [r for r in s.running if id(r) not in admitted]
        if not victims:
            return False
        victim = max(victims, key=priority_key)
        if candidate.priority >= victim.priority:
            return False
        # Blocks the victim fills this step lose their hash when it is preempted: a plan
        # that counts them as hits, or another request that already hit them, would break.
        uncomputed = kv.uncomputed_blocks(victim)
        if any(b.ref_cnt > 1 for b in uncomputed):
            return False
        if plan.hits.blocks and {id(b) for b in uncomputed} & {id(b) for b in plan.hits.blocks}:
            return False
        lora = s.lora_config
        if lora is not None and candidate.lora_request is not None:
            others = {r.lora_int_id for r in s.running if r is not victim and r.lora_request}
            if candidate.lora_int_id not in others and len(others) >= lora.max_loras:
                return False
        budget = step.token_budget + step.num_scheduled_tokens.get(victim.request_id, 0)
        if candidate in s.holding:
            fits = kv.can_allocate(
                candidate,
                plan.n,
                num_lookahead_tokens=self.cfg.num_lookahead_slots,
                has_scheduled_reqs=False,
                freeing=victim.request_id,
            )
        else:
            replan = self.plan(candidate, budget)
            fits = isinstance(replan, Plan) and kv.can_allocate(
                candidate, replan.n, freeing=victim.request_id, **self._allocation_args(replan)
            )
        if not fits:
            return False
        step.preempt(victim)
        return True
