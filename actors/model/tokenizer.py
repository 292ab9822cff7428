"""Tokenizer, chat template and incremental detokenizer, from ``tokenizer.json`` or GGUF metadata.

Built on the ``tokenizers`` library only (no transformers at run time).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from actors.model.chat_template import render_chat


class Tokenizer:
    """Encode / decode text and render chat prompts for one model."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos_token: bool,
        chat_template: str | None,
        bos_token: str = "",
        eos_token: str = "",
    ) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_path(cls, path: Path) -> Tokenizer:
        """A model directory (tokenizer.json + tokenizer_config.json) or a GGUF file."""
        if path.is_file() and path.suffix.lower() == ".gguf":
            from actors.model.gguf_tokenizer import gguf_tokenizer

            tok, info = gguf_tokenizer(path)
            return cls(
                tok,
                bos_token_id=info.get("bos_token_id"),
                eos_token_id=info.get("eos_token_id"),
                add_bos_token=bool(info.get("add_bos_token", False)),
                chat_template=info.get("chat_template"),
                bos_token=info.get("bos_token") or "",
                eos_token=info.get("eos_token") or "",
            )
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json")
        tok = HFTokenizer.from_file(str(file))
        conf: dict[str, Any] = {}
        if (path / "tokenizer_config.json").is_file():
            conf = json.loads((path / "tokenizer_config.json").read_text())
        template = conf.get("chat_template")
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        bos, eos = _token_str(conf.get("bos_token")), _token_str(conf.get("eos_token"))
        return cls(
            tok,
            bos_token_id=tok.token_to_id(bos) if bos else None,
            eos_token_id=tok.token_to_id(eos) if eos else None,
            # tokenizer.json's post-processor already adds BOS where the model wants it.
            add_bos_token=False,
            chat_template=template if isinstance(template, str) else None,
            bos_token=bos or "",
            eos_token=eos or "",
        )

    @property
    def backend(self) -> HFTokenizer:
        """The ``tokenizers`` tokenizer underneath (grammars read its vocabulary)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can stand for, where that is bounded: a
        byte-level BPE (by its pre-tokenizer, or byte fallback) with no normalizer and no added
        token that swallows whitespace -- then every token is one vocabulary piece at least as
        long as the text it matches, so the longest piece (or decoded token) bounds it. None
        where one token can stand for any amount of text (WordPiece's or Unigram's unknown
        token, a normalizer that deletes or merges characters, an ``lstrip`` special token)."""
        tok = self._tok
        byte_level = "ByteLevel" in str(tok.pre_tokenizer) or bool(
            getattr(tok.model, "byte_fallback", False)
        )
        stripping = any(a.lstrip or a.rstrip for a in tok.get_added_tokens_decoder().values())
        if type(tok.model).__name__ != "BPE" or not byte_level or tok.normalizer or stripping:
            return None
        longest = 1
        for token_id in range(self.vocab_size):
            text = tok.decode([token_id], skip_special_tokens=False)
            piece = tok.id_to_token(token_id) or ""
            longest = max(longest, len(text), len(piece))
        return longest

    def max_chars(self, num_tokens: int) -> int | None:
        """No text longer than this tokenizes to ``num_tokens`` tokens or fewer (so a longer
        prompt can be refused without tokenizing it); None where there is no such bound."""
        chars = self.max_token_chars
        return None if chars is None else num_tokens * chars

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The batch call releases the GIL while it runs (``encode`` holds it: a long prompt
        # would stall every other thread of the process) and skips the offsets we never use.
        encoded = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        ids: list[int] = encoded[0].ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def id_to_token(self, token_id: int) -> str | None:
        token: str | None = self._tok.id_to_token(token_id)
        return token

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for. A token holding part of a character (byte-level
        BPE splits an emoji into several) decodes to U+FFFD alone; its bytes are its piece's
        (GPT-2's byte alphabet, or SentencePiece's ``<0xNN>`` byte fallback), so a client
        that joins a reply's tokens' bytes gets its text back (the OpenAI API's ``bytes``)."""
        piece = self._tok.id_to_token(token_id)
        if piece is not None and token_id not in self._added_ids:
            alphabet = self._byte_alphabet
            if alphabet is not None and all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            if alphabet is None:  # SentencePiece: "<0xNN>" bytes, "▁" for a space
                byte = piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6
                if byte and getattr(self._tok.model, "byte_fallback", False):
                    with contextlib.suppress(ValueError):
                        return bytes([int(piece[3:5], 16)])
                if "▁" in piece:
                    return piece.replace("▁", " ").encode()
        return self.decode([token_id], skip_special_tokens=False).encode()

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self._tok.get_added_tokens_decoder())

    @functools.cached_property
    def _byte_alphabet(self) -> dict[str, int] | None:
        """Byte-level BPE's piece characters to the bytes they stand for (None: the
        tokenizer is not byte-level)."""
        if "ByteLevel" not in str(self._tok.decoder):
            return None
        return {char: byte for byte, char in _byte_level_chars().items()}

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's template (an error if it has none);
        ``kwargs`` override the defaults (``bos_token``, ``eos_token``), as vLLM's
        ``chat_template_kwargs`` do."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        options = {"bos_token": self.bos_token, "eos_token": self.eos_token, **kwargs}
        return render_chat(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt, **options
        )

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        # The template writes BOS itself when the model wants one.
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character -- printable Latin-1
    bytes as themselves, the others (controls, space, ...) as the characters from U+0100 on,
    in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(0x100 + extra)
            extra += 1
    return chars


def _prompt_suffix(tokenizer: Tokenizer, prompt_ids: Sequence[int]) -> list[int]:
    """The shortest tail of the prompt, 4 to 23 tokens, that decodes to whole characters (no
    U+FFFD: an output's first delta must not complete a character the prompt began); the
    whole prompt when it is that short and clean; none when no such tail exists."""
    ids = list(prompt_ids)
    for n in range(min(4, len(ids)), min(len(ids), 23) + 1):
        tail = ids[-n:]
        if n and "\ufffd" not in tokenizer.decode(tail, skip_special_tokens=False):
            return tail
    return []


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value) if value is not None else None


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding from the start and
    without emitting half of a multi-byte character (held back while it decodes to U+FFFD)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        """``prompt_ids``: the prompt the outputs continue. Its last few tokens prime the
        window (vLLM's ``FastIncrementalDetokenizer`` does the same), so the first output
        token renders as it does inside the full text: a SentencePiece decoder strips the
        leading space of a decoded text (``Strip(" ", 1, 0)``), so "▁Paris" decoded alone
        is "Paris", while after the prompt it is " Paris"."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = _prompt_suffix(tokenizer, prompt_ids)
        self.prefix_offset = 0  # window start: context so merges render as in the full text
        self.read_offset = len(self.ids)  # tokens already turned into emitted text

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (may be empty)."""
        self.ids.extend(new_ids)
        tok = self.tokenizer
        skip = self.skip_special_tokens
        prefix = tok.decode(self.ids[self.prefix_offset : self.read_offset], skip)
        full = tok.decode(self.ids[self.prefix_offset :], skip)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete UTF-8 sequence (or nothing visible yet): wait
        delta = full[len(prefix) :]
        self.prefix_offset = self.read_offset  # keep the last chunk as context
        self.read_offset = len(self.ids)
        return delta

    def flush(self) -> str:
        """The text still held back, at the end of the sequence: a tail that decodes to an
        incomplete character (U+FFFD) will not be completed any more, so it goes out as
        decoded -- without this, a sample cut mid-character (``max_tokens`` inside an emoji)
        lost its last characters."""
        tok, skip = self.tokenizer, self.skip_special_tokens
        prefix = tok.decode(self.ids[self.prefix_offset : self.read_offset], skip)
        full = tok.decode(self.ids[self.prefix_offset :], skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if full.startswith(prefix) else ""
