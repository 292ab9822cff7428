"""The flags of ``tandem bench`` and their cross-checks; ``cluster.tools.loadgen`` runs what
they ask for. A ``vllm bench serve`` command line works as it is: its spellings are accepted
too (``--random-input-len``, ``--goodput ttft:MS``, ``--base-url`` of the server's root with
``--endpoint /v1/completions``, ``--max-concurrency`` alone, ``--ignore-eos``)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

LEN_DISTS = ("uniform", "normal", "fixed")
# --endpoint: ours, and vLLM's (a path under the server's root)
ENDPOINTS = {
    "completions": "completions",
    "chat": "chat",
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
}
GOODPUT_KEYS = {"ttft": "slo_ttft_ms", "tpot": "slo_tpot_ms"}
MAX_NUM_PROMPTS = 1_000_000


# -- the command line ------------------------------------------------------------------------------
def _positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    def parse(s: str) -> Any:
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {s!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
        return v

    parse.__name__ = kind.__name__
    return parse


def _positive_list(kind: type[int] | type[float]) -> Callable[[str], list[Any]]:
    one = _positive(kind)

    def parse(s: str) -> list[Any]:
        items = [x.strip() for x in s.split(",")]
        if not all(items):
            raise argparse.ArgumentTypeError(f"expected a comma list of {kind.__name__}s: {s!r}")
        return [one(x) for x in items]

    return parse


def _non_negative_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """Add every ``tandem bench`` option to ``p`` (a subparser)."""
    pint, pfloat = _positive(int), _positive(float)
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000/v1",
        help="the API's /v1 URL (a server's root, as vLLM's bench takes it, gets /v1)",
    )
    p.add_argument("--model", default=None, help="model name (default: first of GET /models)")
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer token ($OPENAI_API_KEY)"
    )
    p.add_argument(
        "--endpoint",
        choices=tuple(ENDPOINTS),
        default="completions",
        help="completions: random token-id prompts (exact length); chat: random words "
        "(about one token each, so the prompt length is approximate); vLLM's /v1/... paths too",
    )
    # vllm bench serve's --backend and --dataset-name, where they ask for what this tool does
    p.add_argument(
        "--backend",
        choices=("vllm", "openai", "openai-chat"),
        default=None,
        help="vLLM's bench spelling: openai-chat goes with --endpoint /v1/chat/completions, "
        "vllm and openai with /v1/completions",
    )
    p.add_argument(
        "--dataset-name",
        choices=("random",),
        default=None,
        help="vLLM's bench spelling: random (the only prompts here)",
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency",
        type=_positive_list(int),
        metavar="N[,N...]",
        help="requests in flight; 1,4,16 sweeps (def. 1)",
    )
    load.add_argument(
        "--request-rate",
        type=_positive_list(float),
        metavar="R[,R...]",
        help="Poisson arrivals, req/s; 2,8 sweeps",
    )
    p.add_argument(
        "--max-concurrency",
        type=pint,
        help="cap in flight with --request-rate; alone, as vLLM's (an infinite rate under the "
        "cap): --concurrency N",
    )
    p.add_argument("--num-prompts", type=pint, default=64, help="requests per run (default 64)")
    p.add_argument("--seed", type=int, default=0, help="prompts, lengths and arrivals")
    p.add_argument("--duration-s", type=pfloat, help="start no request after this many s per run")
    p.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=0,
        help="uncounted requests first (prompts of their own: they prime no run's prefix cache)",
    )
    # (vLLM's random dataset spells them --random-input-len, ...: both are taken)
    p.add_argument(
        "--input-len", "--random-input-len", type=pint, default=128, help="prompt tokens (mean)"
    )
    p.add_argument(
        "--output-len", "--random-output-len", type=pint, default=64, help="max_tokens (mean)"
    )
    p.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths in [L(1-r), L(1+r)], 0 <= r < 1",
    )
    p.add_argument("--len-dist", choices=LEN_DISTS, default="uniform", help="length distribution")
    p.add_argument("--min-token-id", type=_non_negative_int, default=100, help="prompt ids from")
    p.add_argument("--max-token-id", type=_non_negative_int, default=10000, help="prompt ids to")
    p.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (vLLM extra; outputs may end before max_tokens)",
    )
    p.add_argument(
        "--ignore-eos",
        dest="ignore_eos",
        action="store_true",
        help="send ignore_eos: the default here (vLLM's bench asks for it with this flag)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--slo-ttft-ms", type=pfloat, help="goodput SLO: TTFT at most this")
    p.add_argument("--slo-tpot-ms", type=pfloat, help="goodput SLO: TPOT at most this")
    p.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        help="vLLM's spelling of the SLOs: ttft:MS and/or tpot:MS",
    )
    p.add_argument("--timeout-s", type=pfloat, default=300.0, help="per-request timeout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument(
        "--no-keep-alive", action="store_true", help="a new connection for every request"
    )
    p.add_argument("--out", default=None, help="write config, summaries and requests as JSON")
    p.add_argument("--plot-dir", default=None, help="write latency_cdf.png and throughput.png")
    p.set_defaults(bench_parser=p)  # run_bench reports cross-option errors through it
    p.description = p.description or "Load-test an OpenAI-compatible endpoint (streaming)."


def check_bench_args(args: argparse.Namespace) -> None:
    """Cross-option rules; raises ValueError naming the option. Turns vLLM's spellings into
    ours (``--goodput``, ``--endpoint /v1/...``, a root ``--base-url``, ``--max-concurrency``
    alone)."""
    _take_vllm_spellings(args)
    if args.max_concurrency is not None and args.concurrency:
        raise ValueError("--max-concurrency caps --request-rate: --concurrency already fixes it")
    if not 0 <= args.range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.min_token_id > args.max_token_id:
        raise ValueError("--min-token-id must be <= --max-token-id")
    if args.num_prompts > MAX_NUM_PROMPTS:
        raise ValueError(f"--num-prompts must be <= {MAX_NUM_PROMPTS}")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")


def _take_vllm_spellings(args: argparse.Namespace) -> None:
    given = args.endpoint
    args.endpoint = ENDPOINTS[given]
    backend = getattr(args, "backend", None)
    if backend is not None and (backend == "openai-chat") != (args.endpoint == "chat"):
        raise ValueError(
            f"--backend {backend} with --endpoint {given}: openai-chat drives "
            "/v1/chat/completions, vllm and openai /v1/completions (as in vLLM's bench)"
        )
    url = urlsplit(args.base_url)
    root = url.scheme in ("http", "https") and url.path.strip("/") == ""
    # vLLM's /v1/... endpoint goes under whatever --base-url names (a gateway's prefix too)
    prefixed = given.startswith("/") and not url.path.rstrip("/").endswith("/v1")
    if root or prefixed:
        # vLLM's --base-url is the server's root (its --endpoint the path below it); ours is
        # the API's /v1 URL: no OpenAI API answers at the root.
        args.base_url = args.base_url.rstrip("/") + "/v1"
    if args.max_concurrency is not None and not args.request_rate and not args.concurrency:
        # vLLM's --max-concurrency without a rate: every request at once (rate inf), at most
        # N in flight -- N requests in flight, which is --concurrency N.
        args.concurrency, args.max_concurrency = [args.max_concurrency], None
    for item in getattr(args, "goodput", None) or ():
        key, _, value = item.partition(":")
        if key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput {item!r}: KEY:MS with KEY ttft or tpot")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r}: must be > 0 ms")
        name = GOODPUT_KEYS[key]
        if getattr(args, name) is not None and getattr(args, name) != ms:
            raise ValueError(f"--goodput {key} and --{name.replace('_', '-')} disagree")
        setattr(args, name, ms)
