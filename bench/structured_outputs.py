"""What structured outputs cost the engine: decode tokens/s with every request constrained by a
JSON schema against the same requests unconstrained, in one run, on the built-in model.

For each batch size B: B chat prompts, 96 new tokens, greedy, EOS ignored (so both runs
decode the same number of tokens: a constrained request that completes its object may only
repeat EOS). The ratio constrained / free is the figure; the mask's own cost per row and
step (llguidance, measured in isolation on the same vocabulary) is printed beside it.

    python -m bench.structured_outputs --batches 1 16 64
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "facts": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "facts"],
}
NEW_TOKENS = 96


def _run(llm: Any, batch: int, structured: bool) -> float:
    from scheduler import SamplingParams, StructuredOutputsParams

    spec = StructuredOutputsParams(json=SCHEMA) if structured else None
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, structured_outputs=spec
    )
    convs = [
        [{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(batch)
    ]
    start = time.perf_counter()
    outs = llm.chat(convs, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outs)
    return batch * NEW_TOKENS / elapsed


def _mask_cost_us(llm: Any) -> float:
    """One row's mask, per step, over a generated object (after a warm-up)."""
    from actors.structured_output import GrammarCompiler, fill_bitmask
    from scheduler import StructuredOutputsParams

    tokenizer = llm.get_tokenizer()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    text = json.dumps({"name": "Ada Lovelace", "age": 36, "facts": ["first programmer"]})
    ids = tokenizer.encode(text, add_special_tokens=False)
    spec = StructuredOutputsParams(json=SCHEMA)
    total, steps = 0.0, 0
    for _ in range(5):
        state = compiler.state(spec)
        for token in ids:
            start = time.perf_counter()
            fill_bitmask([state], tokenizer.vocab_size)
            total += time.perf_counter() - start
            steps += 1
            state.accept("bench", token)
    return total / steps * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from cluster import LLM

    llm = LLM(progress=False)
    _run(llm, 1, True)  # warm-up: the grammar tokenizer, the compile cache, the kernels
    print(f"mask per row per step: {_mask_cost_us(llm):.1f} us")
    print(f"{'batch':>5} {'free tok/s':>11} {'json tok/s':>11} {'ratio':>6}")
    for batch in args.batches:
        free, constrained = [], []
        for _ in range(args.repeats):  # interleaved, best of each
            free.append(_run(llm, batch, False))
            constrained.append(_run(llm, batch, True))
        f, c = max(free), max(constrained)
        print(f"{batch:>5} {f:>11.1f} {c:>11.1f} {c / f:>6.3f}")


if __name__ == "__main__":
    main()
