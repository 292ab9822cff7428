"""The checks of a request against the model, before anything is scheduled: the room left
in the context (``max_tokens``, ``min_tokens``, the model's ``max_new_tokens``), prompts too long
to tokenize whole, token ids outside the vocabulary, structured-output specs that do not
compile. Each failure is an ``APIError`` 400 naming its field. ``OpenAIServing`` mixes them in.
"""

from __future__ import annotations

from typing import Any

from actors.model.tokenizer import Tokenizer
from actors.structured_output import GrammarError, compiler_for
from cluster.engine.protocol import EngineClient
from cluster.serving.agent_fields import FieldError
from cluster.serving.errors import APIError
from cluster.serving.openai_protocol import ChatCompletionRequest, CompletionRequest

# Past this many characters a token of context, a prompt is counted by prefixes before it is
# tokenized whole (``RequestChecks._encode``): real text runs about 4 characters a token.
PREFIX_CHARS_PER_TOKEN = 4
PREFIX_MARGIN_TOKENS = 64  # merges across a prefix's cut can join a few of its last tokens


class RequestChecks:
    """The validation half of ``OpenAIServing`` (which sets these attributes)."""

    engine: EngineClient
    tokenizer: Tokenizer
    max_model_len: int
    max_prompt_chars: int | None
    sampling_defaults: dict[str, Any]

    def _max_tokens(
        self,
        prompt_len: int,
        requested: int | None,
        prompt_param: str,
        min_tokens: int = 0,
        param: str = "max_tokens",
    ) -> int:
        """The request's ``max_tokens`` (``param``: the field it came in), or the room left
        in the context, at most the model's ``max_new_tokens`` (the sampling defaults); a 400
        naming the field when it does not fit, or when ``min_tokens`` asks for more (vLLM's
        check; it was clamped)."""
        room = self.max_model_len - prompt_len
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {prompt_len} tokens; at least one must be left to generate.",
                param=prompt_param,
            )
        if requested is not None and requested > room:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                f"{requested} in the completion). Please reduce the length of the prompt or "
                f"{param}.",
                param=param,
            )
        max_tokens = room if requested is None else requested
        cap = int(self.sampling_defaults.get("max_tokens", max_tokens))  # max_new_tokens
        capped = cap < max_tokens
        if capped:  # (vLLM takes the smallest of the request's, the room and the model's)
            max_tokens = cap
        if min_tokens > max_tokens:
            if capped:
                limit = f"the model's max_new_tokens ({max_tokens})"
            elif requested is not None:
                limit = f"{param} ({max_tokens})"
            else:
                limit = f"the room left in the context ({max_tokens} tokens)"
            raise APIError(
                400, f"min_tokens ({min_tokens}) must be at most {limit}", param="min_tokens"
            )
        return max_tokens

    def _check_chars(self, num_chars: int, param: str) -> None:
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {num_chars} characters, more than {self.max_model_len} tokens "
                f"can hold ({self.max_prompt_chars}).",
                param=param,
            )

    def _encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """The text's ids, without tokenizing all of a text far too long for the context:
        past ``PREFIX_CHARS_PER_TOKEN`` characters a token, growing prefixes are counted
        first (each twice the last), and one with more tokens than the context (plus a margin
        for merges across the cut) refuses the text. What is tokenized then stays within about
        twice what the context's worth of this text costs, whatever the body's length."""
        limit = self.max_model_len
        cut = PREFIX_CHARS_PER_TOKEN * limit
        while cut < len(text):
            count = len(self.tokenizer.encode(text[:cut], add_special_tokens=False))
            if count > limit + PREFIX_MARGIN_TOKENS:
                raise APIError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"prompt has more than {count - PREFIX_MARGIN_TOKENS} tokens.",
                    param=param,
                )
            cut *= 2
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _check_priority(self, priority: int) -> None:
        """A priority without priority scheduling is refused (vLLM's 400), not ignored."""
        if priority != 0 and not self.engine.priority_scheduling:
            raise APIError(
                400,
                f"priority {priority} needs priority scheduling (a pool's scheduler.policy: "
                "priority); this cluster serves in arrival order (fcfs)",
                param="priority",
            )

    def _check_logit_bias(self, ids: list[int]) -> None:
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise APIError(
                400,
                f"logit_bias token id {bad} is outside the vocabulary (size {vocab})",
                param="logit_bias",
            )

    def _check_structured(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        """Structured outputs asked for in one field, with a spec that compiles for this
        model's tokenizer: a 400 naming the field otherwise, before anything is scheduled
        (compiled grammars are cached by spec)."""
        try:
            spec, param = req.structured()
        except FieldError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        if spec is None:
            return
        try:
            compiler_for(self.tokenizer, self.tokenizer.vocab_size).compile(spec)
        except GrammarError as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None

    def _check_ids(self, ids: list[int], param: str) -> None:
        try:
            self.engine.validate_prompt(ids)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None
