"""Shared pieces for scheduler tests: tiny configs, request factory, a fake executor that
builds ``ModelRunnerOutput``s by hand, and a small in-memory KV connector."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from scheduler import (
    CacheConfig,
    EngineCoreOutput,
    KVCacheBlocks,
    LoRAConfig,
    LoRARequest,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    SchedulerConnector,
    SchedulerOutput,
)

EOS = 2
_ids = itertools.count()


def make_scheduler(
    *,
    block_size: int = 4,
    num_blocks: int = 64,
    prefix_caching: bool = True,
    lora: LoRAConfig | None = None,
    connector: SchedulerConnector | None = None,
    **sched: Any,
) -> Scheduler:
    sched.setdefault("max_num_seqs", 16)
    sched.setdefault("max_num_batched_tokens", 64)
    sched.setdefault("max_model_len", 128)
    return Scheduler(
        SchedulerConfig(**sched),
        CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching
        ),
        lora_config=lora,
        connector=connector,
    )


def make_request(
    prompt: list[int] | int,
    *,
    req_id: str | None = None,
    max_tokens: int | None = 8,
    arrival_time: float | None = None,
    priority: int = 0,
    lora: LoRARequest | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    cache_salt: str | None = None,
    output_token_ids: list[int] | None = None,
    **sampling: Any,
) -> Request:
    """``prompt`` is a token list, or a length (tokens 100, 101, ... -- never EOS)."""
    if isinstance(prompt, int):
        prompt = list(range(100, 100 + prompt))
    n = next(_ids)
    return Request(
        request_id=req_id or f"req-{n}",
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, **sampling),
        eos_token_id=EOS,
        arrival_time=float(n) if arrival_time is None else arrival_time,
        priority=priority,
        lora_request=lora,
        kv_transfer_params=kv_transfer_params,
        cache_salt=cache_salt,
        output_token_ids=output_token_ids,
    )


def sampling_reqs(s: Scheduler, out: SchedulerOutput) -> set[str]:
    """Requests whose scheduled tokens reach the end of their known sequence (they sample)."""
    result = set()
    for req_id in out.num_scheduled_tokens:
        r = s.requests[req_id]
        # num_computed_tokens was already advanced by schedule().
        if r.num_computed_tokens >= r.num_tokens:
            result.add(req_id)
    return result


def model_output(
    s: Scheduler,
    out: SchedulerOutput,
    tokens: dict[str, list[int]] | None = None,
    default_token: int = 7,
    *,
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    failed_recving: set[str] | None = None,
) -> ModelRunnerOutput:
    """A ``ModelRunnerOutput`` for ``out``: each sampling request gets ``tokens[req_id]``
    (default ``[default_token]``), partial prefills get ``[]``."""
    tokens = tokens or {}
    sampling = sampling_reqs(s, out)
    req_ids = list(out.num_scheduled_tokens)
    sampled = [list(tokens.get(rid, [default_token])) if rid in sampling else [] for rid in req_ids]
    return ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=sampled,
        finished_sending=finished_sending,
        finished_recving=finished_recving,
        failed_recving=failed_recving,
    )


def step(
    s: Scheduler,
    tokens: dict[str, list[int]] | None = None,
    *,
    finished_sending: set[str] | None = None,
    finished_recving: set[str] | None = None,
    failed_recving: set[str] | None = None,
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """schedule -> fake execute -> update_from_output, then check integrity."""
    out = s.schedule()
    result = model_output(
        s,
        out,
        tokens,
        finished_sending=finished_sending,
        finished_recving=finished_recving,
        failed_recving=failed_recving,
    )
    outputs = s.update_from_output(out, result)
    s.check_integrity()
    return out, outputs


def run_to_completion(s: Scheduler, max_steps: int = 1000) -> dict[str, list[int]]:
    """Step until nothing is unfinished; returns the tokens each request produced."""
    produced: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        _, outputs = step(s)
        for o in outputs:
            produced.setdefault(o.request_id, []).extend(o.new_token_ids)
    else:
        raise AssertionError(f"not finished after {max_steps} steps")
    return produced


def assert_all_free(s: Scheduler) -> None:
    """Nothing leaked: every block free, no request left anywhere."""
    s.check_integrity()
    pool = s.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks, (
        f"{pool.num_blocks - pool.num_free_blocks} blocks still in use"
    )
    assert not s.requests, f"requests left: {list(s.requests)}"
    assert not s.kv_cache_manager.req_to_blocks
    assert s.get_num_unfinished_requests() == 0


def drain(s: Scheduler) -> dict[str, list[int]]:
    """Run to completion, then check that nothing leaked; returns each request's tokens."""
    produced = run_to_completion(s)
    assert_all_free(s)
    return produced


def used_blocks(s: Scheduler) -> int:
    pool = s.kv_cache_manager.block_pool
    return pool.num_blocks - pool.num_free_blocks


def request_ids(requests: Iterable[Request]) -> list[str]:
    return [r.request_id for r in requests]


# -- prompts that never share a prefix by accident ----------------------------------------------

_bases = itertools.count(1)


def fresh_prompt(n: int) -> list[int]:
    """``n`` tokens that share no prefix with any other ``fresh_prompt`` (never EOS)."""
    base = 1000 * next(_bases)
    return list(range(base, base + n))


def add(s: Scheduler, req_id: str, prompt: int | list[int] = 4, **kw: Any) -> Request:
    """Add a request to ``s``; ``prompt`` is a token list, or a length (a ``fresh_prompt``)."""
    request = make_request(
        fresh_prompt(prompt) if isinstance(prompt, int) else prompt, req_id=req_id, **kw
    )
    s.add_request(request)
    return request


# -- a model that counts: a request's i-th output token is T0 + i ------------------------------
# A request that was preempted and recomputed must still end with exactly T0, T0 + 1, ...

T0 = 5000


def token_range(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


def expected(n: int) -> list[int]:
    """The first ``n`` outputs of any request under ``counting_step``."""
    return token_range(T0, n)


def counting_step(
    s: Scheduler, produced: dict[str, list[int]] | None = None
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One step (integrity checked); each sampling request gets ``T0 + its output count``,
    and its new tokens are added to ``produced``."""
    tokens = {rid: [T0 + r.num_output_tokens] for rid, r in s.requests.items()}
    out, outputs = step(s, tokens)
    if produced is not None:
        for o in outputs:
            produced.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out, outputs


def finish_counting(
    s: Scheduler,
    produced: dict[str, list[int]],
    step_fn: Callable[
        [Scheduler, dict[str, list[int]]], tuple[SchedulerOutput, list[EngineCoreOutput]]
    ] = counting_step,
    max_steps: int = 200,
) -> None:
    """Step with ``step_fn`` until nothing is unfinished, then check that nothing leaked."""
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        step_fn(s, produced)
    assert_all_free(s)


REMOTE = {"do_remote_prefill": True}  # a decode-side request whose KV comes from elsewhere


@dataclass
class ConnectorMeta:
    loads: dict[str, tuple[list[int], int]] = field(default_factory=dict)  # id -> blocks, n
    saves: dict[str, list[int]] = field(default_factory=dict)


class InMemoryConnector(SchedulerConnector):
    """A small test connector with the P/D roles of DESIGN §3.2.

    Decode side: a request with ``do_remote_prefill`` loads ``remote_num_tokens`` (default: the
    whole prompt) asynchronously. Prefill side: a request with ``do_remote_decode`` that stops
    or hits its length keeps its blocks (``delay_free``) and returns where they are.
    The test plays the worker: it reports ``finished_recving`` / ``finished_sending``.
    """

    def __init__(self) -> None:
        self.pending_loads: dict[str, tuple[list[int], int]] = {}
        self.meta_calls = 0
        self.finished_calls: list[tuple[str, RequestStatus, list[int]]] = []
        self.alloc_calls: list[tuple[str, list[int], int]] = []

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        remote = int(params.get("remote_num_tokens", request.num_prompt_tokens))
        count = max(remote - num_computed_tokens, 0)
        return count, count > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.alloc_calls.append((request.request_id, blocks.get_block_ids(), num_external_tokens))
        if num_external_tokens > 0:
            self.pending_loads[request.request_id] = (blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMeta:
        self.meta_calls += 1
        meta = ConnectorMeta(loads=self.pending_loads)
        self.pending_loads = {}
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished_calls.append((request.request_id, request.status, block_ids))
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode") or request.status not in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH_CAPPED,
        ):
            return False, None
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": block_ids,
            "remote_num_tokens": request.num_prompt_tokens,
        }


def lora(n: int) -> LoRARequest:
    return LoRARequest(lora_name=f"adapter-{n}", lora_int_id=n, lora_path=f"/adapters/{n}")
