"""Rebuild a model's tokenizer from GGUF metadata as a ``tokenizers.Tokenizer``: byte-level BPE
(``tokenizer.ggml.model == "gpt2"``, with the pre-tokenizer named by ``tokenizer.ggml.pre``) or
SentencePiece-style BPE (``"llama"``, merges rebuilt from the scores, byte fallback).
"""

from __future__ import annotations

import logging
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors
from tokenizers import pre_tokenizers as pre

from actors.model.gguf_file import Source, _as_file

__all__ = ["gguf_tokenizer"]

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

# Split patterns of byte-level BPE families (applied before the byte-to-unicode mapping).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")
# ``tokenizer.ggml.pre`` names that llama.cpp (llama-vocab.cpp) splits as Qwen2 / Llama 3 do,
# e.g. DeepSeek-R1-Distill-Qwen files say "deepseek-r1-qwen". The Llama 3 ones also take a
# word the vocabulary holds whole without merging, and add BOS unless the file says otherwise;
# "smaug-bpe" only splits as Llama 3 does.
_QWEN2_PRES = ("qwen2", "deepseek-r1-qwen", "megrez", "kormo")
_LLAMA3_PRES = ("llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral")
_LLAMA3_SPLIT_PRES = (*_LLAMA3_PRES, "smaug-bpe")


def _byte_level(pre_name: str) -> tuple[pre.PreTokenizer, normalizers.Normalizer | None]:
    """Pre-tokenizer (and normalizer) for ``tokenizer.ggml.pre``; unknown names get GPT-2's."""
    gpt2 = pre.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_name in ("smollm", "starcoder", "refact"):
        # Every digit is its own pre-token, then GPT-2's regex.
        return pre.Sequence([pre.Digits(individual_digits=True), gpt2]), None
    if pre_name in _QWEN2_PRES or pre_name in _LLAMA3_SPLIT_PRES:
        pattern = _QWEN2_SPLIT if pre_name in _QWEN2_PRES else _LLAMA3_SPLIT
        split = pre.Split(Regex(pattern), "isolated")
        no_regex = pre.ByteLevel(add_prefix_space=False, use_regex=False)
        return pre.Sequence([split, no_regex]), normalizers.NFC() if pre_name == "qwen2" else None
    if pre_name not in ("default", "gpt2"):
        logger.warning("unknown tokenizer.ggml.pre %r; using the GPT-2 split pattern", pre_name)
    return gpt2, None


def _spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges for a SentencePiece vocabulary: every split of a normal piece into two
    pieces, ranked by the merged piece's score (higher scores merge first)."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] == TokenType.NORMAL}
    ranked: list[tuple[float, int, str, str]] = []
    for piece, i in ids.items():
        for k in range(1, len(piece)):
            if piece[:k] in ids and piece[k:] in ids:
                ranked.append((-scores[i], i, piece[:k], piece[k:]))
    ranked.sort()
    return [(a, b) for _, _, a, b in ranked]


def _build_model(md: dict[str, Any]) -> Tokenizer:
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types: list[int] = md.get("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # some files repeat a string; the first id wins
    kind = md.get("tokenizer.ggml.model")
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
        pre_name = str(md.get("tokenizer.ggml.pre", "default"))
        tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre_name in _LLAMA3_PRES))
        tok.pre_tokenizer, normalizer = _byte_level(pre_name)
        if normalizer is not None:
            tok.normalizer = normalizer
        tok.decoder = decoders.ByteLevel()
        return tok
    if kind == "llama":
        scores = md.get("tokenizer.ggml.scores", [0.0] * len(tokens))
        unk_id = md.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if unk_id is not None else None
        model = models.BPE(
            vocab, _spm_merges(tokens, types, scores), unk_token=unk, fuse_unk=True,
            byte_fallback=True,
        )  # fmt: skip
        tok = Tokenizer(model)
        prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
        tok.pre_tokenizer = pre.Metaspace("▁", "first" if prefix else "never", split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
        return tok
    raise ValueError(f"unsupported tokenizer.ggml.model {kind!r} (supported: 'gpt2', 'llama')")


def gguf_tokenizer(src: Source) -> tuple[Tokenizer, dict[str, Any]]:
    """Build a ``tokenizers.Tokenizer`` from the GGUF vocabulary, plus its settings.

    Supports ``tokenizer.ggml.model`` "gpt2" (byte-level BPE; split pattern from
    ``tokenizer.ggml.pre``: smollm/starcoder/refact, qwen2, llama-bpe, default/gpt2, anything
    else falls back to GPT-2's with a warning) and "llama" (SentencePiece BPE with byte
    fallback; merges rebuilt from the piece scores). Control and user-defined tokens become
    special added tokens: encoded whole, dropped by ``decode(..., skip_special_tokens=True)``.
    ``encode(text)`` adds BOS/EOS only when the file asks for it (``add_bos_token`` below).
    The dict holds ``bos_token_id``, ``eos_token_id``, ``pad_token_id``, ``bos_token``,
    ``eos_token`` (str | None), ``add_bos_token`` (bool) and ``chat_template`` (str | None).
    """
    md = _as_file(src).metadata
    if "tokenizer.ggml.tokens" not in md:
        raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types: list[int] = md.get("tokenizer.ggml.token_type", [])
    tok = _build_model(md)
    special = (TokenType.CONTROL, TokenType.USER_DEFINED)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=False)
            if k in special
        ]
    )
    bos_id, eos_id = md.get("tokenizer.ggml.bos_token_id"), md.get("tokenizer.ggml.eos_token_id")
    bos = tokens[bos_id] if bos_id is not None else None
    eos = tokens[eos_id] if eos_id is not None else None
    # llama.cpp's default when the file does not say: SentencePiece and the Llama 3 family add BOS.
    kind, pre_name = md["tokenizer.ggml.model"], str(md.get("tokenizer.ggml.pre", "default"))
    bos_default = kind == "llama" or (kind == "gpt2" and pre_name in _LLAMA3_PRES)
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", bos_default))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    edges = [(bos, bos_id, add_bos), (eos, eos_id, add_eos)]
    if any(add and t is not None for t, _, add in edges):
        head = f"{bos}:0 " if add_bos and bos is not None else ""
        tail = f" {eos}:0" if add_eos and eos is not None else ""
        tok.post_processor = processors.TemplateProcessing(
            single=f"{head}$A:0{tail}",
            pair=f"{head}$A:0{tail} $B:1",
            special_tokens=[
                (t, i) for t, i, add in edges if add and t is not None and i is not None
            ],
        )
    return tok, {
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": add_bos,
        "chat_template": md.get("tokenizer.chat_template"),
    }
