"""argparse ``type``s of the simulator's and the planner's flags: numbers in a range, else a
usage error naming the flag."""

from __future__ import annotations

import argparse
import math
from typing import Any


def bounded(kind: type, low: float, what: str, high: float | None = None) -> Any:
    """An argparse ``type``: a finite ``kind`` number, ``low`` or more (``high`` or less) --
    else a usage error naming the flag (a zero count or rate ran on, or divided by zero)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not low <= value <= (math.inf if high is None else high) or math.isinf(value):
            raise argparse.ArgumentTypeError(f"{text}: give {what}")
        return value

    return parse


POSITIVE = bounded(int, 1, "1 or more")
COUNT = bounded(int, 0, "0 or more")
RATE = bounded(float, 1e-9, "a number above 0")
MILLISECONDS = bounded(float, 1e-9, "milliseconds above 0")


def token_budgets(text: str) -> tuple[int, ...]:
    """``--batched-tokens``: N[,N...], each 1 or more."""
    return tuple(POSITIVE(t.strip()) for t in text.split(","))
