"""``/metrics``: the cluster's state in Prometheus' text format, named like vLLM's metrics with
a ``tandem:`` prefix and ``model_name`` / ``instance`` / ``role`` labels.

Read from ``SchedulerActor.stats()`` at scrape time (one call), so every ingress replica
reports the same cluster-wide numbers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LABELS = ["model_name", "instance", "role"]

# (name, help, stats key, kind)
_PER_INSTANCE: list[tuple[str, str, str, str]] = [
    ("tandem:num_requests_running", "Requests in the running set.", "num_running", "gauge"),
    (
        "tandem:num_requests_waiting",
        "Requests waiting to be scheduled.",
        "num_waiting",
        "gauge",
    ),
    (
        "tandem:num_requests_waiting_for_remote_kvs",
        "Requests whose KV is being loaded from a prefill instance.",
        "num_waiting_for_remote_kvs",
        "gauge",
    ),
    ("tandem:kv_cache_usage_perc", "KV cache usage (1 = full).", "kv_cache_usage", "gauge"),
    ("tandem:num_free_blocks", "Free KV cache blocks.", "num_free_blocks", "gauge"),
    ("tandem:instance_alive", "1 while the instance serves.", "alive", "gauge"),
    (
        "tandem:prompt_tokens",
        "Prompt tokens computed.",
        "num_prompt_tokens_computed",
        "counter",
    ),
    (
        "tandem:generation_tokens",
        "Generated tokens computed.",
        "num_output_tokens_computed",
        "counter",
    ),
    ("tandem:num_steps", "Engine steps executed.", "num_steps", "counter"),
    ("tandem:request_added", "Requests added to the instance.", "num_requests_added", "counter"),
]


class _StatsCollector:
    def __init__(self, stats: dict[str, Any], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        instances = self.stats.get("instances", {})
        for name, doc, key, kind in _PER_INSTANCE:
            family: GaugeMetricFamily | CounterMetricFamily
            if kind == "gauge":
                family = GaugeMetricFamily(name, doc, labels=LABELS)
            else:
                family = CounterMetricFamily(name, doc, labels=LABELS)
            for iid, inst in sorted(instances.items()):
                value = inst.get(key)
                if value is None:
                    continue
                family.add_metric([self.model_name, iid, inst.get("role", "")], float(value))
            yield family
        moves = CounterMetricFamily(
            "tandem:request_moves", "Requests moved off failed instances.", labels=["model_name"]
        )
        moves.add_metric([self.model_name], float(self.stats.get("num_moves", 0)))
        yield moves


def render_metrics(stats: dict[str, Any], model_name: str) -> tuple[str, str]:
    """The exposition text and its content type."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats, model_name))
    return generate_latest(registry).decode(), CONTENT_TYPE_LATEST
