"""One ``schedule()`` call: the running pass, the waiting passes and the output.

``StepBuilder`` drives one step over a ``SchedulerState``: it gives running requests their
next tokens, hands the rest of the budget to admission (``Admitter``), and packages the
result. What the step has decided so far lives in its ``StepBatch``; both live only for
one step.
"""

from __future__ import annotations

from scheduler.admission import Admitter
from scheduler.batch import StepBatch
from scheduler.kv_cache_manager import NO_BLOCKS
from scheduler.kv_cache_utils import KVCacheBlocks
from scheduler.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.queues import priority_key
from scheduler.remote_kv import RemoteKV
from scheduler.state import SchedulerState


class StepBuilder:
    """Builds one step's ``SchedulerOutput``. Mutates the state's queues and block tables
    (admissions, preemptions) and, in ``commit``, the scheduled requests' counters."""

    def __init__(
        self, state: SchedulerState, remote_kv: RemoteKV, max_running_reqs: int | None = None
    ) -> None:
        cfg = state.scheduler_config
        num_present = len(state.running) + len(state.waiting) + len(state.holding)
        # Long prefills are capped only when another request could use the budget.
        threshold = cfg.long_prefill_token_threshold if num_present > 1 else 0
        self.state = state
        self.remote_kv = remote_kv
        self.max_running_reqs = max_running_reqs
        self.batch = StepBatch(state, cfg.max_num_batched_tokens, threshold)

    @property
    def preempted_for_kv(self) -> bool:
        """The running pass preempted a request for KV space."""
        return self.batch.preempted_for_kv

    # -- running -------------------------------------------------------------------------
    def _release_loaded(self) -> bool:
        """KV is short: a request whose remote KV has arrived but that waits for a running
        slot gives its blocks back before any running request is preempted (its blocks stay
        hashed, so it may find them again). Under ``priority`` only the worst such request,
        and only if it ranks below the running request that would be preempted instead (a
        better one released for a worse running request waited, its KV lost, until that one
        finished). Mutates the state's ``holding`` and ``waiting``. True if one was released."""
        state = self.state
        loaded = [r for r in state.holding if not r.awaiting_remote_kvs]
        if not loaded:
            return False
        if state.scheduler_config.policy == "priority":
            request = max(loaded, key=priority_key)
            if priority_key(request) < priority_key(state.pick_victim()):
                return False
        else:
            request = loaded[-1]
        state.holding.remove(request)
        state.release_to_waiting(request, preemption=True)
        self.batch.preempted_for_kv = True  # (as after a preemption: the step admits nobody)
        return True

    def schedule_running(self) -> None:
        """Give each running request its next tokens, preempting on KV pressure. Mutates the
        batch, the state's ``running`` and ``waiting`` (preemptions) and block tables.

        The hot loop of the scheduler (once per running request per step): locals only."""
        state, batch = self.state, self.batch
        cfg = state.scheduler_config
        append_slots = state.kv_cache_manager.append_slots
        async_scheduling = cfg.async_scheduling
        lookahead = cfg.num_lookahead_slots
        max_computed = cfg.max_model_len - 1  # the last position never needs computing
        threshold = batch.threshold
        running = state.running
        num_scheduled = batch.num_scheduled_tokens
        new_blocks_of = batch.new_blocks
        running_reqs = batch.running_reqs
        budget = batch.token_budget
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
                if self._release_loaded():
                    continue
                victim = state.pick_victim()
                if running.index(victim) < i:
                    i -= 1
                batch.token_budget = budget
                batch.preempt(victim)  # may give back budget of an already scheduled victim
                budget = batch.token_budget
                batch.preempted_for_kv = True
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
        batch.token_budget = budget
        if state.lora_config is not None:  # adapters of every running request hold a slot
            batch.loras = state.running_loras()

    def schedule_waiting(self) -> None:
        """Admission: requests holding blocks, then the waiting queue (see admission.py)."""
        admitter = Admitter(self.state, self.remote_kv, self.batch)
        admitter.schedule_holding()
        admitter.schedule_waiting()
        admitter.release_if_deadlocked()

    # -- output --------------------------------------------------------------------------
    def make_output(self) -> SchedulerOutput:
        """Package the step for the workers (with the connector's metadata). Runs before
        ``num_computed_tokens`` advances. Takes the state's ``finished_req_ids``."""
        state, batch = self.state, self.batch
        kv = state.kv_cache_manager
        new_reqs = [
            NewRequestData.from_request(r, kv.get_block_ids(r.request_id)) for r in batch.new_reqs
        ]
        cached = CachedRequestData()
        req_ids, resumed_flags = cached.req_ids, cached.resumed_from_preemption
        new_token_ids, new_block_ids = cached.new_token_ids, cached.new_block_ids
        num_computed = cached.num_computed_tokens
        num_scheduled = batch.num_scheduled_tokens
        new_blocks_of = batch.new_blocks
        for request in batch.running_reqs:
            req_id = request.request_id
            start = request.num_computed_tokens
            blocks = new_blocks_of[req_id].blocks
            req_ids.append(req_id)
            new_token_ids.append(request.all_token_ids[start : start + num_scheduled[req_id]])
            new_block_ids.append([b.block_id for b in blocks] if blocks else None)
            num_computed.append(start)
        resumed_flags.extend([False] * len(req_ids))
        for request in batch.resumed_reqs:
            req_id = request.request_id
            start = request.num_computed_tokens
            req_ids.append(req_id)
            resumed_flags.append(True)
            new_token_ids.append(request.all_token_ids[start : start + num_scheduled[req_id]])
            new_block_ids.append(kv.get_block_ids(req_id))
            num_computed.append(start)
            cached.resumed_token_ids[req_id] = list(request.all_token_ids)
        finished, state.finished_req_ids = state.finished_req_ids, set()
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            preempted_req_ids={r.request_id for r in batch.preempted},
            finished_req_ids=finished,
            step_id=state.num_steps,
        )
        if state.connector is not None:
            out.kv_connector_metadata = state.connector.build_connector_meta(out)
        return out

    def commit(self, out: SchedulerOutput) -> None:
        """The step is out: count its tokens as computed and in flight (optimistically;
        outputs arrive later) and the step as taken. Mutates the scheduled requests'
        counters and the state's ``num_steps``."""
        state = self.state
        async_scheduling = state.scheduler_config.async_scheduling
        requests = state.requests
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
        state.num_steps += 1
