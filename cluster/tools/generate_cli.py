"""``tandem generate``: a prompt's completion streamed to the terminal, from an in-process
engine or through a running cluster (``--cluster``)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from cluster.tools.serve_args import DTYPES
from scheduler import SamplingParams


def _device(value: str) -> str:
    """``--device``: as a pool's ``device`` (an argparse error names the flag otherwise)."""
    import re

    from cluster.config.pools import DEVICE_PATTERN

    if not re.match(DEVICE_PATTERN, value):
        raise argparse.ArgumentTypeError(f"{value!r}: give cpu, cuda or cuda:N")
    return value


def add_generate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="the weights' dtype")
    p.add_argument(
        "--quantization",
        "-q",
        choices=("auto", "none", "int8", "int4"),
        default="auto",
        help="weights held quantized (auto: as a GGUF file stores them)",
    )
    p.add_argument("--device", type=_device, default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    p.add_argument(
        "--cluster",
        action="store_true",
        help="generate through a running cluster (tandem up) instead of in-process",
    )
    ray_arguments(p, default_address="auto")


def ray_arguments(p: argparse.ArgumentParser, default_address: str | None) -> None:
    p.add_argument(
        "--address",
        default=default_address,
        help="Ray cluster to join (host:port, or 'auto' for the one on this machine)"
        + ("" if default_address else "; default: start a local Ray on 127.0.0.1"),
    )
    p.add_argument("--name", default=None, help="name of the cluster's SchedulerActor")


def _generate_on_cluster(args: argparse.Namespace, params: SamplingParams) -> int:
    from cluster.control.client import ClusterClient
    from cluster.control.launch import DEFAULT_NAME, init_ray

    try:
        init_ray(args.address)
    except ConnectionError as exc:
        print(
            f"tandem generate: no Ray cluster at {args.address!r} ({exc}); start one with "
            "`tandem up`",
            file=sys.stderr,
        )
        return 1
    try:
        client = ClusterClient.connect(args.name or DEFAULT_NAME)
    except ValueError as exc:
        print(
            f"tandem generate: no running cluster ({exc}); start one with `tandem up`",
            file=sys.stderr,
        )
        return 1
    prompt = _prompt(args, client.tokenizer)

    async def stream() -> str | None:
        finish = None
        async for out in client.generate_async(prompt, params):
            finish = _show(out)
        return finish

    try:
        finish = asyncio.run(stream())
    except ValueError as exc:
        print(f"tandem generate: {exc}", file=sys.stderr)
        return 1
    return _ended(args, finish)


def _prompt(args: argparse.Namespace, tokenizer: Any) -> str | list[int]:
    """The chat-formatted prompt (unless --raw or the model has no chat template)."""
    text = " ".join(args.prompt)
    if args.raw or not tokenizer.chat_template:
        return text
    messages = [{"role": "user", "content": text}]
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    ids: list[int] = tokenizer.encode_chat(messages)
    return ids


def run_generate(args: argparse.Namespace) -> int:
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
    if args.cluster:
        engine_only = {"--model": None, "--dtype": "auto", "--quantization": "auto"}
        engine_only["--device"] = "cpu"
        given = [f for f, default in engine_only.items() if getattr(args, f[2:]) != default]
        if given:  # the cluster serves the model it was started with
            print(
                f"tandem generate: {', '.join(given)} set the in-process engine; with --cluster "
                "the running cluster's model and settings apply (set them on `tandem up`)",
                file=sys.stderr,
            )
            return 2
        return _generate_on_cluster(args, params)
    from cluster.engine.llm import LLM  # torch import is slow: only when the command runs

    try:
        llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, device=args.device)
    except (FileNotFoundError, ValueError) as exc:
        print(f"tandem generate: {exc}", file=sys.stderr)
        return 1
    prompt = _prompt(args, llm.get_tokenizer())
    finish = None
    try:
        for out in llm.generate_stream(prompt, params):
            finish = _show(out)
    except ValueError as exc:  # e.g. a prompt longer than the context
        print(f"tandem generate: {exc}", file=sys.stderr)
        return 1
    return _ended(args, finish)


def _show(out: Any) -> str | None:
    """Write an output's new text to the terminal; its sample's finish reason (None: more
    to come)."""
    sample = out.outputs[0]
    if sample.new_text:
        sys.stdout.write(sample.new_text)
        sys.stdout.flush()
    return sample.finish_reason


def _ended(args: argparse.Namespace, finish: str | None) -> int:
    """The generation ended: a newline, and with -v its finish reason."""
    sys.stdout.write("\n")
    if args.verbose:
        print(f"[finish_reason={finish}]", file=sys.stderr)
    return 0
