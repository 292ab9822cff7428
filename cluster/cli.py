"""The ``tandem`` command line.

tandem generate "What is the capital of France?"          # built-in SmolLM2, streamed
tandem generate --model ./my-llama --raw --max-tokens 64 "Once upon a time"
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from scheduler import SamplingParams


def _generate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("generate", help="generate text in-process, streamed to the terminal")
    p.add_argument("prompt", nargs="+", help="the prompt (several words are joined)")
    p.add_argument(
        "--model",
        default=None,
        help="a model directory (config.json + safetensors) or .gguf file; "
        "default: the built-in SmolLM2-135M-Instruct",
    )
    p.add_argument(
        "--raw",
        action="store_true",
        help="send the prompt as is instead of through the model's chat template",
    )
    p.add_argument("--system", default=None, help="a system message for the chat template")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default="cpu")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine details")


def _run_generate(args: argparse.Namespace) -> int:
    from cluster.llm import LLM  # torch import is slow: only when the command runs

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            stop=tuple(args.stop),
        )
    except ValueError as exc:
        print(f"tandem generate: {exc}", file=sys.stderr)
        return 2
    try:
        llm = LLM(args.model, dtype=args.dtype, device=args.device)
    except (FileNotFoundError, ValueError) as exc:
        print(f"tandem generate: {exc}", file=sys.stderr)
        return 1
    text = " ".join(args.prompt)
    tokenizer = llm.get_tokenizer()
    prompt: str | list[int] = text
    if not args.raw and tokenizer.chat_template:
        messages = [{"role": "user", "content": text}]
        if args.system:
            messages.insert(0, {"role": "system", "content": args.system})
        prompt = tokenizer.encode_chat(messages)
    finish = None
    try:
        for out in llm.generate_stream(prompt, params):
            sample = out.outputs[0]
            if sample.new_text:
                sys.stdout.write(sample.new_text)
                sys.stdout.flush()
            finish = sample.finish_reason
    except ValueError as exc:  # e.g. a prompt longer than the context
        print(f"tandem generate: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write("\n")
    if args.verbose:
        print(f"[finish_reason={finish}]", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    assert args.command == "generate"  # argparse refuses anything else
    return _run_generate(args)


if __name__ == "__main__":
    sys.exit(main())
