"""Workloads for the simulator: when each request arrives, how long its prompt and its output
are, which shared prefix it starts with, which LoRA adapter it uses.

A workload is a list of ``WorkItem``s, from a trace (JSONL, one item per line, the fields of
``WorkItem``) or from a generator: Poisson arrivals at a rate with the lengths of one of the
usual shapes (``SHAPES``: chat, long-prompt summarization, agentic with shared prefixes).
Everything is drawn from a seeded ``random.Random``: one seed, one workload.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkItem:
    arrival_s: float  # from the start of the run
    prompt_len: int  # in tokens, the shared prefix included
    output_len: int  # tokens to generate (the request ignores EOS)
    prefix_group: int | None = None  # requests of a group share their first prefix_len tokens
    prefix_len: int = 0
    lora: str | None = None  # an adapter's name

    def prompt(self, seed: int, index: int, vocab: int = 32000) -> list[int]:
        """The prompt's token ids: the group's prefix, then tokens of this request's own."""
        ids = range(3, vocab)
        tokens: list[int] = []
        if self.prefix_group is not None and self.prefix_len:
            shared = random.Random(f"{seed}:group:{self.prefix_group}")
            tokens = shared.choices(ids, k=min(self.prefix_len, self.prompt_len))
        own = random.Random(f"{seed}:{index}")
        return tokens + own.choices(ids, k=self.prompt_len - len(tokens))


@dataclass(frozen=True)
class Shape:
    """A workload's lengths: log-normal around the medians, clipped to [min, max]."""

    name: str
    prompt_median: int
    output_median: int
    sigma: float = 0.5
    prompt_min: int = 4
    prompt_max: int = 8192
    output_min: int = 1
    output_max: int = 2048
    prefix_len: int = 0  # a shared prefix (system prompt, tool definitions) of this length
    num_groups: int = 0  # over this many groups


SHAPES = {
    s.name: s
    for s in (
        Shape("chat", 256, 192),
        Shape("summarization", 3000, 128, sigma=0.3, prompt_max=7000, output_max=512),
        Shape("agentic", 2500, 96, sigma=0.3, prefix_len=2000, num_groups=8),
        Shape("fixed", 128, 128, sigma=0.0),
    )
}


def _length(rng: random.Random, median: int, sigma: float, low: int, high: int) -> int:
    if sigma <= 0:
        return max(low, min(high, median))
    return max(low, min(high, round(rng.lognormvariate(0.0, sigma) * median)))


def poisson(
    rate: float,
    num_requests: int,
    shape: Shape | str = "chat",
    seed: int = 0,
    loras: list[str] | None = None,
) -> list[WorkItem]:
    """``num_requests`` with exponential gaps at ``rate`` per second; ``loras``: adapters
    the requests use in turn (None among them: the base model)."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    s = SHAPES[shape] if isinstance(shape, str) else shape
    rng = random.Random(seed)
    items, now = [], 0.0
    for i in range(num_requests):
        now += rng.expovariate(rate)
        prompt = _length(rng, s.prompt_median, s.sigma, s.prompt_min, s.prompt_max)
        output = _length(rng, s.output_median, s.sigma, s.output_min, s.output_max)
        group = rng.randrange(s.num_groups) if s.num_groups else None
        if group is not None:
            prompt = max(prompt, s.prefix_len + 1)
        items.append(
            WorkItem(
                round(now, 6),
                prompt,
                output,
                group,
                s.prefix_len if group is not None else 0,
                loras[i % len(loras)] if loras else None,
            )
        )
    return items


def read_trace(path: str | Path) -> list[WorkItem]:
    """A JSONL trace, one ``WorkItem`` per line (``arrival_s``, ``prompt_len``,
    ``output_len``; optional ``prefix_group``, ``prefix_len``, ``lora``), sorted by arrival."""
    items = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            items.append(WorkItem(**json.loads(line)))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: not a work item: {exc}") from None
    return sorted(items, key=lambda item: item.arrival_s)


def write_trace(items: list[WorkItem], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(asdict(item)) + "\n" for item in items))
