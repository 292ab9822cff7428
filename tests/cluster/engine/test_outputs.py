"""The engine front end: requests built from prompts (``cluster.engine.frontend``) and the
outputs the API's streams are built from (``cluster.engine.outputs``)."""

from __future__ import annotations

import itertools

import pytest

from actors.model.loader import builtin_model_path
from actors.model.tokenizer import Tokenizer
from cluster.engine.outputs import OutputProcessor
from scheduler import EngineCoreOutput, FinishReason, SamplingParams

PROMPT = [1, 2, 3]
PROMPT_LOGPROBS = [None, ({2: -0.5}, 1), ({3: -0.25}, 1)]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_path(builtin_model_path())


def test_samples_wait_for_the_prompt_logprobs_sample_0_computes(tokenizer: Tokenizer) -> None:
    """With n > 1 only sample 0 computes the prompt's logprobs, and another sample can come
    out first (it hit the prefix cache, or ran without a hand-off). Its outputs are held until
    sample 0's first one, so every sample's first output (an echo's first chunk) carries the
    prompt's logprobs; what was held comes out whole, once."""
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(n=2, max_tokens=8, prompt_logprobs=1)
    first, second = processor.add("r", None, PROMPT, params)
    assert processor.process([EngineCoreOutput(second, [400])]) == ([], [])
    assert processor.process([EngineCoreOutput(second, [401])]) == ([], [])
    zero = EngineCoreOutput(first, [500], prompt_logprobs=PROMPT_LOGPROBS)
    (out,), _ = processor.process([zero, EngineCoreOutput(second, [402])])
    assert out.prompt_logprobs == PROMPT_LOGPROBS
    assert [s.new_token_ids for s in out.outputs] == [[500], [400, 401, 402]]
    assert out.outputs[1].new_text == tokenizer.decode([400, 401, 402])
    done = [EngineCoreOutput(c, [7, 8], FinishReason.LENGTH) for c in (first, second)]
    (out,), _ = processor.process(done)  # from then on, nothing is held
    assert out.finished
    assert [s.token_ids for s in out.outputs] == [[500, 7, 8], [400, 401, 402, 7, 8]]
    assert not processor.requests


def test_nothing_is_held_without_prompt_logprobs(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    _, second = processor.add("r", None, PROMPT, SamplingParams(n=2, max_tokens=3))
    (out,), _ = processor.process([EngineCoreOutput(second, [400])])
    assert [s.new_token_ids for s in out.outputs] == [[], [400]]


@pytest.mark.parametrize("min_tokens", [0, 4])
def test_held_outputs_end_a_sample_as_they_would_unheld(
    tokenizer: Tokenizer, min_tokens: int
) -> None:
    """Held outputs are applied one by one, as they came: a stop string and min_tokens end
    the sample where they would without holding (merged, the stop was checked once against
    the whole count: min_tokens let a stop before it end the sample)."""
    ids = tokenizer.encode("hello STOP and then more words", add_special_tokens=False)

    def run(prompt_logprobs: int | None) -> tuple[str, list[int]]:
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(
            n=2,
            max_tokens=32,
            stop=("STOP",),
            min_tokens=min_tokens,
            prompt_logprobs=prompt_logprobs,
        )
        first, second = processor.add("r", None, PROMPT, params)
        processor.process([EngineCoreOutput(second, [t]) for t in ids])
        zero = EngineCoreOutput(first, [500], prompt_logprobs=PROMPT_LOGPROBS)
        outs, _ = processor.process([zero])
        sample = (outs or [processor.requests["r"].output])[0].outputs[1]
        return sample.text, list(sample.token_ids)

    assert run(1) == run(None)
    text, _ = run(1)
    if min_tokens:  # the stop came before min_tokens outputs: it does not count (vLLM)
        assert text == "hello STOP and then more words"
    else:
        assert text == "hello "


def test_ignore_eos_ignores_the_configs_other_eos_ids(tokenizer: Tokenizer) -> None:
    """A config with several EOS ids (Llama 3's three): each stops a request as its EOS does
    -- unless ``ignore_eos``, as in vLLM (they stopped it early, with "stop")."""
    from cluster.engine.frontend import RequestFactory

    eos = tokenizer.eos_token_id
    assert eos is not None
    factory = RequestFactory(tokenizer, vocab_size=49152, max_model_len=64, eos_token_ids=[eos, 7])
    stops = {
        ignore: factory.prepare("r", PROMPT, SamplingParams(ignore_eos=ignore), child_ids=["r"])
        .requests[0]
        .sampling_params.stop_token_ids
        for ignore in (False, True)
    }
    assert 7 in stops[False] and 7 not in stops[True]


def test_an_eos_id_of_0_is_an_eos_id() -> None:
    from types import SimpleNamespace

    from cluster.engine.frontend import RequestFactory

    factory = RequestFactory(
        SimpleNamespace(eos_token_id=0),  # type: ignore[arg-type]
        vocab_size=16,
        max_model_len=64,
        eos_token_ids=[5],
    )
    assert factory.eos_token_id == 0 and factory.extra_stop_ids == (5,)


def test_a_stop_string_inside_the_first_min_tokens_does_not_end_the_sample(
    tokenizer: Tokenizer,
) -> None:
    """Stop strings count from ``min_tokens`` outputs on, each in a window of its own length:
    a short stop written inside the first ``min_tokens`` tokens does not end the sample
    because a longer stop string widened the window (vLLM's rule)."""
    a, newline, b = (tokenizer.encode(t, add_special_tokens=False) for t in ("a", "\n", "b"))
    tokens = [*a, *newline, *b]
    for stops, merged in itertools.product((("\n",), ("\n", "Observation:")), (False, True)):
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(max_tokens=8, stop=stops, min_tokens=len(a + newline))
        (rid,) = processor.add("r", None, PROMPT, params)
        # One by one, or in one output (merged for a reader that fell behind: the cluster's)
        for part in [tokens] if merged else [[t] for t in tokens]:
            processor.process([EngineCoreOutput(rid, part)])
        out = processor.requests["r"].output.outputs[0]
        assert out.finish_reason is None and out.text == "a\nb", (stops, merged)


def test_an_aborted_samples_deltas_add_up_to_its_text(tokenizer: Tokenizer) -> None:
    """Text held back because it could begin a stop string goes out with the abort."""
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=32, stop=("STOPSTOP",))
    (rid,) = processor.add("r", None, PROMPT, params)
    streamed = ""
    for token in tokenizer.encode("hello world", add_special_tokens=False):
        (out,), _ = processor.process([EngineCoreOutput(rid, [token])])
        streamed += out.outputs[0].new_text
    assert processor.abort(["r"]) == [rid]
    (out,), _ = processor.process([])
    streamed += out.outputs[0].new_text
    assert out.outputs[0].finish_reason == "abort"
    assert streamed == out.outputs[0].text == "hello world"


def test_the_stop_that_ends_a_sample_does_not_depend_on_how_its_tokens_were_batched(
    tokenizer: Tokenizer,
) -> None:
    """Stops "abch" and "bc" over the text "gabch": token by token, "bc" completes first and
    ends the sample at "ga". Merged into one output (a reader that fell behind, under load),
    the search over the whole new text chose "abch" (it starts earlier) and ended at "g",
    one token more: a seeded request's text depended on the load."""
    tokens = [tokenizer.encode(ch, add_special_tokens=False)[0] for ch in "gabch"]
    assert tokenizer.decode(tokens) == "gabch"
    ends = []
    for merged in (False, True):
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(max_tokens=8, stop=("abch", "bc"), logprobs=0)
        (rid,) = processor.add("r", None, PROMPT, params)
        logprobs = [{t: -0.5} for t in tokens]
        parts = (
            [(tokens, logprobs)]
            if merged
            else [([t], [lp]) for t, lp in zip(tokens, logprobs, strict=True)]
        )
        streamed = ""
        for part, lps in parts:
            (out,), stopped = processor.process([EngineCoreOutput(rid, part, new_logprobs=lps)])
            streamed += out.outputs[0].new_text
            if stopped:
                break
        sample = out.outputs[0]
        assert streamed == sample.text
        ends.append((sample.text, sample.stop_reason, sample.token_ids, len(sample.logprobs or [])))
    assert ends[0] == ends[1] == ("ga", "bc", tokens[:4], 4)
