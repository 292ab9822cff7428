"""The buckets of the request histograms (vLLM's) and ``StepHistogram``: lock-free children for
the histograms observed on every step of every request, rendered as Prometheus's."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from cluster.observability.exposition import LABELS

# vLLM's buckets (seconds).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
# Token counts (vLLM's 1-2-5 series).
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)  # vLLM's request_params_n buckets
TRANSFER_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


class StepHistogram:
    """One labelled child of a histogram observed on every step of every request (the
    inter-token latency: one observation per request per step). ``prometheus_client``'s
    children take a lock per bucket and per sum; these are plain counters, observed and
    rendered on the actor's event loop only."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket (le = bound), the last +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class StepHistogramFamily:
    """A histogram of ``StepHistogram`` children by label values, rendered as Prometheus's."""

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...]) -> None:
        self.name, self.doc, self.bounds = name, doc, bounds
        self.children: dict[tuple[str, ...], StepHistogram] = {}

    def labels(self, *values: str) -> StepHistogram:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = StepHistogram(self.bounds)
        return child

    def metric(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.doc, labels=LABELS)
        edges = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        for values, child in sorted(self.children.items()):
            total, buckets = 0, []
            for edge, count in zip(edges, child.counts, strict=True):
                total += count
                buckets.append((edge, float(total)))
            family.add_metric(list(values), buckets, sum_value=child.sum)
        return family


class StepHistogramCollector:
    def __init__(self, families: list[StepHistogramFamily]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        for family in self.families:
            yield family.metric()


@dataclass(frozen=True)
class StepHistograms:
    """One instance's children of the histograms a request's steps observe."""

    ttft: StepHistogram
    itl: StepHistogram
    queue: StepHistogram
    iteration_tokens: StepHistogram
