"""``PDConnector`` driving a real ``Scheduler`` on both sides of a prefill/decode hand-off.

The test plays the worker with hand-built ``ModelRunnerOutput``s: it reports the handle of a
save in ``kv_connector_output`` and the end of a load in ``finished_recving`` /
``failed_recving``. Block size 4, a few blocks, no Ray, no model.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from kv_transfer.connector import (
    KVConnectorMetadata,
    KVConnectorReport,
    KVSegment,
    LoadSpec,
    PDConnector,
    SaveSpec,
)
from scheduler import (
    EngineCoreOutput,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
)
from scheduler.request import FinishReason
from tests.scheduler.helpers import EOS, make_request, make_scheduler, model_output

BLOCK = 4
TIMEOUT_S = 5.0
SEG = [KVSegment(0, 2, "H")]  # a saved request's KV: one copy-out segment of both layers


def _instance(
    instance_id: str = "inst-0", num_blocks: int = 16, **sched: Any
) -> tuple[Scheduler, PDConnector]:
    connector = PDConnector(instance_id, block_size=BLOCK, timeout_s=TIMEOUT_S)
    sched.setdefault("max_num_seqs", 4)
    sched.setdefault("max_model_len", 32)
    s = make_scheduler(block_size=BLOCK, num_blocks=num_blocks, connector=connector, **sched)
    return s, connector


def _meta(out: SchedulerOutput) -> KVConnectorMetadata:
    meta = out.kv_connector_metadata
    assert isinstance(meta, KVConnectorMetadata)
    return meta


def _run(
    s: Scheduler,
    tokens: dict[str, list[int]] | None = None,
    *,
    saved: dict[str, Any] | None = None,
    finished_recving: set[str] | None = None,
    failed_recving: set[str] | None = None,
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One step: schedule, a hand-built worker result (with the connector's reports), apply."""
    out = s.schedule()
    result = model_output(
        s, out, tokens, finished_recving=finished_recving, failed_recving=failed_recving
    )
    if saved is not None:
        result.kv_connector_output = KVConnectorReport(saved=saved)
    outputs = s.update_from_output(out, result)
    s.check_integrity()
    return out, outputs


def _assert_idle(s: Scheduler, c: PDConnector) -> None:
    """Nothing leaked: every block free, no request anywhere, no save or load pending."""
    s.check_integrity()
    pool = s.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not s.requests and not s.kv_cache_manager.req_to_blocks
    assert not s.has_unfinished_requests()
    assert c.num_pending() == 0


def _finish_all(s: Scheduler, max_steps: int = 50) -> dict[str, list[int]]:
    produced: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not s.has_requests():
            return produced
        _, outputs = _run(s)
        for o in outputs:
            produced.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError(f"not finished after {max_steps} steps")


def _drain(s: Scheduler, c: PDConnector) -> dict[str, list[int]]:
    """Run every request to its end, then check that nothing leaked."""
    produced = _finish_all(s)
    _assert_idle(s, c)
    return produced


# -- prefill side ------------------------------------------------------------------------------


def _prefill_request(prompt: list[int] | int, req_id: str) -> Request:
    return make_request(
        prompt, req_id=req_id, max_tokens=1, kv_transfer_params={"do_remote_decode": True}
    )


def _prefill_scheduled(n: int) -> tuple[Scheduler, PDConnector, SchedulerOutput]:
    """An instance that has scheduled the whole ``n``-token prompt of prefill request "p"."""
    s, c = _instance()
    s.add_request(_prefill_request(n, "p"))
    return s, c, s.schedule()


@pytest.mark.parametrize("chunking", ["budget", "long_prefill_threshold", "none"])
def test_prefill_saves_once_at_the_end_of_the_prompt(chunking: str) -> None:
    if chunking == "budget":
        s, c = _instance(max_num_batched_tokens=4)
    elif chunking == "long_prefill_threshold":
        s, c = _instance(long_prefill_token_threshold=4)
    else:
        s, c = _instance()
    r = _prefill_request(10, "p")
    s.add_request(r)
    if chunking == "long_prefill_threshold":  # the threshold applies with others present
        s.add_request(make_request(3, req_id="other", max_tokens=20))
    metas: list[KVConnectorMetadata] = []
    while True:
        out = s.schedule()
        meta = _meta(out)
        metas.append(meta)
        if meta.saves:
            break
        assert "p" in out.num_scheduled_tokens  # not starved: a chunk of the prompt ran
        s.update_from_output(out, model_output(s, out))
        s.check_integrity()
        assert len(metas) < 10
    expected_steps = 1 if chunking == "none" else 3  # 10 tokens: 4 + 4 + 2
    assert len(metas) == expected_steps
    assert all(not m.saves and not m.loads for m in metas[:-1])
    assert metas[-1].saves == [SaveSpec("p", 10)] and not metas[-1].loads
    assert r.num_computed_tokens == 10  # this step reaches the end of the prompt
    block_ids = s.kv_cache_manager.get_block_ids("p")
    assert len(block_ids) == 3
    assert c.num_pending() == 1  # the save is in flight

    before = time.time()
    result = model_output(s, out, {"p": [41]})
    result.kv_connector_output = KVConnectorReport(saved={"p": SEG})
    outputs = s.update_from_output(out, result)
    s.check_integrity()
    finished = [o for o in outputs if o.request_id == "p"]
    assert len(finished) == 1
    (o,) = finished
    assert o.new_token_ids == [41] and o.finish_reason == FinishReason.LENGTH
    params = o.kv_transfer_params
    assert params is not None
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_num_tokens"] == 10
    assert params["handle"] == SEG
    assert params["remote_block_ids"] == block_ids
    assert params["remote_instance_id"] == "inst-0"
    assert params["deadline"] >= before + TIMEOUT_S
    # The saved copy is independent of the blocks: they are free at once, no send to await.
    assert "p" not in s.requests and "p" not in s.kv_cache_manager.req_to_blocks
    assert c.num_pending() == 0 and c.num_saves == 1
    _drain(s, c)


def test_prefill_preempted_mid_prompt_saves_once_when_it_completes() -> None:
    # 8 blocks: a decode that grows past 4 blocks evicts the half-prefilled request.
    s, connector = _instance(num_blocks=8, max_num_batched_tokens=4)
    s.add_request(make_request(12, req_id="a", max_tokens=12))
    for _ in range(4):  # a's prompt, then its first decode
        _run(s)
    p = _prefill_request(list(range(500, 516)), "p")
    s.add_request(p)
    saves: list[SaveSpec] = []
    handles: list[Any] = []
    preempted = False
    for _ in range(40):
        if not s.has_requests():
            break
        out = s.schedule()
        preempted |= "p" in out.preempted_req_ids
        meta = _meta(out)
        if meta.saves:
            assert p.num_computed_tokens == 16  # only the step that completes the prompt
        saves += meta.saves
        result = model_output(s, out)
        result.kv_connector_output = KVConnectorReport({x.req_id: SEG for x in meta.saves})
        for o in s.update_from_output(out, result):
            if o.request_id == "p" and o.finished:
                handles.append((o.kv_transfer_params or {}).get("handle"))
        s.check_integrity()
    assert preempted
    assert saves == [SaveSpec("p", 16)]
    assert handles == [SEG]
    _assert_idle(s, connector)


def test_save_of_a_request_aborted_during_its_saving_step_is_dropped() -> None:
    s, c, out = _prefill_scheduled(10)
    assert _meta(out).saves == [SaveSpec("p", 10)]
    s.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    assert c.num_pending() == 0
    # Built by hand: the worker sampled and saved before it learnt of the abort.
    result = ModelRunnerOutput(
        req_ids=["p"], sampled_token_ids=[[41]], kv_connector_output=KVConnectorReport({"p": SEG})
    )
    outputs = s.update_from_output(out, result)
    assert outputs == []  # nothing for the aborted request, no params with the handle
    assert c.num_pending() == 0 and c.num_saves == 0
    _assert_idle(s, c)


def test_an_in_place_save_of_a_request_aborted_during_its_saving_step_is_released() -> None:
    """The lease the worker made for an aborted request ends at the next step, not at its
    expiry: the scheduler holds no request then, and still steps once to say so."""
    s, c, out = _prefill_scheduled(10)
    s.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    result = ModelRunnerOutput(
        req_ids=["p"],
        sampled_token_ids=[[41]],
        kv_connector_output=KVConnectorReport({"p": [KVSegment(0, 2, "lease", in_place=True)]}),
    )
    assert s.update_from_output(out, result) == []
    assert not s.requests and s.has_requests()  # a release for the worker, no request
    assert _meta(s.schedule()).releases == ["p"]
    assert not s.has_requests()
    _assert_idle(s, c)


@pytest.mark.parametrize("in_place", [True, False])
def test_prefill_preempted_while_its_saving_step_runs_is_saved_again(in_place: bool) -> None:
    """Async scheduling: the step that completes "p"'s prompt (and saves it) is in flight
    when the next step preempts "p" for a growing decode. Its blocks go to the decode, so the
    save in flight is of blocks "p" no longer holds (an in-place lease would hand a decode
    instance another request's KV): the step's output for "p" is dropped, the lease is
    released, and "p" computes its prompt again and hands off a fresh save."""
    s, c = _instance(num_blocks=4, async_scheduling=True, max_model_len=16)
    s.add_request(make_request(3, req_id="r", max_tokens=12))  # 1 block, then grows
    _run(s)
    s.add_request(_prefill_request(12, "p"))  # 3 blocks: the pool is full
    saving = s.schedule()
    assert saving.num_scheduled_tokens == {"r": 1, "p": 12}
    assert _meta(saving).saves == [SaveSpec("p", 12)]
    saving_result = model_output(s, saving)
    nxt = s.schedule()  # "r" needs a 2nd block: "p", the last admitted, is preempted
    assert "p" in nxt.preempted_req_ids
    old = [KVSegment(0, 2, "old", in_place=in_place)]
    saving_result.kv_connector_output = KVConnectorReport(saved={"p": old})
    outputs = s.update_from_output(saving, saving_result)
    assert [o.request_id for o in outputs] == ["r"]  # nothing for "p": not finished on it
    s.update_from_output(nxt, model_output(s, nxt))
    s.check_integrity()
    new = [KVSegment(0, 2, "new", in_place=in_place)]
    releases: list[str] = []
    finals = []
    for _ in range(40):
        if not s.has_requests():
            break
        out = s.schedule()
        meta = _meta(out)
        releases += meta.releases
        # The worker ends a released lease at once; the new one once a decode side read it.
        sent = set(meta.releases) | ({"p"} if finals and in_place else set())
        result = model_output(s, out, finished_sending=sent or None)
        result.kv_connector_output = KVConnectorReport({x.req_id: new for x in meta.saves})
        finals += [o for o in s.update_from_output(out, result) if o.request_id == "p"]
        s.check_integrity()
    (final,) = finals
    assert final.finish_reason == FinishReason.LENGTH
    assert final.kv_transfer_params is not None and final.kv_transfer_params["handle"] == new
    assert len(final.kv_transfer_params["remote_block_ids"]) == 3
    assert releases == (["p"] if in_place else [])  # the old lease, once
    _assert_idle(s, c)


def test_prefill_whose_first_token_is_eos_hands_nothing_off() -> None:
    """Only a request capped at its first token continues on a decode instance (as vLLM's
    connectors: ``FINISHED_LENGTH_CAPPED``); one that stopped there returns no params, and
    its copy-out KV is let go with its blocks."""
    s, c, out = _prefill_scheduled(9)
    result = model_output(s, out, {"p": [EOS]})
    result.kv_connector_output = KVConnectorReport(saved={"p": SEG})
    (o,) = s.update_from_output(out, result)
    assert o.new_token_ids == [EOS] and o.finish_reason == FinishReason.STOP
    assert o.kv_transfer_params is None
    _assert_idle(s, c)


def test_an_in_place_save_nobody_takes_is_released_at_the_next_step() -> None:
    """Blocks served in place (grpc, nixl) stay allocated until the worker ends their lease:
    for a request that ends at its first token, the next step's metadata tells it to, and
    the blocks are freed when it reports the send finished."""
    s, c, out = _prefill_scheduled(9)
    in_place = [KVSegment(0, 2, "lease", in_place=True)]
    result = model_output(s, out, {"p": [EOS]})
    result.kv_connector_output = KVConnectorReport(saved={"p": in_place})
    (o,) = s.update_from_output(out, result)
    assert o.finish_reason == FinishReason.STOP and o.kv_transfer_params is None
    assert s.kv_cache_manager.block_pool.num_free_blocks < s.kv_cache_manager.block_pool.num_blocks
    nxt = s.schedule()
    assert _meta(nxt).releases == ["p"]
    done = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
    done.kv_connector_output = KVConnectorReport()
    done.finished_sending = {"p"}
    s.update_from_output(nxt, done)
    _assert_idle(s, c)


def test_releases_for_a_worker_that_died_are_dropped() -> None:
    """A release waits for the next step to reach the worker; when the worker died (its
    leases with it) the engine drops it, so the dead instance shows nothing pending
    (regression: a dead prefill instance reported one pending release until it rejoined)."""
    s, c, _ = _prefill_scheduled(9)
    c.release("p")
    assert c.num_pending() >= 1
    c.drop_releases()
    assert _meta(s.schedule()).releases == []


def test_prefill_without_a_reported_handle_returns_no_params() -> None:
    s, c, out = _prefill_scheduled(6)
    assert _meta(out).saves == [SaveSpec("p", 6)]
    (o,) = s.update_from_output(out, model_output(s, out, {"p": [41]}))
    assert o.finished and o.kv_transfer_params is None
    _assert_idle(s, c)


# -- decode side -------------------------------------------------------------------------------

PROMPT = list(range(200, 210))  # 10 tokens: blocks of 4, 4 and 2
FIRST = 41  # the token the prefill instance sampled


def _decode_request(
    prompt: list[int], req_id: str = "d", handle: Any = "H", max_tokens: int = 4
) -> Request:
    params: dict[str, Any] = {"do_remote_prefill": True, "remote_num_tokens": len(prompt)}
    if handle is not None:
        params["handle"] = handle
    return make_request(
        prompt,
        req_id=req_id,
        max_tokens=max_tokens,
        output_token_ids=[FIRST],
        kv_transfer_params=params,
    )


def _start_load(s: Scheduler, r: Request) -> LoadSpec:
    """Admit ``r``; the step computes nothing and starts its load."""
    s.add_request(r)
    out, outputs = _run(s)
    assert out.num_scheduled_tokens == {} and outputs == []
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = _meta(out)
    assert not meta.saves and len(meta.loads) == 1
    return meta.loads[0]


def _loading(**sched: Any) -> tuple[Scheduler, PDConnector, Request]:
    """An instance whose decode request "d" (``PROMPT``) has just started its load."""
    s, c = _instance(**sched)
    r = _decode_request(PROMPT)
    _start_load(s, r)
    return s, c, r


def test_decode_loads_the_prompt_then_runs_only_the_first_output_token() -> None:
    s, c = _instance()
    r = _decode_request(PROMPT)
    spec = _start_load(s, r)
    block_ids = s.kv_cache_manager.get_block_ids("d")
    assert spec == LoadSpec("d", "H", block_ids[:3], 0, TIMEOUT_S)
    assert len(block_ids) == 3  # every block covering the prompt
    assert r.num_computed_tokens == len(PROMPT)
    assert c.num_pending() == 0  # the spec went out with the step

    out, outputs = _run(s, finished_recving={"d"})
    assert out.num_scheduled_tokens == {} and outputs == []
    out, outputs = _run(s, {"d": [42]})
    assert out.num_scheduled_tokens == {"d": 1}  # the first output token, at position 10
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == len(PROMPT) and new.output_token_ids == [FIRST]
    assert not _meta(out).loads
    assert r.kv_transfer_params is not None and "handle" not in r.kv_transfer_params
    assert [o.new_token_ids for o in outputs] == [[42]]
    assert _finish_all(s) == {"d": [7, 7]}  # max_tokens 4: FIRST, 42, 7, 7
    _assert_idle(s, c)


def test_load_reported_done_by_the_step_that_started_it() -> None:
    # An idle worker step waits briefly for its fetch: a fast load ends within that step.
    s, c = _instance()
    r = _decode_request(PROMPT)
    s.add_request(r)
    out, outputs = _run(s, finished_recving={"d"})
    assert out.num_scheduled_tokens == {} and outputs == [] and len(_meta(out).loads) == 1
    out, outputs = _run(s, {"d": [42]})
    assert out.num_scheduled_tokens == {"d": 1}
    assert [o.new_token_ids for o in outputs] == [[42]]
    _drain(s, c)


def test_decode_loads_only_what_the_local_prefix_cache_lacks() -> None:
    s, c = _instance()
    shared = PROMPT[:8]
    s.add_request(make_request([*shared, 1, 3], req_id="local", max_tokens=2))
    _finish_all(s)
    cached = s.kv_cache_manager.get_computed_blocks(make_request([*shared, 5, 6]))[0]
    assert len(cached) == 2
    r = _decode_request(PROMPT)
    spec = _start_load(s, r)
    block_ids = s.kv_cache_manager.get_block_ids("d")
    assert block_ids[:2] == cached.get_block_ids()  # the local hit
    assert spec.first_block == 2 and spec.block_ids == block_ids[2:3]
    _run(s, finished_recving={"d"})
    out, _ = _run(s)
    assert out.num_scheduled_tokens == {"d": 1}
    _drain(s, c)


def test_failed_load_with_recompute_policy_computes_the_prompt_locally() -> None:
    s, c, r = _loading(kv_load_failure_policy="recompute")
    out, outputs = _run(s, failed_recving={"d"})
    assert outputs == []
    assert r.kv_transfer_params is not None
    assert "handle" not in r.kv_transfer_params
    assert r.kv_transfer_params["do_remote_prefill"] is False
    out, outputs = _run(s, {"d": [42]})
    assert out.num_scheduled_tokens == {"d": len(PROMPT) + 1}  # prompt and FIRST
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 0
    assert not _meta(out).loads
    assert [o.new_token_ids for o in outputs] == [[42]]
    _drain(s, c)


def test_failed_load_with_fail_policy_ends_the_request_with_an_error() -> None:
    s, c, r = _loading(kv_load_failure_policy="fail")
    _, outputs = _run(s, failed_recving={"d"})
    (o,) = outputs
    assert o.request_id == "d" and o.new_token_ids == []
    assert o.finish_reason == FinishReason.ERROR
    assert o.error is not None and "load failed" in o.error
    assert r.status == RequestStatus.FINISHED_ERROR
    _assert_idle(s, c)


def test_remote_prefill_without_a_handle_computes_locally() -> None:
    s, c = _instance()
    r = _decode_request(PROMPT, handle=None)
    s.add_request(r)
    out, outputs = _run(s, {"d": [42]})
    assert out.num_scheduled_tokens == {"d": len(PROMPT) + 1}
    assert not _meta(out).loads and c.num_loads == 0
    assert [o.new_token_ids for o in outputs] == [[42]]
    _drain(s, c)


def test_decode_aborted_while_loading_keeps_its_blocks_until_the_load_ends() -> None:
    s, c, _ = _loading()
    s.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    # The worker may still write into the blocks: they stay taken until it reports.
    assert s.kv_cache_manager.get_block_ids("d")
    _run(s)
    assert "d" in s.requests
    _run(s, finished_recving={"d"})
    _assert_idle(s, c)


IN_PLACE = [KVSegment(0, 2, "lease", in_place=True)]


def _in_place_decode_request() -> Request:
    r = _decode_request(PROMPT, handle=IN_PLACE)
    assert r.kv_transfer_params is not None
    r.kv_transfer_params["remote_instance_id"] = "p-0"
    return r


def test_a_decode_request_aborted_before_its_load_lets_the_source_go() -> None:
    """Aborted while queued (a client that left): the source's lease is released at once
    (reported as unread), not held until it expires."""
    s, c = _instance()
    r = _in_place_decode_request()
    s.add_request(r)
    s.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert c.take_unread() == [("d", "p-0")]
    _assert_idle(s, c)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failed_load_lets_the_source_go(policy: str) -> None:
    s, c = _instance(kv_load_failure_policy=policy)
    _start_load(s, _in_place_decode_request())
    _run(s, failed_recving={"d"})
    assert c.take_unread() == [("d", "p-0")]
    _finish_all(s)
    assert c.take_unread() == []  # once
    _assert_idle(s, c)


def test_a_load_aborted_then_failed_lets_the_source_go() -> None:
    s, c = _instance()
    _start_load(s, _in_place_decode_request())
    s.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    assert c.take_unread() == []  # a read may still be running
    _run(s, failed_recving={"d"})
    assert c.take_unread() == [("d", "p-0")]
    _assert_idle(s, c)


def test_a_load_that_succeeded_releases_nothing() -> None:
    """The read's notification ended the source's lease already."""
    s, c = _instance()
    _start_load(s, _in_place_decode_request())
    _run(s, finished_recving={"d"})
    _finish_all(s)
    assert c.take_unread() == []
    _assert_idle(s, c)


def test_nothing_to_load_drops_the_handle_at_admission() -> None:
    """The local prefix cache covers the whole prompt: no load, and the source's copy is let
    go at once instead of staying referenced until the request ends."""
    s, c = _instance()
    prompt = PROMPT[:8]
    s.add_request(make_request([*prompt, 1, 3], req_id="local", max_tokens=2))
    _finish_all(s)
    r = _decode_request(prompt)
    s.add_request(r)
    out, _ = _run(s, {"d": [42]})
    assert not _meta(out).loads
    assert out.num_scheduled_tokens == {"d": 1}  # only the first output token's position
    assert r.kv_transfer_params is not None and "handle" not in r.kv_transfer_params
    _drain(s, c)


def test_loaded_requests_give_blocks_back_before_running_ones_are_preempted() -> None:
    """At max_num_seqs, hand-offs still load (no running slot needed) and then wait holding
    their blocks. When the running requests run out of blocks, those loaded requests are
    released first: no running request is preempted while one of them holds blocks."""
    s, connector = _instance(
        "d", num_blocks=24, max_num_seqs=2, max_model_len=64, prefix_caching=False
    )
    for i in range(2):
        s.add_request(make_request(list(range(1, 9)), req_id=f"run{i}", max_tokens=40))
    _run(s)
    handoffs = [_decode_request(list(range(20 + i, 32 + i)), req_id=f"h{i}") for i in range(3)]
    for r in handoffs:
        s.add_request(r)
    loading: set[str] = set()
    released = 0
    for _ in range(40):
        loaded_before = [r for r in s.holding if not r.awaiting_remote_kvs]
        out = s.schedule()
        meta = _meta(out)
        if loaded_before and out.preempted_req_ids:
            assert not out.preempted_req_ids & {"run0", "run1"}, "running preempted first"
        released += sum(r.status.name in ("WAITING", "PREEMPTED") for r in loaded_before)
        result = model_output(s, out, None, finished_recving=loading or None)
        loading = {spec.req_id for spec in meta.loads}
        s.update_from_output(out, result)
        s.check_integrity()
    assert released > 0  # the scenario did run short of blocks with loaded requests waiting
    _drain(s, connector)
