"""The waiting passes of one step: requests that hold blocks first, then the waiting queue.

Admission is where Tandem departs most from vLLM (DESIGN §4): a request that cannot be
admitted is skipped rather than stopping the queue (with an aging bound), a better-priority
request may preempt at ``max_num_seqs``, and remote-KV loads start without a running slot.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from scheduler.batch import StepBatch
from scheduler.kv_cache_utils import KVCacheBlocks
from scheduler.queues import priority_key
from scheduler.remote_kv import RemoteKV
from scheduler.request import Request, RequestStatus
from scheduler.state import SchedulerState


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
    """Admits waiting requests into one step's ``batch``, after the running pass.

    Mutates the state's ``holding``, ``waiting`` and ``running`` queues and block tables,
    the batch (admissions, priority preemptions) and ``remote_kv`` (promotions, loads).
    """

    def __init__(self, state: SchedulerState, remote_kv: RemoteKV, batch: StepBatch) -> None:
        self.state = state
        self.remote_kv = remote_kv
        self.batch = batch
        self.cfg = state.scheduler_config
        self.kv = state.kv_cache_manager
        self.queue_blocked = False  # this step: a loaded request blocks the waiting queue
        self._blocker: Request | None = None  # ... the best-ranked of those that block it

    # -- holding: remote KV loaded (or loading) ------------------------------------------
    def schedule_holding(self) -> None:
        """Requests that hold blocks go before any that do not, so blocks are never held by
        a request stuck behind one that cannot fit. Promote finished remote loads. Mutates
        ``holding`` (replaced by the requests left in it) and, for each admitted, ``running``
        and the batch."""
        state = self.state
        self.queue_blocked, self._blocker = False, None
        if not state.holding:
            return
        still: list[Request] = []
        # Best first under the priority policy (as vLLM's waiting queue, which holds them):
        # in the order their loads began, a worse one took the last slot and a better one
        # then preempted a running request that ranks above it.
        holding = state.holding
        if self.cfg.policy == "priority":
            holding = sorted(holding, key=priority_key)
        for request in holding:
            if request.awaiting_remote_kvs:
                if request.request_id not in self.remote_kv.finished_recving:
                    still.append(request)
                    continue
                self.remote_kv.promote(request)
            if not self._admit_holding(request):
                still.append(request)
        state.holding = still

    def _admit_holding(self, request: Request) -> bool:
        batch, cfg = self.batch, self.cfg
        remaining = request.num_tokens - request.num_computed_tokens
        n = batch.clip(remaining)
        if n <= 0:
            return False
        if not cfg.enable_chunked_prefill and n < remaining:
            # Its rest of the prompt must run whole, and the decodes leave too little budget:
            # the waiting queue stops (vLLM's break), or, unless ``strict_fcfs``, once it has
            # been passed over its bound. Otherwise new requests kept enough decodes running
            # that it never got the budget, holding its loaded blocks all along.
            if cfg.strict_fcfs or self._skip_or_stop(request, False) is Verdict.STOP:
                self._block_queue(request)
            return False
        # As for a waiting request (``_try_admit``): room made by priority first; an adapter
        # slot that stays taken ages the request until it blocks the waiting queue (the
        # requests of the adapter that holds the slot kept coming: it starved, holding its
        # blocks).
        if len(self.state.running) >= cfg.max_num_seqs:
            if not (
                cfg.policy == "priority"
                and self._make_room_for(request, self._holding_plan(request))
            ):
                return False
        elif self._lora_full(request):
            if not cfg.strict_fcfs and self._skip_or_stop(request, False) is Verdict.STOP:
                self._block_queue(request)
            return False
        # No watermark: the watermark keeps room for running requests when admitting new
        # work, and this request already holds its prompt's blocks.
        blocks = self.kv.allocate_slots(
            request, n, num_lookahead_tokens=cfg.num_lookahead_slots, has_scheduled_reqs=False
        )
        if blocks is None:
            return False
        request.num_skipped_steps = 0
        batch.admit(request, n, request.num_computed_tokens, blocks)
        return True

    def _block_queue(self, request: Request) -> None:
        """Waiting requests that rank after ``request`` wait for it (it holds its blocks):
        later arrivals, or under ``priority`` worse-ranked ones. Better-ranked ones go
        first, as they would in vLLM's one ordered queue."""
        if self._blocker is None or self._rank(request) < self._rank(self._blocker):
            self._blocker = request
        self.queue_blocked = True

    def _rank(self, request: Request) -> tuple[float, ...]:
        if self.cfg.policy == "priority":
            return (request.priority, request.arrival_time)
        return (request.arrival_time,)

    def _holding_plan(self, request: Request) -> Plan:
        n = self.batch.clip(request.num_tokens - request.num_computed_tokens)
        return Plan(KVCacheBlocks(), 0, 0, False, n)

    def release_if_deadlocked(self) -> None:
        """Nothing runs, yet loaded requests cannot get the blocks to continue (they hold
        blocks and are never preempted): send the newest back to the waiting queue. Its
        blocks are hashed, so it recomputes little when the cache still has them. Mutates
        ``holding``, ``waiting`` and the block tables."""
        state = self.state
        if state.running or self.batch.num_scheduled_tokens:
            return
        loaded = [r for r in state.holding if not r.awaiting_remote_kvs]
        if loaded:
            victim = loaded[-1]
            state.holding.remove(victim)
            state.release_to_waiting(victim, preemption=True)

    # -- the waiting queue ---------------------------------------------------------------
    def schedule_waiting(self) -> None:
        """Admit queued requests while budget lasts. One that cannot be admitted is skipped
        so smaller ones behind it run, unless ``strict_fcfs`` or it has been passed over
        ``max_skip_steps`` times (then it blocks the queue, as in vLLM). Mutates ``waiting``,
        ``running``, ``holding`` (async loads started), block tables and the batch."""
        state = self.state
        # A loaded request that cannot run (an adapter slot, the budget) blocks the ones that
        # rank after it (``_block_queue``).
        blocker = self._blocker if self.queue_blocked else None
        skipped: list[Request] = []
        while state.waiting and self.batch.token_budget > 0:
            if blocker is not None and self._rank(state.waiting.peek_request()) >= self._rank(
                blocker
            ):
                break
            request = state.waiting.pop_request()
            verdict = self._try_admit(request)
            if verdict is Verdict.SKIP:
                skipped.append(request)
            elif verdict is Verdict.STOP:
                state.waiting.prepend_request(request)
                break
        if skipped:
            state.waiting.prepend_requests(skipped)

    def _skip_or_stop(self, request: Request, strict: bool) -> Verdict:
        """Skip with aging: after ``max_skip_steps`` skipped steps the request blocks the
        queue, so it cannot starve."""
        if strict or request.num_skipped_steps >= self.cfg.max_skip_steps:
            return Verdict.STOP
        request.num_skipped_steps += 1
        return Verdict.SKIP

    def _try_admit(self, request: Request) -> Verdict:
        state, cfg, kv, batch = self.state, self.cfg, self.kv, self.batch
        if request.num_in_flight_tokens or request in batch.preempted:
            return Verdict.SKIP  # stale output still to come / just preempted for another
        if (
            len(state.running) >= cfg.max_num_seqs
            and state.connector is None  # no remote load could start without a slot
            and not (
                cfg.policy == "priority"
                and request.priority < max(r.priority for r in state.running)
            )
        ):
            return Verdict.STOP  # decided without planning (prefix look-ups cost)
        plan = self.plan(request, batch.token_budget)
        if plan is _NoFit.CONNECTOR_WAIT:
            return Verdict.SKIP
        over_budget = plan is _NoFit.BUDGET
        if over_budget and len(state.running) >= cfg.max_num_seqs:
            # Chunked prefill off: the prompt may fit with a priority victim's budget given
            # back (``_make_room_for`` below preempts it only if it then does).
            given_back = self._victim_budget(request)
            if given_back:
                plan = self.plan(request, batch.token_budget + given_back)
        if not isinstance(plan, Plan):
            return self._skip_or_stop(request, cfg.strict_fcfs)
        # A remote load needs neither a running slot nor an adapter slot; computing does.
        if not plan.load_async:
            if len(state.running) >= cfg.max_num_seqs:
                if not (cfg.policy == "priority" and self._make_room_for(request, plan)):
                    # (over the budget without the victim: skipped with aging, as before)
                    return (
                        self._skip_or_stop(request, cfg.strict_fcfs)
                        if over_budget
                        else (Verdict.STOP)
                    )
            elif self._lora_full(request):
                # vLLM skips with no bound (so does ``strict_fcfs``, vLLM's behaviour); the
                # aging bound keeps a rare adapter from starving.
                return Verdict.SKIP if cfg.strict_fcfs else self._skip_or_stop(request, False)
        blocks = kv.allocate_slots(
            request,
            plan.n,
            # Loaded blocks are hashed only once the load is known good.
            delay_cache_blocks=plan.num_external > 0,
            # A remote load holds its blocks until it lands and cannot be preempted: it
            # leaves the running prefills what they still need (vLLM's reserved blocks).
            reserved_blocks=self._prefills_still_need() if plan.load_async else 0,
            **self._allocation_args(plan),
        )
        if blocks is None:
            return self._skip_or_stop(request, cfg.strict_fcfs)
        num_computed = plan.num_local + plan.num_external
        if state.connector is not None:
            state.connector.update_state_after_alloc(
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
            state.holding.append(request)
        else:
            if plan.num_external > 0:  # loaded inside this step: confirmed by its output
                self.remote_kv.sync_loading.add(request.request_id)
            batch.admit(request, plan.n, num_computed, blocks)
        return Verdict.ADMITTED

    def plan(self, request: Request, token_budget: int) -> Plan | _NoFit:
        """How ``request`` would be admitted now: prefix hit, external tokens, tokens to
        compute. No change to the cache or the queues."""
        hits, num_local = self.kv.get_computed_blocks(request)
        num_external, load_async = 0, False
        # A request that wants its prompt's logprobs computes every prompt token: neither the
        # prefix cache (``get_computed_blocks``) nor a connector's KV (vLLM: no external
        # tokens when it skips reading the cache) -- loaded positions had none.
        if self.state.connector is not None and request.prompt_logprobs is None:
            matched, load_async = self.state.connector.get_num_new_matched_tokens(
                request, num_local
            )
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
            if self.cfg.enable_chunked_prefill:
                n = min(self.batch.clip(n), token_budget)
            else:  # the whole prompt, within the budget given (a priority victim's, say)
                n = self.batch.clip(n, token_budget)
        return Plan(hits, num_local, num_external, load_async, n)

    def _prefills_still_need(self) -> int:
        """Blocks the running requests still computing what they hold (a prompt, or a
        prompt and outputs: resumed after a preemption, or moved here) need to finish it."""
        kv = self.kv
        bs, max_len = kv.block_size, kv.max_model_len
        need = 0
        for running in self.state.running:
            computed = running.num_computed_tokens
            if computed < running.num_prompt_tokens or computed < running.num_tokens - 1:
                tokens = min(running.num_tokens, max_len)
                held = len(kv.req_to_blocks.get(running.request_id, ()))
                need += max(0, -(-tokens // bs) - held)
        return need

    def _allocation_args(self, plan: Plan) -> dict[str, Any]:
        return {
            "num_new_computed_tokens": plan.num_local,
            "new_computed_blocks": plan.hits,
            # (none for a remote load: it computes nothing until it lands -- vLLM's 0)
            "num_lookahead_tokens": 0 if plan.load_async else self.cfg.num_lookahead_slots,
            "num_external_computed_tokens": plan.num_external,
            "full_sequence_must_fit": self.cfg.scheduler_reserve_full_isl,
            "has_scheduled_reqs": bool(self.state.running),
        }

    # -- LoRA and priority ---------------------------------------------------------------
    def _lora_full(self, request: Request) -> bool:
        lora = self.state.lora_config
        return (
            request.lora_request is not None
            and lora is not None
            and request.lora_int_id not in self.batch.loras
            and len(self.batch.loras) >= lora.max_loras
        )

    def _victims(self) -> list[Request]:
        # Never a request admitted in this step (one whose remote KV just arrived, say):
        # that would throw away the work that admitted it.
        batch = self.batch
        admitted = {id(r) for r in batch.new_reqs} | {id(r) for r in batch.resumed_reqs}
        return [r for r in self.state.running if id(r) not in admitted]

    def _victim_budget(self, candidate: Request) -> int:
        """The tokens of this step the running request a priority preemption for
        ``candidate`` would take (``_make_room_for``) has scheduled; 0 for none."""
        if self.cfg.policy != "priority":
            return 0
        victims = self._victims()
        if not victims:
            return 0
        victim = max(victims, key=priority_key)
        if candidate.priority >= victim.priority:
            return 0
        return self.batch.num_scheduled_tokens.get(victim.request_id, 0)

    def _make_room_for(self, candidate: Request, plan: Plan) -> bool:
        """At ``max_num_seqs``, preempt the worst running request for ``candidate`` if the
        candidate has strictly better priority and will certainly be admitted in its place:
        adapter slot, budget and blocks (incl. watermark, full-prompt fit and the blocks the
        running pass took) checked as admission checks them, with the victim's budget and
        blocks given back (DESIGN §4.4)."""
        state, kv, batch = self.state, self.kv, self.batch
        if candidate.num_in_flight_tokens or candidate in batch.preempted:
            return False
        victims = self._victims()
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
        lora = state.lora_config
        if lora is not None and candidate.lora_request is not None:
            others = {r.lora_int_id for r in state.running if r is not victim and r.lora_request}
            if candidate.lora_int_id not in others and len(others) >= lora.max_loras:
                return False
        budget = batch.token_budget + batch.num_scheduled_tokens.get(victim.request_id, 0)
        if candidate in state.holding:
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
        batch.preempt(victim)
        return True
