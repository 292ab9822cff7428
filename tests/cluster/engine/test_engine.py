"""The in-process engine end to end on tiny random checkpoints: greedy output equals
transformers' ``generate``, and prefix caching, preemption, chunking and seeds keep it exact."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from cluster import LLM, SamplingParams
from tests.actors.conftest import transformers

PROMPT_LENGTHS = [5, 23, 11, 40, 2, 17]


def make_prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    for p in prompts:  # one at a time: no padding in the reference
        with torch.no_grad():
            seq = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
            )
        outs.append(seq[0, len(p) :].tolist())
    return outs


_ENGINES: list[LLM] = []


def engine(model_dir: Path, **kw: object) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 256)
    llm = LLM(str(model_dir), dtype="float32", progress=False, **kw)
    _ENGINES.append(llm)
    return llm


@pytest.fixture(autouse=True)
def _nothing_left_behind() -> Iterator[None]:
    """Every scenario ends with no request anywhere and every KV block back in the pool."""
    _ENGINES.clear()
    yield
    for llm in _ENGINES:
        sched = llm.engine.scheduler
        sched.check_integrity()
        if sched.finished_req_ids and not sched.requests:  # the last ends: the workers hear
            llm.engine.step()  # of them at the next step (a loop steps while has_requests)
        assert not sched.has_requests() and not llm.engine.has_unfinished_requests()
        assert llm.engine.worker.health()["num_requests"] == 0
        assert sched.kv_cache_manager.usage == 0.0
        assert llm.engine.worker.health()["ok"]
    _ENGINES.clear()


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_greedy_equals_transformers_generate(arch: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(arch)
    prompts = make_prompts()
    ref = hf_greedy(model_dir, prompts, 32)
    outs = engine(model_dir).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for i, (out, expected) in enumerate(zip(outs, ref, strict=True)):
        assert out.outputs[0].token_ids == expected, f"prompt {i}"
        assert out.outputs[0].finish_reason == "length"


def test_chunked_prefill_and_small_budget_same_tokens(tiny_llama: Path) -> None:
    prompts = make_prompts(1)
    base = engine(tiny_llama).generate(prompts, GREEDY)
    chunked = engine(tiny_llama, max_num_batched_tokens=8, max_num_seqs=3).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in chunked] == [o.outputs[0].token_ids for o in base]


def test_preemption_and_resume_same_greedy_tokens(tiny_llama: Path) -> None:
    prompts = make_prompts(2)
    base = engine(tiny_llama).generate(prompts, GREEDY)
    # 30 blocks of 4 tokens cannot hold six ~50-token sequences: requests get preempted.
    small = engine(tiny_llama, num_blocks=30, max_model_len=100)
    outs = small.generate(prompts, GREEDY)
    assert small.engine.scheduler.make_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    sched = small.engine.scheduler
    sched.check_integrity()
    assert sched.kv_cache_manager.usage == 0.0


def test_prefix_cache_hit_same_output(tiny_llama: Path) -> None:
    llm = engine(tiny_llama)
    prompt = make_prompts(3)[3]  # 40 tokens: 10 full blocks
    first = llm.generate(prompt, GREEDY)[0]
    second = llm.generate([*prompt, 1, 2, 3], GREEDY)[0]
    again = llm.generate(prompt, GREEDY)[0]
    assert again.num_cached_tokens >= 36
    assert second.num_cached_tokens >= 36
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    fresh = engine(tiny_llama, enable_prefix_caching=False).generate([*prompt, 1, 2, 3], GREEDY)
    assert second.outputs[0].token_ids == fresh[0].outputs[0].token_ids


def test_seed_same_text_alone_and_in_batch_of_8(tiny_llama: Path) -> None:
    llm = engine(tiny_llama)
    prompts = make_prompts(4)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompts[1], seeded)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=0.8, seed=s, max_tokens=20, ignore_eos=True) for s in range(7)
    ]
    batch_prompts = [prompts[0], prompts[1], *[prompts[i % 6] for i in range(2, 8)]]
    batch_params = [others[0], seeded, *others[1:7]]
    assert len(batch_prompts) == 8
    batch = llm.generate(batch_prompts, batch_params)
    assert batch[1].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True)
    draws = {tuple(llm.generate(prompts[1], unseeded)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(draws) > 1  # without a seed the samples differ (so the check above can fail)


def test_n_samples_and_stop_strings(tiny_llama: Path) -> None:
    llm = engine(tiny_llama)
    prompt = make_prompts(5)[1]
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    # A stop string taken from the greedy text ends generation there (excluded from text).
    text = llm.generate(prompt, GREEDY)[0].outputs[0].text
    # The first 3-character piece at position >= 4 that does not occur earlier.
    at = next(i for i in range(4, len(text) - 3) if text.find(text[i : i + 3]) == i)
    stop = text[at : at + 3]
    stopped = llm.generate(prompt, GREEDY.model_copy(update={"stop": (stop,)}))[0].outputs[0]
    assert stopped.text == text[:at]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    sched = llm.engine.scheduler
    assert not sched.requests and sched.kv_cache_manager.usage == 0.0


def test_a_stop_token_is_not_text_unless_asked(tiny_llama: Path) -> None:
    """vLLM's rule: the token that stops a request (EOS, a stop_token_ids entry) stays in
    token_ids but not in the text, unless include_stop_str_in_output (it shows for a stop id
    that is no special token: the tiny byte tokenizer has none)."""
    llm = engine(tiny_llama)
    prompt = make_prompts(5)[2]
    tokens = llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    at = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    params = GREEDY.model_copy(update={"stop_token_ids": (tokens[at],)})
    stopped = llm.generate(prompt, params)[0].outputs[0]
    tok = llm.get_tokenizer()
    assert stopped.token_ids == tokens[: at + 1] and stopped.stop_reason == tokens[at]
    assert stopped.text == tok.decode(tokens[:at])
    kept = params.model_copy(update={"include_stop_str_in_output": True})
    assert llm.generate(prompt, kept)[0].outputs[0].text == tok.decode(tokens[: at + 1])


def test_stream_and_abort(tiny_llama: Path) -> None:
    llm = engine(tiny_llama)
    prompts = make_prompts(6)[:3]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    seen: dict[str, list[int]] = {}
    finals: dict[str, str | None] = {}
    for out in llm.generate_stream(prompts, params):
        seen.setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
        if len(seen[out.request_id]) == 5 and out.request_id == "1":
            llm.abort("1")
        if out.finished:
            finals[out.request_id] = out.outputs[0].finish_reason
    assert finals == {"0": "length", "1": "abort", "2": "length"}
    assert len(seen["0"]) == 30 and len(seen["1"]) == 5
    sched = llm.engine.scheduler
    sched.check_integrity()
    assert not sched.requests and sched.kv_cache_manager.usage == 0.0


def test_an_abort_while_a_stream_holds_the_requests_step_output(tiny_llama: Path) -> None:
    """Aborting a request whose output of this step the stream has not yielded yet: that
    delta still comes (the abort cleared it in place), and the request ends once (the
    abort's own final came again after it)."""
    llm = engine(tiny_llama)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    deltas: dict[str, list[int]] = {}
    finals: dict[str, list[tuple[str | None, list[int]]]] = {}
    aborted = None
    for out in llm.generate_stream(make_prompts(6)[:3], params):
        rid = out.request_id
        deltas.setdefault(rid, []).extend(out.outputs[0].new_token_ids)
        if aborted is None and len(deltas[rid]) == 5:
            aborted = "2" if rid != "2" else "1"  # one the step's output list has after it
            llm.abort(aborted)
        if out.finished:
            finals.setdefault(rid, []).append(
                (out.outputs[0].finish_reason, list(out.outputs[0].token_ids))
            )
    assert all(len(f) == 1 for f in finals.values()), finals
    assert finals[aborted][0][0] == "abort"
    assert {rid: f[0][1] for rid, f in finals.items()} == deltas


def test_stream_left_early_aborts_the_rest(tiny_llama: Path) -> None:
    llm = engine(tiny_llama)
    stream = llm.generate_stream(make_prompts(7)[:2], GREEDY)
    next(stream)
    stream.close()
    sched = llm.engine.scheduler
    assert not sched.requests and sched.kv_cache_manager.usage == 0.0
    assert not llm.engine.processor.requests


def test_bad_inputs_are_refused(tiny_llama: Path) -> None:
    llm = engine(tiny_llama, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([1] * 64, GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([1, 999], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, GREEDY)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine(tiny_llama, max_model_len=10_000)


def test_a_sliding_window_caps_the_context_and_within_it_matches_transformers(
    tmp_path: Path,
) -> None:
    """Attention here spans the whole context: the same as a sliding window's while the context
    fits in it, so a window smaller than max_position_embeddings caps max_model_len there (as
    vLLM's --disable-sliding-window does) and the output matches transformers' windowed model
    up to it. Past the window they would differ."""
    from tests.actors.conftest import make_checkpoint

    window = 24
    path = make_checkpoint(tmp_path / "mistral", "mistral", sliding_window=window)
    llm = engine(path)
    assert llm.engine.max_model_len == window  # not max_position_embeddings (512)
    prompts = [p[:12] for p in make_prompts(3)]
    params = SamplingParams(temperature=0.0, max_tokens=window - 12, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs == hf_greedy(path, prompts, window - 12)
    with pytest.raises(ValueError, match="sliding window"):
        engine(path, max_model_len=window + 1)


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_rope_scaling_stretches_the_context_and_matches_transformers_past_it(
    tmp_path: Path, kind: str
) -> None:
    """A linear or yarn rope scaling serves its factor times the positions (vLLM derives the
    same length: Qwen2.5's yarn x4 serves 128k): past max_position_embeddings the output
    still matches transformers'. The context stopped at max_position_embeddings."""
    from tests.actors.conftest import make_checkpoint

    scaling: dict[str, Any] = {"rope_type": kind, "factor": 2.0, "rope_theta": 10000.0}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = 32
    path = make_checkpoint(
        tmp_path / kind, "llama", max_position_embeddings=32, rope_parameters=scaling
    )
    llm = engine(path)
    assert llm.engine.max_model_len == 64
    prompts = [p[:20] for p in make_prompts(4)[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # to position 59
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs == hf_greedy(path, prompts, 40)
    with pytest.raises(ValueError, match="rope scaling"):
        engine(path, max_model_len=65)


def test_logprobs_through_the_engine(tiny_llama: Path) -> None:
    llm = engine(tiny_llama)
    prompt = make_prompts(8)[2]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    sample = llm.generate(prompt, params)[0].outputs[0]
    assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids) == 6
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + sample.token_ids])).logits[0, len(prompt) - 1 : -1]
    expected = logits.log_softmax(-1)
    for pos, (token, entry) in enumerate(zip(sample.token_ids, sample.logprobs, strict=True)):
        top3 = expected[pos].topk(3).indices.tolist()
        assert list(entry)[:3] == top3 and token == top3[0]  # greedy: the best is sampled
        for tid, lp in entry.items():
            assert abs(lp - expected[pos, tid].item()) <= 1e-4


def test_streamed_deltas_never_show_a_stop_string(tiny_llama: Path) -> None:
    """A stop string that spans tokens is held back while it could still match, so the
    streamed deltas add up to the final text."""
    llm = engine(tiny_llama)
    prompt = make_prompts(9)[3]
    text = llm.generate(prompt, GREEDY)[0].outputs[0].text
    at = next(i for i in range(4, len(text) - 3) if text.find(text[i : i + 3]) == i)
    params = GREEDY.model_copy(update={"stop": (text[at : at + 3],)})
    streamed, final = "", None
    for out in llm.generate_stream(prompt, params):
        streamed += out.outputs[0].new_text
        final = out.outputs[0]
    assert final is not None and final.finish_reason == "stop"
    assert streamed == final.text == text[:at]
    # min_tokens: the stop string is ignored until that many tokens exist (vLLM's rule).
    late = GREEDY.model_copy(update={"stop": (text[at : at + 3],), "min_tokens": 30})
    assert llm.generate(prompt, late)[0].outputs[0].finish_reason == "length"


def test_child_id_collisions_are_refused_without_side_effects(tiny_llama: Path) -> None:
    eng = engine(tiny_llama).engine
    eng.add_request("x", [1, 2, 3], SamplingParams(n=2, max_tokens=3, temperature=1.0))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("x#0", [4, 5], SamplingParams(max_tokens=3))
    eng.add_request("y#1", [4, 5], SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("y", [6], SamplingParams(n=2, max_tokens=3))
    finished = set()
    while eng.has_unfinished_requests():
        finished |= {o.request_id for o in eng.step() if o.finished}
    assert finished == {"x", "y#1"} and eng.get_num_unfinished_requests() == 0


def test_interleaved_streams_lose_nothing(tiny_llama: Path) -> None:
    llm = engine(tiny_llama)
    prompts = make_prompts(10)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts[:2], params)]
    stream = llm.generate_stream(prompts[0], params)
    first = next(stream)
    tokens = list(first.outputs[0].new_token_ids)
    other = llm.generate(prompts[1], params)  # steps the engine while the stream is paused
    finals = []
    for out in stream:
        tokens += out.outputs[0].new_token_ids
        if out.finished:
            finals.append(out)
    assert len(finals) == 1 and tokens == alone[0]
    assert other[0].outputs[0].token_ids == alone[1]


def test_two_streams_of_several_prompts_advanced_in_turn(tiny_llama: Path) -> None:
    """Each stream pauses between two outputs of one step; the other steps the engine, which
    updates the paused one's unyielded outputs in place: their deltas went missing or came
    twice (a stream's deltas must add up to its final tokens)."""
    llm = engine(tiny_llama)
    prompts = make_prompts(11)[:4]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    streams = [llm.generate_stream(prompts[:2], params), llm.generate_stream(prompts[2:], params)]
    deltas: list[dict[str, list[int]]] = [{}, {}]
    finals: list[dict[str, list[int]]] = [{}, {}]
    live = [0, 1]
    while live:
        for i in list(live):
            out = next(streams[i], None)
            if out is None:
                live.remove(i)
                continue
            deltas[i].setdefault(out.request_id, []).extend(out.outputs[0].new_token_ids)
            if out.finished:
                finals[i][out.request_id] = list(out.outputs[0].token_ids)
    assert deltas == finals
    assert [finals[0][k] for k in sorted(finals[0])] + [
        finals[1][k] for k in sorted(finals[1])
    ] == alone


def test_prompt_logprobs_equal_transformers(tiny_llama: Path) -> None:
    """Every prompt token's logprob, rank and top-k equal transformers' log-softmax on the same
    weights -- whole, in chunks of a small token budget, and for a prompt whose blocks sit in
    the prefix cache (such a request computes its whole prompt: no hit)."""
    # (150 tokens: logits are taken 64 positions at a time.)
    prompts = [*make_prompts(9)[:4], torch.randint(3, 256, (150,)).tolist()]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    runs = [
        engine(tiny_llama).generate(prompts, params),
        engine(tiny_llama, max_num_batched_tokens=8, max_num_seqs=4).generate(prompts, params),
    ]
    cached = engine(tiny_llama)
    cached.generate(prompts, GREEDY.model_copy(update={"max_tokens": 1}))  # fill the cache
    runs.append(cached.generate(prompts, params))
    assert all(o.num_cached_tokens == 0 for o in runs[2])
    for outputs in runs:
        for prompt, out in zip(prompts, outputs, strict=True):
            with torch.no_grad():
                ref = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
            got = out.prompt_logprobs
            assert got is not None and len(got) == len(prompt) and got[0] is None
            for position in range(1, len(prompt)):
                entry = got[position]
                assert entry is not None
                values, rank = entry
                row, token = ref[position - 1], prompt[position]
                assert values[token] == pytest.approx(row[token].item(), abs=1e-4)
                assert rank == int((row >= row[token]).sum())  # vLLM's: ties count ahead
                assert set(row.topk(3).indices.tolist()) <= set(values)
    # Asked for nothing: nothing computed or sent. With n > 1, one sample computes them.
    assert engine(tiny_llama).generate(prompts[:1], GREEDY)[0].prompt_logprobs is None
    fanned = engine(tiny_llama).generate(prompts[:1], params.model_copy(update={"n": 3}))[0]
    assert fanned.prompt_logprobs == runs[0][0].prompt_logprobs


def test_calls_without_sampling_params_use_the_models_generation_config(tmp_path: Path) -> None:
    """vLLM's ``LLM`` (``generation_config="auto"``): ``generate`` / ``chat`` without
    ``sampling_params`` sample with the model's ``generation_config.json``, not temperature 1
    and 16 tokens (what they got here); ``vllm`` turns that off."""
    import json

    from tests.actors.conftest import make_checkpoint

    path = make_checkpoint(tmp_path / "tuned", "llama")
    (path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "top_k": 20, "max_new_tokens": 5})
    )
    llm = engine(path)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 20, 5)
    prompt = make_prompts(11)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    expected = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    assert llm.generate(prompt)[0].outputs[0].token_ids == expected
    usual = engine(path, generation_config="vllm").get_default_sampling_params()
    assert usual == SamplingParams()
