"""What one ``schedule()`` call has decided so far: the per-step scratch shared by the
running pass (``StepBuilder``) and admission (``Admitter``).

It lives only for one step. Its operations -- clip a request's tokens to the budget, admit
a request, preempt one (undoing its part of the step) -- keep the scratch and the
scheduler's ``SchedulerState`` in agreement.
"""

from __future__ import annotations

from scheduler.kv_cache_utils import KVCacheBlocks
from scheduler.request import Request, RequestStatus
from scheduler.state import SchedulerState


class StepBatch:
    """The token budget left and the requests scheduled or preempted in this step.

    ``num_scheduled_tokens``/``new_blocks`` by request id; ``running_reqs`` (continued),
    ``new_reqs`` and ``resumed_reqs`` (admitted), ``preempted``; ``loras``: the adapters
    that hold a slot in this step. The running pass fills ``running_reqs`` through locals
    of its own and writes ``token_budget`` back before calling anything here.
    """

    def __init__(self, state: SchedulerState, token_budget: int, threshold: int) -> None:
        self.state = state
        self.token_budget = token_budget
        self.threshold = threshold  # long-prefill cap per request, 0 for none
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_blocks: dict[str, KVCacheBlocks] = {}
        self.new_reqs: list[Request] = []
        self.resumed_reqs: list[Request] = []
        self.running_reqs: list[Request] = []
        self.preempted: list[Request] = []
        self.preempted_for_kv = False
        self.loras: set[int] = set()

    def clip(self, n: int, budget: int | None = None) -> int:
        """Apply the long-prefill threshold and the remaining budget (or ``budget``) to
        ``n`` tokens."""
        if 0 < self.threshold < n:
            n = self.threshold
        return min(n, self.token_budget if budget is None else budget)

    def refresh_loras(self) -> None:
        """Recount ``loras`` from the state's running requests (LoRA enabled only)."""
        if self.state.lora_config is not None:
            self.loras = self.state.running_loras()

    def admit(self, request: Request, n: int, num_computed: int, blocks: KVCacheBlocks) -> None:
        """Move an admitted request into the state's ``running`` and schedule ``n`` of its
        tokens: mutates the request's status and counters, ``new_reqs`` or
        ``resumed_reqs``, ``loras`` and the budget."""
        resumed = request.status == RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        request.num_skipped_steps = 0
        self.state.running.append(request)
        (self.resumed_reqs if resumed else self.new_reqs).append(request)
        if request.lora_request is not None:
            self.loras.add(request.lora_int_id)
        self.num_scheduled_tokens[request.request_id] = n
        self.new_blocks[request.request_id] = blocks
        self.token_budget -= n

    def preempt(self, victim: Request) -> None:
        """Preempt ``victim`` (``SchedulerState.preempt``), undoing its part of this step if
        it was already scheduled: its budget comes back and the blocks hashed for this
        step's tokens lose their hash. Adds it to ``preempted``; recounts ``loras``."""
        n = self.num_scheduled_tokens.pop(victim.request_id, None)
        if n is not None:  # scheduled earlier in this step: give the budget back
            self.token_budget += n
            del self.new_blocks[victim.request_id]
            for scheduled in (self.running_reqs, self.new_reqs, self.resumed_reqs):
                if victim in scheduled:
                    scheduled.remove(victim)
                    break
            # Blocks hashed for this step's tokens will never be computed.
            self.state.kv_cache_manager.uncache_uncomputed_blocks(
                victim, victim.num_computed_tokens
            )
        self.state.preempt(victim)
        self.preempted.append(victim)
        self.refresh_loras()
