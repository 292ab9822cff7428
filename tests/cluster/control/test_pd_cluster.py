"""The Ray cluster end to end: prefill and decode workers on their own nodes, KV handed off
by NIXL reads (the default, ``auto``, where NIXL is installed) and through the object store
(``ray``): streamed tokens equal to colocated and in-process runs, aborts at every stage,
transfer deadlines. A real ``ray.cluster_utils.Cluster`` (tests/cluster/conftest).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.conftest import RayCluster, assert_clean, wait_until
from tests.cluster.control.helpers import (
    BLOCK_SIZE,
    DECODE,
    NUM_BLOCKS,
    PREFILL,
    cluster_config,
    generate_colocated,
    generate_in_process,
    token_ids,
)

ray = pytest.importorskip("ray")

from cluster.control.client import ClusterClient  # noqa: E402
from cluster.control.flights import unpack_batch  # noqa: E402
from cluster.control.launch import build_cluster, shutdown_cluster  # noqa: E402
from kv_transfer.nixl_transport import MISSING, nixl_available  # noqa: E402
from scheduler import Request, SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
TIMEOUT_S = 1.0  # the clusters' KV transfer deadline


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Mixed lengths (1 to 61 tokens), no shared prefixes, no EOS (token 2) inside."""
    rng = random.Random(seed)
    lengths = [1 + (i * 37) % 61 for i in range(count)]
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason=MISSING)),
        "ray",
    ],
)
def disagg(
    ray_cluster: RayCluster, tiny_model: Path, request: pytest.FixtureRequest
) -> Iterator[Any]:
    """1 prefill + 1 decode instance, every request disaggregated, recompute on failure; KV
    over each transport in turn."""
    config = cluster_config(
        tiny_model,
        [PREFILL, DECODE],
        router={"disaggregation": "always"},
        kv_transfer={"timeout_s": TIMEOUT_S, "transport": request.param},
    )
    handle = build_cluster(config, name=f"disagg-{request.param}", namespace="tandem-tests")
    assert ray.get(handle.describe.remote())["kv_transport"] == request.param
    yield handle
    shutdown_cluster(handle)


@pytest.fixture(scope="module")
def client(disagg: Any) -> ClusterClient:
    return ClusterClient(disagg)


# With the ``ray`` transport only what depends on the transport runs again (the rest was run
# with nixl): hand-off equality, an abort during the transfer, its deadline.
RAY_TESTS = {
    "test_disaggregated_equals_colocated_equals_in_process",
    "test_abort_while_transferring",
    "test_transfer_timeout_recomputes_on_decode",
}


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    callspec = getattr(request.node, "callspec", None)
    transport = None if callspec is None else callspec.params.get("disagg")
    if transport == "ray" and request.node.originalname not in RAY_TESTS and nixl_available():
        pytest.skip("independent of the KV transport: run with nixl")
    yield
    for name in ("disagg", "conditional"):
        if name in request.fixturenames:
            handle = request.getfixturevalue(name)
            ray.get(handle.set_fault_injection.remote("p-0", 0.0, 0.0))
            ray.get(handle.set_fault_injection.remote("d-0", 0.0, 0.0))
            assert_clean(handle)


def _stats(client: ClusterClient) -> dict[str, Any]:
    instances: dict[str, Any] = client.stats()["instances"]
    return instances


# -- placement and equality ------------------------------------------------------------------
def test_workers_land_on_their_nodes(disagg: Any, ray_cluster: RayCluster) -> None:
    health = ray.get(disagg.worker_health.remote())
    assert health["p-0"]["node_id"] == ray_cluster.prefill_node_id
    assert health["d-0"]["node_id"] == ray_cluster.decode_node_id
    described = ray.get(disagg.describe.remote())["instances"]
    assert described["p-0"]["role"] == "prefill" and described["d-0"]["role"] == "decode"


def test_disaggregated_equals_colocated_equals_in_process(
    disagg: Any, client: ClusterClient, tiny_model: Path
) -> None:
    prompts = _prompts(16)
    before = _stats(client)
    history_before = ray.get(disagg.transfer_history.remote())["d-0"]
    disaggregated = token_ids(client.generate(prompts, GREEDY))
    after = _stats(client)

    colocated = generate_colocated(tiny_model, prompts, GREEDY, "colocated")
    in_process = generate_in_process(tiny_model, prompts, GREEDY)

    assert disaggregated == in_process
    assert colocated == in_process
    handed_off = [t for t in disaggregated if len(t) > 1]  # EOS first: nothing to decode
    assert len(handed_off) >= 12 and max(map(len, handed_off)) == GREEDY.max_tokens

    # The KV really crossed: the decode instance computed no prompt token, only the outputs
    # after the first (sampled on the prefill instance); the prefill instance computed every
    # prompt token and no output; one load per request, each carrying bytes.
    p, d = (
        {k: after[i][k] - before[i][k] for k in after[i] if isinstance(after[i][k], int)}
        for i in ("p-0", "d-0")
    )
    assert p["num_prompt_tokens_computed"] == sum(map(len, prompts))
    assert p["num_output_tokens_computed"] == 0
    assert d["num_prompt_tokens_computed"] == 0
    assert d["num_output_tokens_computed"] == sum(len(t) - 1 for t in handed_off)
    # Generated (vLLM's generation tokens): the first token on the prefill side, the rest on
    # the decode side.
    assert p["num_generated_tokens"] == len(prompts)
    assert d["num_generated_tokens"] == sum(len(t) - 1 for t in handed_off)
    assert p["num_kv_saves_started"] == len(prompts)
    assert d["num_kv_loads_started"] == len(handed_off)
    history = ray.get(disagg.transfer_history.remote())["d-0"][len(history_before) :]
    assert len(history) == len(handed_off) and all(r.ok and r.num_bytes > 0 for r in history)


def test_streaming_first_token_from_prefill_then_decode(client: ClusterClient) -> None:
    prompt = _prompts(1, seed=3)[0] + [9] * 20
    params = GREEDY.model_copy(update={"ignore_eos": True})

    async def run() -> list[list[int]]:
        deltas = []
        async for out in client.generate_async(prompt, params):
            if out.outputs[0].new_token_ids:
                deltas.append(list(out.outputs[0].new_token_ids))
        return deltas

    deltas = asyncio.run(run())
    assert len(deltas[0]) == 1  # the prefill instance's token arrives on its own
    assert sum(map(len, deltas)) == GREEDY.max_tokens
    assert len(deltas) > 2  # decode tokens stream, not one final batch


def test_n_and_seeded_sampling_match_in_process(client: ClusterClient, tiny_model: Path) -> None:
    from cluster.engine.llm import LLM

    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, seed=7, n=3)
    prompts = _prompts(3, seed=5)
    llm = LLM(str(tiny_model), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, progress=False)
    expected = [[s.token_ids for s in o.outputs] for o in llm.generate(prompts, params)]
    got = [[s.token_ids for s in o.outputs] for o in client.generate(prompts, params)]
    assert got == expected
    assert len({tuple(t) for t in got[0]}) > 1  # the three samples differ


def test_n_samples_share_their_prompts_blocks(disagg: Any, tiny_model: Path) -> None:
    """The n samples of a request, submitted in one call and admitted in one step: the
    prefill instance computes their prompt once -- the first sample's full blocks are cached
    when it is scheduled (as vLLM v1), and the others' look-ups hit them -- the others only
    its last, partial block. Their tokens are the in-process engine's."""
    from cluster.engine.llm import LLM

    rng = random.Random(11)
    prompt = [rng.randrange(3, 256) for _ in range(61)]  # 15 full blocks and one token
    n = 4
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=21, n=n)
    children = [
        Request(
            f"sibs#{i}",
            prompt,
            params.model_copy(update={"n": 1, "seed": 21 + i}),
            eos_token_id=2,
            num_samples=n,
            sample_index=i,
        )
        for i in range(n)
    ]
    before = _stats_of(disagg)["p-0"]["num_prompt_tokens_computed"]
    stream = disagg.subscribe.remote("sibs-client")
    items = [(child, None, None) for child in children]
    assert ray.get(disagg.submit_many.remote("sibs-client", items)) == [None] * n
    tokens: dict[str, list[int]] = {c.request_id: [] for c in children}
    finished: set[str] = set()
    while len(finished) < n:
        for tag, out in unpack_batch(ray.get(next(stream))):
            tokens[str(tag)].extend(out.new_token_ids)
            if out.finished:
                finished.add(str(tag))
    ray.get(disagg.unsubscribe.remote("sibs-client"))
    computed = _stats_of(disagg)["p-0"]["num_prompt_tokens_computed"] - before
    assert len(prompt) <= computed <= len(prompt) + (n - 1) * BLOCK_SIZE
    llm = LLM(str(tiny_model), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, progress=False)
    (expected,) = llm.generate([prompt], params)
    assert [tokens[f"sibs#{i}"] for i in range(n)] == [s.token_ids for s in expected.outputs]


def _stats_of(handle: Any) -> dict[str, Any]:
    instances: dict[str, Any] = ray.get(handle.stats.remote())["instances"]
    return instances


def test_structured_outputs_across_the_hand_off(client: ClusterClient, tiny_model: Path) -> None:
    """The prefill instance samples the first token under the grammar; the decode instance
    rebuilds the matcher from it and goes on: greedy output equals colocated and in-process
    runs, seeded sampling (n = 2) equals in-process, and every output matches the schema."""
    import json

    from actors.model.tokenizer import Tokenizer
    from scheduler import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
        },
        "required": ["answer", "n"],
        "additionalProperties": False,
    }
    spec = StructuredOutputsParams(json=schema)
    greedy = SamplingParams(max_tokens=48, temperature=0.0, structured_outputs=spec)
    prompts = _prompts(8, seed=3)
    disaggregated = token_ids(client.generate(prompts, greedy))
    colocated = generate_colocated(tiny_model, prompts, greedy, "colocated-structured")
    assert disaggregated == colocated == generate_in_process(tiny_model, prompts, greedy)
    seeded = greedy.model_copy(update={"temperature": 1.0, "seed": 11, "n": 2})
    sampled = [[s.token_ids for s in o.outputs] for o in client.generate(prompts[:4], seeded)]
    from cluster.engine.llm import LLM

    llm = LLM(str(tiny_model), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, progress=False)
    assert sampled == [[s.token_ids for s in o.outputs] for o in llm.generate(prompts[:4], seeded)]
    tokenizer = Tokenizer.from_path(tiny_model)
    for tokens in disaggregated + [t for pair in sampled for t in pair]:
        assert tokens[-1] == 2  # complete: EOS, which the grammar allowed only at the end
        value = json.loads(tokenizer.decode(tokens[:-1]))
        assert value["answer"] in ("yes", "no") and isinstance(value["n"], int)


def test_prompt_logprobs_come_from_the_prefill_instance(
    client: ClusterClient, tiny_model: Path
) -> None:
    """The prefill instance computes the prompt's logprobs and sends them with the first
    token; the decode instance sends none again: equal to the in-process engine's."""
    from cluster.engine.llm import LLM

    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)
    prompts = _prompts(4, seed=8)
    llm = LLM(str(tiny_model), block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, progress=False)
    expected = [o.prompt_logprobs for o in llm.generate(prompts, params)]
    got = client.generate(prompts, params)
    for out, want, prompt in zip(got, expected, prompts, strict=True):
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs == want
        assert len(out.outputs[0].token_ids) == 4


# -- abort at every stage --------------------------------------------------------------------
async def _collect(client: ClusterClient, prompt: list[int], params: SamplingParams) -> Any:
    final = None
    async for out in client.generate_async(prompt, params, request_id=f"r{time.monotonic()}"):
        final = out
    return final


def test_abort_while_queued_and_while_prefilling(disagg: Any, client: ClusterClient) -> None:
    ray.get(disagg.set_fault_injection.remote("p-0", 0.0, 0.5))  # every prefill step: +0.5 s
    before = _stats(client)

    async def run() -> tuple[Any, Any]:
        first = asyncio.ensure_future(_collect(client, _prompts(1, 1)[0] + [5] * 8, GREEDY))
        # Wait until the first request's step is running on the prefill worker ...
        await _until(lambda: _stats(client)["p-0"]["num_steps"] > before["p-0"]["num_steps"])
        second = asyncio.ensure_future(_collect(client, [7, 8, 9, 10], GREEDY))
        await asyncio.sleep(0.1)  # ... and the second is queued behind it
        stats = ray.get(disagg.stats.remote())["instances"]["p-0"]
        assert stats["num_pending"] == 1 and stats["num_running"] == 1
        for rid in await _live_ids(disagg):
            ray.get(disagg.abort.remote(rid))
        return await first, await second

    a, b = asyncio.run(run())
    for out in (a, b):
        assert out.outputs[0].finish_reason == "abort"
    after = _stats(client)
    assert after["d-0"]["num_requests_added"] == before["d-0"]["num_requests_added"]


def test_abort_while_transferring(disagg: Any, client: ClusterClient) -> None:
    ray.get(disagg.set_fault_injection.remote("d-0", TIMEOUT_S / 2, 0.0))  # slow, in time

    async def run() -> Any:
        task = asyncio.ensure_future(_collect(client, _prompts(1, 2)[0] + [4] * 30, GREEDY))
        await _until(lambda: _stats(client)["d-0"]["num_waiting_for_remote_kvs"] == 1)
        (rid,) = await _live_ids(disagg)
        assert ray.get(disagg.abort.remote(rid))
        return await task

    out = asyncio.run(run())
    assert out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) == 1  # only the prefill instance's token
    # The load was still writing into the decode blocks: they are freed once it ends
    # (checked by the leak check after the test).


def test_abort_while_decoding(disagg: Any, client: ClusterClient) -> None:
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def run() -> Any:
        got: list[int] = []
        aborted = False
        async for out in client.generate_async(_prompts(1, 4)[0], params):
            got.extend(out.outputs[0].new_token_ids)
            if len(got) >= 5 and not out.finished and not aborted:
                (rid,) = await _live_ids(disagg)
                assert ray.get(disagg.abort.remote(rid))
                aborted = True
            if out.finished:
                return out
        raise AssertionError("the stream ended without a final output")

    out = asyncio.run(run())
    assert out.outputs[0].finish_reason == "abort"
    assert 5 <= len(out.outputs[0].token_ids) < 400


def test_client_leaving_early_aborts(disagg: Any, client: ClusterClient) -> None:
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def run() -> None:
        async for out in client.generate_async(_prompts(1, 6)[0], params):
            if len(out.outputs[0].token_ids) >= 3:
                break

    asyncio.run(run())  # the leak check waits for the cluster to drop the request


@pytest.mark.parametrize("abort_first", [False, True])
def test_an_abort_sent_right_after_submit_reaches_the_request(
    disagg: Any, abort_first: bool
) -> None:
    """No polling for the request to arrive: an abort sent after ``submit`` (before it
    returned) ends it, and the client's stream gets its end -- also when Ray runs the abort
    first (it does not keep an async actor's calls in order; ``abort_first`` forces it)."""
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    rid = f"early-{abort_first}"
    request = Request(rid, _prompts(1, 9)[0], long)
    if abort_first:
        assert ray.get(disagg.abort.remote(rid)) is False  # not there yet: remembered
        ray.get(disagg.submit.remote(request, rid, None))
    else:
        submitted = disagg.submit.remote(request, rid, None)
        aborted = disagg.abort.remote(rid)
        ray.get([submitted, aborted])
    stream = disagg.subscribe.remote(rid)
    ((tag, final),) = unpack_batch(ray.get(next(stream)))  # the abort's output waited
    assert tag == rid  # no submission tag given: the request id
    ray.get(disagg.unsubscribe.remote(rid))
    assert final.request_id == rid and final.finish_reason is not None
    assert final.finish_reason.value == "abort"


def test_operators_see_where_requests_are(disagg: Any, client: ClusterClient) -> None:
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[Any, dict[str, Any], dict[str, Any]]:
        live: dict[str, Any] = {}
        async for out in client.generate_async(_prompts(1, 10)[0], params, request_id="ops"):
            if not live and len(out.outputs[0].token_ids) >= 3:
                live = await client.live_requests()
                client.abort("ops")
            if out.finished:
                stats = await client.engine_stats()
                return out, live, stats
        raise AssertionError("the stream ended without a final output")

    out, live, stats = asyncio.run(run())
    assert out.outputs[0].finish_reason == "abort"
    assert live["ops"]["instance"] == "d-0" and live["ops"]["phase"] == "decode"
    assert live["ops"]["num_tokens_sent"] >= 3 and live["ops"]["num_moves"] == 0
    assert set(stats["instances"]) == {"p-0", "d-0"}
    assert stats["instances"]["p-0"]["num_kv_saves_started"] >= 1
    history = asyncio.run(client.transfer_history())
    assert history["d-0"] and all(r.req_id for r in history["d-0"])
    assert asyncio.run(client.reset_prefix_cache()) is True


def test_abort_by_the_users_id_ends_every_sample(client: ClusterClient) -> None:
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, n=2)

    async def run() -> Any:
        aborted = False
        async for out in client.generate_async(_prompts(1, 11)[0], params, request_id="par"):
            if not aborted and all(o.token_ids for o in out.outputs):
                client.abort("par")  # the user's id: its samples are "par#0" and "par#1"
                aborted = True
            if out.finished:
                return out
        raise AssertionError("the stream ended without a final output")

    out = asyncio.run(run())
    assert [o.finish_reason for o in out.outputs] == ["abort", "abort"]
    assert all(len(o.token_ids) < 400 for o in out.outputs)


def test_an_abort_before_the_generator_runs_ends_every_sample(client: ClusterClient) -> None:
    """``abort`` from the moment ``generate_async`` is called: nothing is submitted yet (the
    generator runs when iterated), so the central scheduler keeps the user's id and ends each
    sample ``early#i`` as it arrives."""
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, n=2)

    async def run() -> Any:
        stream = client.generate_async(_prompts(1, 12)[0], params, request_id="early")
        client.abort("early")
        final = None
        async for out in stream:
            final = out
        return final

    out = asyncio.run(run())
    assert [o.finish_reason for o in out.outputs] == ["abort", "abort"]
    assert all(not o.token_ids for o in out.outputs)  # ended on arrival


def test_an_abort_from_another_thread_ends_every_sample(client: ClusterClient) -> None:
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, n=2)

    async def run() -> Any:
        aborter = None
        async for out in client.generate_async(_prompts(1, 13)[0], params, request_id="thr"):
            if aborter is None and all(o.token_ids for o in out.outputs):
                aborter = threading.Thread(target=client.abort, args=("thr",))
                aborter.start()
            if out.finished:
                assert aborter is not None
                aborter.join()
                return out
        raise AssertionError("the stream ended without a final output")

    out = asyncio.run(run())
    assert [o.finish_reason for o in out.outputs] == ["abort", "abort"]
    assert all(len(o.token_ids) < 400 for o in out.outputs)


# -- transfer deadlines ----------------------------------------------------------------------
def test_transfer_timeout_recomputes_on_decode(client: ClusterClient, tiny_model: Path) -> None:
    prompt = _prompts(1, seed=8)[0] + [11] * 17
    (expected,) = generate_in_process(tiny_model, [prompt], GREEDY)
    before = _stats(client)
    ray.get(client.handle.set_fault_injection.remote("d-0", 2 * TIMEOUT_S, 0.0))
    started = time.monotonic()
    got = token_ids(client.generate([prompt], GREEDY))[0]
    elapsed = time.monotonic() - started
    after = _stats(client)
    assert got == expected
    # The decode instance recomputed the whole prompt (and the prefill instance's token).
    d_after, d_before = after["d-0"], before["d-0"]
    computed = d_after["num_prompt_tokens_computed"] - d_before["num_prompt_tokens_computed"]
    assert computed == len(prompt)
    assert elapsed < 2 * TIMEOUT_S + 10  # bounded by the deadline, not by the slow fetch
    history = ray.get(client.handle.transfer_history.remote())["d-0"]
    assert not history[-1].ok


@pytest.fixture(scope="module")
def conditional(ray_cluster: RayCluster, tiny_model: Path) -> Iterator[Any]:
    """Prompts of 24+ uncached tokens go through prefill; a failed transfer fails the request."""
    config = cluster_config(
        tiny_model,
        [PREFILL, DECODE],
        router={"disaggregation": 24},
        kv_transfer={"timeout_s": TIMEOUT_S, "failure_policy": "fail"},
    )
    handle = build_cluster(config, name="conditional", namespace="tandem-tests")
    yield handle
    shutdown_cluster(handle)


def test_conditional_disaggregation(conditional: Any) -> None:
    client = ClusterClient(conditional)
    short, long = [3, 4, 5, 6, 7], _prompts(1, seed=9)[0] + [12] * 30
    before = _stats(client)
    client.generate([short], GREEDY)
    middle = _stats(client)
    assert middle["p-0"]["num_requests_added"] == before["p-0"]["num_requests_added"]
    assert middle["d-0"]["num_prompt_tokens_computed"] - before["d-0"][
        "num_prompt_tokens_computed"
    ] == len(short)
    client.generate([long], GREEDY)
    after = _stats(client)
    assert after["p-0"]["num_requests_added"] == middle["p-0"]["num_requests_added"] + 1
    assert after["d-0"]["num_prompt_tokens_computed"] == middle["d-0"]["num_prompt_tokens_computed"]
    # The same long prompt again: its prefix is cached on the decode instance? No: the decode
    # instance loaded it, so its blocks are in its prefix cache and the uncached part is short.
    client.generate([long], GREEDY)
    again = _stats(client)
    assert again["p-0"]["num_requests_added"] == after["p-0"]["num_requests_added"]


def test_fail_policy_returns_an_error(conditional: Any) -> None:
    client = ClusterClient(conditional)
    ray.get(conditional.set_fault_injection.remote("d-0", 2 * TIMEOUT_S, 0.0))
    (out,) = client.generate([_prompts(1, seed=10)[0] + [13] * 40], GREEDY)
    sample = out.outputs[0]
    assert sample.finish_reason == "error"
    assert sample.error is not None and "KV load failed" in sample.error
    assert len(sample.token_ids) == 1  # the first token came from the prefill instance


# -- helpers ---------------------------------------------------------------------------------
async def _until(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.02)


async def _live_ids(handle: Any) -> list[str]:
    ids: list[str] = await handle.live_request_ids.remote()
    return ids


def test_wait_until_helper_fails_when_never_true() -> None:
    with pytest.raises(AssertionError, match="timed out"):
        wait_until(lambda: False, timeout_s=0.05)
