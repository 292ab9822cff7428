"""Turning the scheduler's token outputs into what users read: text (incrementally
detokenized), stop strings, finish reasons, and the fan-in of ``n`` samples per request.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from actors.model.tokenizer import IncrementalDetokenizer, Tokenizer
from scheduler import EngineCoreOutput, SamplingParams
from scheduler.outputs import TokenLogprobs
from scheduler.request import FinishReason, PromptLogprob


@dataclass
class CompletionOutput:
    """One of the ``n`` samples of a request. ``text`` / ``token_ids`` are cumulative;
    ``new_text`` / ``new_token_ids`` are what the last step added (for streaming)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string
    logprobs: list[TokenLogprobs] | None = None
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # why, when finish_reason is "error"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step (vLLM's shape)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # prompt_logprobs: one entry per prompt token (the first None), from the first output.
    prompt_logprobs: list[PromptLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


class _Sample:
    """Per-child detokenization and stop-string state."""

    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer,
        params: SamplingParams,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.out = CompletionOutput(
            index=index, logprobs=[] if params.logprobs is not None else None
        )
        # (primed with the prompt: its first token renders as inside the full text)
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens, prompt_ids or ())
        self.params = params
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.emitted = 0  # characters of ``out.text`` already handed out as ``new_text``
        self.stop_from = 0  # text before this cannot end with a stop string (min_tokens)

    def add(self, core: EngineCoreOutput) -> bool:
        """Apply one step's tokens; True when a stop string ended the sample. An output of
        several tokens (merged for a reader that fell behind, or refilled) is applied a token
        at a time when stop strings are set: which stop ends the sample, and where, is then
        the same as when the tokens come one by one (a search over the whole new text could
        prefer a longer stop string that starts earlier but ends later)."""
        ids = core.new_token_ids
        if not self.params.stop or len(ids) < 2:
            return self._add(core)
        logprobs = core.new_logprobs
        first_logprob = len(ids) - len(logprobs) if logprobs is not None else 0
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            piece_logprobs = None
            if logprobs is not None:  # (the first tokens of a refill have none)
                piece_logprobs = logprobs[i - first_logprob : i - first_logprob + 1]
                if i < first_logprob:
                    piece_logprobs = []
            piece = dataclasses.replace(
                core,
                new_token_ids=[token],
                new_logprobs=piece_logprobs,
                finish_reason=core.finish_reason if last else None,
                stop_reason=core.stop_reason if last else None,
                error=core.error if last else None,
            )
            if self._add(piece):
                return True
        return False

    def _add(self, core: EngineCoreOutput) -> bool:
        out = self.out
        out.new_token_ids.extend(core.new_token_ids)  # (several outputs in one ``process``)
        out.token_ids.extend(core.new_token_ids)
        if out.logprobs is not None:
            new = core.new_logprobs or []
            missing = len(core.new_token_ids) - len(new)
            if missing > 0:  # tokens refilled after their engine was lost: so were these
                new = [{t: math.nan} for t in core.new_token_ids[:missing]] + list(new)
            out.logprobs.extend(new)
        before = len(out.text)
        text_ids = core.new_token_ids
        # The token that stopped it (EOS, a stop_token_ids entry) is not part of the text
        # unless include_stop_str_in_output (vLLM's rule; it matters for a stop id that is no
        # special token). Stop strings end samples here, before any such output.
        stop_token = core.finish_reason == FinishReason.STOP and text_ids
        if stop_token and not self.params.include_stop_str_in_output:
            text_ids = text_ids[:-1]
        # An output that crosses the min_tokens line (several tokens: merged for a reader that
        # fell behind, or refilled) is detokenized in two parts: stop strings count from the
        # line on, as when its tokens come one by one.
        cut = self.params.min_tokens - (len(out.token_ids) - len(core.new_token_ids))
        if 0 < cut < len(text_ids):
            head = self.detok.add(text_ids[:cut])
            self.stop_from = before + len(head)
            delta = head + self.detok.add(text_ids[cut:])
        else:
            delta = self.detok.add(text_ids) if text_ids else ""
        if core.finish_reason is not None:  # the last tokens: nothing can complete them now
            delta += self.detok.flush()
        text = out.text + delta
        stopped = False
        # vLLM's rule: stop strings count only once min_tokens outputs exist, and only text
        # from there on (each stop may begin up to its own length before it, as in vLLM).
        if len(out.token_ids) <= self.params.min_tokens:
            self.stop_from = len(text)
        elif self.params.stop and delta:
            # Only the tail that could hold a new match is searched.
            hit = _find_stop(text, self.params.stop, max(before, self.stop_from))
            if hit is not None:
                pos, stop = hit
                end = pos + len(stop) if self.params.include_stop_str_in_output else pos
                text = text[:end]
                out.finish_reason, out.stop_reason = "stop", stop
                stopped = True
        out.text = text
        if not stopped and core.finish_reason is not None:
            out.finish_reason = core.finish_reason.value
            out.stop_reason = core.stop_reason
            out.error = core.error
        # Stream only text that can no longer turn out to be the start of a stop string, so the
        # deltas always add up to the final text (the held-back tail goes out at the finish).
        safe_end = len(text)
        if self.params.stop and out.finish_reason is None:
            safe_end = max(self.emitted, len(text) - (self.max_stop_len - 1))
        out.new_text += text[self.emitted : safe_end]
        self.emitted = safe_end
        return stopped


def _find_stop(text: str, stops: tuple[str, ...], new_from: int) -> tuple[int, str] | None:
    """The earliest stop string that ends in ``text[new_from:]``."""
    best: tuple[int, str] | None = None
    for stop in stops:
        pos = text.find(stop, max(0, new_from - len(stop) + 1))
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


class _Parent:
    def __init__(
        self, request_id: str, prompt: str | None, prompt_ids: list[int], samples: list[_Sample]
    ) -> None:
        self.output = RequestOutput(request_id, prompt, prompt_ids, [s.out for s in samples])
        self.samples = samples
        # Prompt logprobs with n > 1: only sample 0 computes them (``InputProcessor``), and
        # another sample may come out first (a prefix hit, no hand-off). Its outputs are held
        # until sample 0's first one, then applied in order, so every sample's first output
        # -- an echo's first chunk -- comes with the prompt's logprobs. None: nothing held.
        params = samples[0].params
        wants = params.prompt_logprobs is not None and len(samples) > 1
        self.held: list[EngineCoreOutput] | None = [] if wants else None


class OutputProcessor:
    """Owns per-request output state between ``add`` and the final output."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Parent] = {}
        self.children: dict[str, tuple[_Parent, _Sample]] = {}
        self.pending: set[str] = set()  # parents with an update not yet returned (aborts)

    @staticmethod
    def child_ids(request_id: str, n: int) -> list[str]:
        """Scheduler ids of a request's samples: the id itself, or ``{id}#{i}`` when n > 1."""
        return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]

    def in_use(self, request_id: str) -> bool:
        """True if the id names a live request or one of its samples."""
        return request_id in self.requests or request_id in self.children

    def add(
        self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams
    ) -> list[str]:
        samples = [_Sample(i, self.tokenizer, params, prompt_ids) for i in range(params.n)]
        parent = _Parent(request_id, prompt, prompt_ids, samples)
        self.requests[request_id] = parent
        child_ids = self.child_ids(request_id, params.n)
        for child_id, sample in zip(child_ids, samples, strict=True):
            self.children[child_id] = (parent, sample)
        return child_ids

    def abort(self, request_ids: list[str]) -> list[str]:
        """Mark samples aborted; returns the child ids for the scheduler."""
        children = []
        for child_id, (parent, sample) in list(self.children.items()):
            if parent.output.request_id in request_ids:
                sample.out.finish_reason = "abort"
                sample.out.new_text, sample.out.new_token_ids = "", []
                children.append(child_id)
                del self.children[child_id]
                self.pending.add(parent.output.request_id)
        return children

    def forget(self, request_ids: set[str]) -> None:
        """Drop aborted requests whose final output nobody will read."""
        self.pending -= request_ids
        for rid in request_ids:
            self.requests.pop(rid, None)

    def has_pending(self) -> bool:
        return bool(self.pending)

    def process(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the changed requests and the child ids a stop string ended."""
        changed: dict[str, _Parent] = {rid: self.requests[rid] for rid in self.pending}
        self.pending.clear()
        for parent in changed.values():  # (aborted)
            for sample in parent.samples:
                sample.out.new_text, sample.out.new_token_ids = "", []
                if sample.out.finish_reason == "abort":  # the text held back for a stop
                    sample.out.new_text = sample.out.text[sample.emitted :]  # string ends it
                    sample.emitted = len(sample.out.text)
        stopped: list[str] = []
        work = list(core_outputs)
        k = 0
        while k < len(work):
            core = work[k]
            k += 1
            entry = self.children.get(core.request_id)
            if entry is None:
                continue  # aborted or stopped by a string already
            parent, sample = entry
            held = parent.held
            if held is not None:
                if sample.out.index != 0:  # until sample 0's first output (``_Parent``)
                    held.append(core)
                    continue
                parent.held = None
                work[k:k] = held  # right after it, each on its own (stop strings, min_tokens)
            rid = parent.output.request_id
            if rid not in changed:
                for s in parent.samples:
                    s.out.new_text, s.out.new_token_ids = "", []
                changed[rid] = parent
            if core.prompt_logprobs is not None and parent.output.prompt_logprobs is None:
                parent.output.prompt_logprobs = core.prompt_logprobs  # (every sample's alike)
            if core.num_cached_tokens:
                parent.output.num_cached_tokens = max(
                    parent.output.num_cached_tokens, core.num_cached_tokens
                )
            if sample.add(core):
                stopped.append(core.request_id)
            if sample.out.finished:
                del self.children[core.request_id]
        for rid, parent in changed.items():
            if parent.output.finished:
                del self.requests[rid]
        return [p.output for p in changed.values()], stopped
