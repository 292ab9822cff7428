"""Structured outputs: the grammar a request's output must match, as a token mask per step.

A request's ``SamplingParams.structured_outputs`` (a JSON schema, any JSON object, a regex, a
choice of strings, a Lark or GBNF grammar) becomes an llguidance grammar, compiled once per
spec and cached (``GrammarCompiler``). The worker keeps one ``GrammarState`` per request: a
matcher that has consumed the request's output so far. Each step, the states of the rows that
sample fill one bitmask for the whole batch (a bit per vocabulary entry: allowed or not), the
sampler sends every forbidden token's logit to -inf, and each state then consumes its sampled
token. Once the grammar is complete only EOS is allowed, so the request stops there.

The state is rebuilt from the tokens wherever a request continues: a resume after preemption,
the decode side of a P/D hand-off (prompt + the prefill side's first token), a move after a
fault -- the output so far is all the matcher needs (``GrammarState.sync``).

Why llguidance and not xgrammar (measured on this machine, SmolLM2's 49,152-token vocabulary,
a 3-field object schema): llguidance installs as one 3 MB wheel with no dependencies, while
xgrammar requires triton (about 1 GB on disk) and imports transformers at ``import xgrammar``
(Tandem never imports transformers at run time); llguidance needs no compile step (0.4-0.8 ms
from schema to matcher; xgrammar 4 ms on first compile, cached after); xgrammar's mask is
faster (3 us per row per step against 11-15 us), both far below a step (11.5 ms at batch 1 on
this CPU). vLLM offers both (``guidance`` and ``xgrammar`` backends).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from scheduler.request import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    import torch
    from llguidance._lib import JsonCompileOptions

    from actors.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# JSON is generated compactly (no free whitespace: small models otherwise pad with spaces
# and newlines until max_tokens), with OpenAI's separators.
_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """A structured-outputs spec that cannot be compiled (a 400 at the API)."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``params`` (not yet checked against a tokenizer)."""
    kind, spec = params.key
    if kind == "json":
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS))
        except ValueError as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from exc
    if kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(spec))
    if kind == "choice":
        options = " | ".join(json.dumps(option) for option in json.loads(spec))
        return str(llguidance.LLMatcher.grammar_from_lark(f"start: {options}"))
    # A grammar: GBNF (``root ::= ...``, llama.cpp's and xgrammar's form) or Lark.
    if "::=" in spec:
        try:
            spec = any_to_lark(spec)
        except Exception as exc:
            raise GrammarError(f"invalid GBNF grammar: {exc}") from exc
    return str(llguidance.LLMatcher.grammar_from_lark(spec))


@dataclass(slots=True)
class _Compiled:
    """A spec's checked grammar and a matcher built from it that nothing has fed: requests
    get deep copies (microseconds; building a matcher parses the grammar again)."""

    grammar: str
    template: llguidance.LLMatcher
    size: int  # bytes held, about: spec + grammar text


class GrammarCompiler:
    """The grammars of one model's tokenizer: each spec compiled and checked once, kept in an
    LRU of at most ``max_cached`` specs and ``max_cached_bytes`` of spec and grammar text
    (failures kept as their message), matchers copied from it. A kept matcher holds about
    100 KB beyond its text (measured on a 256-token vocabulary): the count bounds those.
    Thread-safe."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_cached_bytes: int = 32 << 20,
        eos_token_id: int | None = None,
        max_cached: int = 256,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's vocab)
        # The token a complete output ends with: the model's (the requests'), else the
        # tokenizer's.
        self.eos_token_id = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self.max_cached_bytes = max_cached_bytes
        self.max_cached = max_cached
        self._cache: OrderedDict[tuple[str, str], _Compiled | str] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()

    @functools.cached_property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (built once: about 0.2 s for 49k tokens)."""
        return llguidance.LLTokenizer(
            self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_token_id
        )

    def compile(self, params: StructuredOutputsParams) -> str:
        """The checked grammar of ``params``; ``GrammarError`` (a ``ValueError``) naming what
        is wrong with it."""
        return self._compiled(params).grammar

    def state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for one request (nothing consumed yet)."""
        return GrammarState(self._compiled(params).template.deep_copy())

    def _compiled(self, params: StructuredOutputsParams) -> _Compiled:
        key = params.key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
        if cached is None:
            cached = self._compile(params)
            size = 2 * len(key[1]) + (len(cached) if isinstance(cached, str) else cached.size)
            if size <= self.max_cached_bytes // 8:  # a huge spec is compiled each time
                with self._lock:
                    if key not in self._cache:
                        self._cache[key] = cached
                        self._cached_bytes += size
                    while self._cache and (
                        self._cached_bytes > self.max_cached_bytes
                        or len(self._cache) > self.max_cached
                    ):
                        old_key, old = self._cache.popitem(last=False)
                        self._cached_bytes -= 2 * len(old_key[1]) + (
                            len(old) if isinstance(old, str) else old.size
                        )
        if isinstance(cached, str):
            # A fresh exception each time: a cached one would keep every raise's frames
            # (and the requests they hold) alive through its growing traceback.
            raise GrammarError(cached)
        return cached

    def _compile(self, params: StructuredOutputsParams) -> _Compiled | str:
        try:
            grammar = grammar_text(params)
        except GrammarError as exc:
            return str(exc)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.ll_tokenizer
        )
        if is_error:
            return f"invalid {_KIND_NAMES[params.key[0]]}: {messages[0]}"
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            return f"invalid {_KIND_NAMES[params.key[0]]}: {template.get_error()}"
        return _Compiled(grammar, template, 2 * len(grammar))


_compilers: weakref.WeakKeyDictionary[Tokenizer, GrammarCompiler] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler:
    """The one ``GrammarCompiler`` of ``tokenizer`` in this process (the API's checks and
    the request factory share its cache and its llguidance tokenizer), for at least
    ``vocab_size`` logits (a wider one serves a narrower ask: the checks need no mask)."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None or compiler.vocab_size < vocab_size:
            compiler = _compilers[tokenizer] = GrammarCompiler(tokenizer, vocab_size)
        return compiler


_KIND_NAMES = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


class GrammarState:
    """One request's matcher and the output tokens it has consumed."""

    __slots__ = ("broken", "consumed", "matcher")

    def __init__(self, matcher: llguidance.LLMatcher | None) -> None:
        self.matcher = matcher
        self.consumed: list[int] = []
        # No matcher (its spec failed to compile), or a token the grammar refused: no mask
        # any more (logged).
        self.broken = matcher is None

    @property
    def num_consumed(self) -> int:
        return len(self.consumed)

    def extends(self, outputs: Sequence[int]) -> bool:
        """Whether ``outputs`` begin with what it consumed (a resumed request whose matcher
        can stay)."""
        n = len(self.consumed)
        return n <= len(outputs) and list(outputs[:n]) == self.consumed

    def sync(self, req_id: str, outputs: Sequence[int]) -> None:
        """Consume the outputs it has not seen (a new state: all of them)."""
        n = len(self.consumed)
        if self.broken or n >= len(outputs):
            return
        for token in outputs[n:]:
            if not self.accept(req_id, token):
                return

    def accept(self, req_id: str, token: int) -> bool:
        """Feed one sampled token; False once the state is broken."""
        if self.matcher is None or self.broken:
            return False
        if not self.matcher.consume_token(token):
            self.broken = True
            logger.warning(
                "request %s: token %d does not match its grammar (%s); its output is no "
                "longer constrained",
                req_id,
                token,
                self.matcher.get_error(),
            )
        self.consumed.append(token)
        return not self.broken


def fill_bitmask(states: Sequence[GrammarState], vocab_size: int) -> torch.Tensor:
    """One int32 bitmask row per state (bit ``t`` of word ``t // 32``: token ``t`` allowed); a
    broken state's row allows everything. One row after the other, on this thread:
    llguidance's thread pool (``LLExecutor``) measured slower in the engine -- its workers
    spin on the cores the model's next step needs (bench/structured_outputs.py)."""
    import torch  # (here: the API server checks grammars with this module and no torch)

    words = (vocab_size + 31) // 32
    mask = torch.full((len(states), words), -1, dtype=torch.int32)
    for i, state in enumerate(states):
        matcher = state.matcher
        if matcher is None or state.broken:
            continue
        try:
            matcher.unsafe_compute_mask_ptr(mask[i].data_ptr(), words * 4)
        except Exception as exc:
            logger.warning("a grammar's mask failed (%s); its output is no longer constrained", exc)
            mask[i].fill_(-1)
            state.broken = True
    return mask


def allowed_tokens(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bitmask as a bool tensor [rows, vocab_size] (bits unpacked by numpy: the words
    are little-endian, so byte ``b``'s bit ``j`` is token ``8 b + j``)."""
    import torch

    as_bytes = mask.cpu().numpy().view(np.uint8)
    bits = np.unpackbits(as_bytes, axis=-1, count=vocab_size, bitorder="little")
    return torch.from_numpy(bits).to(device=mask.device, dtype=torch.bool)


class GrammarRequest(Protocol):
    """What a worker keeps of a request that the grammars read (``actors.batch.RequestState``)."""

    req_id: str
    params: SamplingParams
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    eos_token_id: int | None
    grammar: GrammarState | None  # set here at its first sample


class WorkerGrammars:
    """A worker's structured outputs: its ``GrammarCompiler`` (built at the first constrained
    request, from the model's tokenizer) and each step's bitmask."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path
        self._compiler: GrammarCompiler | None = None

    def bitmask(
        self, requests: Sequence[GrammarRequest], vocab_size: int
    ) -> tuple[list[int], torch.Tensor] | None:
        """The rows (of ``requests``, the step's sampling rows) with structured outputs and
        their bitmask, one row each: every state first consumes the outputs it has not seen
        (a new one: all of them)."""
        rows: list[int] = []
        states: list[GrammarState] = []
        for i, request in enumerate(requests):
            spec = request.params.structured_outputs
            if spec is None:
                continue
            state = request.grammar
            if state is None:
                state = request.grammar = self._state(request, spec, vocab_size)
            state.sync(request.req_id, request.token_ids[request.num_prompt_tokens :])
            rows.append(i)
            states.append(state)
        return (rows, fill_bitmask(states, vocab_size)) if rows else None

    def _state(
        self, request: GrammarRequest, spec: StructuredOutputsParams, vocab_size: int
    ) -> GrammarState:
        """A matcher for a request's spec. The front ends check specs before anything is
        scheduled; one that fails here anyway is logged and leaves the output unconstrained
        (a worker never fails a step over one request's grammar)."""
        try:
            if self._compiler is None:
                from actors.model.tokenizer import Tokenizer

                # EOS: the requests' (what stops them), else the tokenizer's.
                self._compiler = GrammarCompiler(
                    Tokenizer.from_path(self.model_path),
                    vocab_size,
                    eos_token_id=request.eos_token_id,
                )
            return self._compiler.state(spec)
        except Exception as exc:  # a spec, a tokenizer llguidance cannot read, ...
            logger.error("request %s: its structured outputs cannot apply: %s", request.req_id, exc)
            return GrammarState(None)
