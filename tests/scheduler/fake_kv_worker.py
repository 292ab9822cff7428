"""A fake worker for scheduler tests that checks the KV content of every slot it reads.

It mirrors each request's block table from the ``SchedulerOutput``s alone (new requests in
full, appended blocks, a resumed request's whole new table) and "computes" KV: the slot of
position ``p`` gets the identity of the token prefix ``[0, p]`` under the request's adapter and
cache salt. A step writes all its KV first, then checks every slot each scheduled request
attends to (a real forward pass writes the paged cache before attention reads it). What each
request does -- its samples, its role towards the KV connector, whether its load fails -- is
given by a ``ReqSpec``; ``test_scheduler_kv_simulation.py`` drives it with random traces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from scheduler import (
    KVCacheBlocks,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    SchedulerConnector,
    SchedulerOutput,
)
from tests.scheduler.helpers import EOS

BLOCK_SIZE = 4
BOGUS = 777  # what a step samples from bad KV; the scheduler must drop it

Slot = tuple[int, int]  # (block id, offset)
Content = tuple[str | None, str | None, int, int]  # adapter, salt, position, prefix hash
BAD: Content = ("<failed load>", None, -1, 0)
Role = Literal["local", "load", "send"]  # "send": prefill side, keeps blocks for the decode side


@dataclass(frozen=True)
class ReqSpec:
    """One request of a trace: what it is, when it comes and goes, and what the worker and the
    connector do for it."""

    req_id: str
    prompt: list[int]
    outputs: list[int]  # outputs it arrives with
    arrival: int
    max_tokens: int | None
    eos_at: int | None  # output index sampled as EOS
    abort_at: int | None
    priority: int
    adapter: int | None
    salt: str | None
    role: Role
    remote_tokens: int = 0  # load: tokens the connector offers (may exceed the request)
    sync_load: bool = False  # load inside the step, failure reported with the step
    load_delay: int = 0  # steps until an async load or a send is reported
    load_fails: bool = False
    ready_at: int = 0  # load: the connector answers "ask again later" before this step

    def expected_token(self, index: int) -> int:
        return EOS if index == self.eos_at else 1000 + index


def prefix_contents(spec: ReqSpec, tokens: list[int]) -> list[Content]:
    """The KV identity of every position of ``tokens`` (a chained hash of the prefix)."""
    adapter = f"adapter-{spec.adapter}" if spec.adapter else None
    contents, h = [], 0
    for p, token in enumerate(tokens):
        h = hash((h, token))
        contents.append((adapter, spec.salt, p, h))
    return contents


@dataclass(frozen=True)
class Load:
    block_ids: list[int]  # the request's whole table
    num_tokens: int  # loaded into the positions just before its first computed one
    sync: bool


class SimConnector(SchedulerConnector):
    """Loads for "load" requests, delayed frees for "send" requests; ``now`` is the step."""

    def __init__(self, specs: dict[str, ReqSpec]) -> None:
        self.specs = specs
        self.now = 0
        self.pending: dict[str, Load] = {}
        self.finished: set[str] = set()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        spec = self.specs[request.request_id]
        if spec.role != "load" or not request.do_remote_prefill:
            return 0, False
        if self.now < spec.ready_at:
            return None, False
        count = max(spec.remote_tokens - num_computed_tokens, 0)
        return count, count > 0 and not spec.sync_load

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            sync = self.specs[request.request_id].sync_load
            self.pending[request.request_id] = Load(
                blocks.get_block_ids(), num_external_tokens, sync
            )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> dict[str, Load]:
        meta, self.pending = self.pending, {}
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert request.request_id not in self.finished, f"{request} finished twice"
        self.finished.add(request.request_id)
        finished_ok = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
        if self.specs[request.request_id].role != "send" or request.status not in finished_ok:
            return False, None
        return True, {"remote_block_ids": block_ids, "remote_num_tokens": request.num_prompt_tokens}


@dataclass
class Mirror:
    """The worker's state of one request."""

    spec: ReqSpec
    tokens: list[int]
    blocks: list[int]
    poisoned: bool = False  # its KV came from a failed load: reads are not checked

    def slot(self, position: int) -> Slot:
        if position >= len(self.blocks) * BLOCK_SIZE:  # (no assert: hot, and pytest rewrites)
            raise AssertionError(f"{self.spec.req_id}: no block for position {position}")
        return self.blocks[position // BLOCK_SIZE], position % BLOCK_SIZE


@dataclass
class Worker:
    """Block tables and KV cache as the model runner sees them; ``execute`` runs one step."""

    specs: dict[str, ReqSpec]
    kv: dict[Slot, Content] = field(default_factory=dict)
    reqs: dict[str, Mirror] = field(default_factory=dict)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.reqs.pop(req_id, None)
        starts = self._update_tables(out)
        contents = {
            req_id: prefix_contents(self.reqs[req_id].spec, self.reqs[req_id].tokens)
            for req_id in out.num_scheduled_tokens
        }
        writes: dict[Slot, Content] = {}
        failed = set()
        loads: dict[str, Load] = out.kv_connector_metadata or {}
        for req_id, load in loads.items():
            if load.sync:  # loaded inside this step, before the forward pass
                m = self.reqs[req_id]
                m.poisoned = m.spec.load_fails
                if m.poisoned:
                    failed.add(req_id)
                for p in range(starts[req_id] - load.num_tokens, starts[req_id]):
                    writes[m.slot(p)] = BAD if m.poisoned else contents[req_id][p]
        for req_id, n in out.num_scheduled_tokens.items():
            m, start = self.reqs[req_id], starts[req_id]
            assert start + n <= len(m.tokens), f"{req_id}: scheduled past its known tokens"
            for p in range(start, start + n):
                value = BAD if m.poisoned else contents[req_id][p]
                if writes.setdefault(m.slot(p), value) != value:
                    raise AssertionError(f"{req_id}: slot {p} written twice in one step")
        self.kv.update(writes)
        sampled: list[list[int]] = []
        for req_id, n in out.num_scheduled_tokens.items():
            m, end = self.reqs[req_id], starts[req_id] + n
            if not m.poisoned:
                self.check(m, contents[req_id], end, f"step {out.step_id}")
            if end < len(m.tokens):
                sampled.append([])
                continue
            token = BOGUS if m.poisoned else m.spec.expected_token(end - len(m.spec.prompt))
            m.tokens.append(token)
            sampled.append([token])
        return ModelRunnerOutput(
            list(out.num_scheduled_tokens), sampled, failed_recving=failed or None
        )

    def _update_tables(self, out: SchedulerOutput) -> dict[str, int]:
        starts = {}
        for new in out.scheduled_new_reqs:
            tokens = new.prompt_token_ids + new.output_token_ids
            self.reqs[new.req_id] = Mirror(self.specs[new.req_id], tokens, list(new.block_ids))
            starts[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            m, start = self.reqs[req_id], cached.num_computed_tokens[i]
            starts[req_id] = start
            if cached.resumed_from_preemption[i]:
                m.tokens = list(cached.resumed_token_ids[req_id])
                m.blocks = list(cached.new_block_ids[i] or [])
                m.poisoned = False
            else:
                m.blocks += cached.new_block_ids[i] or []
            known = cached.new_token_ids[i]
            assert m.tokens[start : start + len(known)] == known, f"{req_id}: token diff"
        return starts

    def check(self, m: Mirror, contents: list[Content], end: int, when: str) -> None:
        """Positions ``[0, end)`` of ``m``'s table hold ``contents``."""
        got = [self.kv.get(m.slot(q)) for q in range(end)]
        if got != contents[:end]:
            q = next(q for q in range(end) if got[q] != contents[q])
            raise AssertionError(f"{when}: {m.spec.req_id} reads wrong KV at {q}: {got[q]}")

    def check_send(self, spec: ReqSpec, request: Request, block_ids: list[int], n: int) -> None:
        """The decode side reads the first ``n`` tokens' KV of a finished prefill request."""
        m = Mirror(spec, request.all_token_ids, block_ids)
        end = min(n, len(block_ids) * BLOCK_SIZE)
        self.check(m, prefix_contents(spec, m.tokens), end, f"send of {spec.req_id}")

    def write_load(self, spec: ReqSpec, request: Request, load: Load, start: int) -> None:
        """An asynchronous load lands (or fails): the remote side's KV of the same tokens."""
        m = Mirror(spec, list(request.all_token_ids), load.block_ids)
        contents = prefix_contents(spec, m.tokens)
        for p in range(start, start + load.num_tokens):
            self.kv[m.slot(p)] = BAD if spec.load_fails else contents[p]
