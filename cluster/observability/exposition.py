"""The instances' own gauges and counters (``EngineLoop.stats()``, read at scrape time) as
Prometheus exposition text, with vLLM's names (``tandem:`` prefix) and ``model_name`` /
``instance`` / ``role`` labels; and the merge of several processes' exposition texts into one
(``/metrics``: the central scheduler's and the engine actors' request metrics, summed)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LABELS = ["model_name", "instance", "role"]

# Per-instance values of EngineLoop.stats(): (name, help, key, kind).
_PER_INSTANCE: list[tuple[str, str, str, str]] = [
    ("tandem:num_requests_running", "Requests in the running set.", "num_running", "gauge"),
    ("tandem:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting", "gauge"),
    (
        "tandem:num_requests_waiting_for_remote_kvs",
        "Requests whose KV is being loaded from a prefill instance.",
        "num_waiting_for_remote_kvs",
        "gauge",
    ),
    ("tandem:kv_cache_usage_perc", "KV cache usage (1 = full).", "kv_cache_usage", "gauge"),
    ("tandem:num_free_blocks", "Free KV cache blocks.", "num_free_blocks", "gauge"),
    ("tandem:instance_alive", "1 while the instance serves.", "alive", "gauge"),
    ("tandem:prompt_tokens", "Prompt tokens computed.", "num_prompt_tokens_computed", "counter"),
    (  # (vLLM's: sampled tokens -- not the positions of earlier outputs computed, one fewer
        "tandem:generation_tokens",  # per request, and again after a preemption)
        "Generated tokens.",
        "num_generated_tokens",
        "counter",
    ),
    (
        "tandem:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_queries",
        "counter",
    ),
    (
        "tandem:prefix_cache_hits",
        "Prompt tokens found in the prefix cache.",
        "prefix_cache_hits",
        "counter",
    ),
    (
        "tandem:num_preemptions",
        "Requests preempted (recomputed later).",
        "num_preemptions",
        "counter",
    ),
    (
        "tandem:kv_transfer_bytes_saved",
        "KV bytes published for decode instances.",
        "kv_bytes_saved",
        "counter",
    ),
    (
        "tandem:kv_transfer_bytes_loaded",
        "KV bytes loaded from prefill instances.",
        "kv_bytes_loaded",
        "counter",
    ),
    (
        "tandem:kv_transfer_loads",
        "KV loads that ended (one per request's load: its pipeline stages' in one).",
        "num_kv_stage_loads_ended",
        "counter",
    ),
    (
        "tandem:kv_transfer_failures",
        "KV loads that failed or timed out (a request's load: any stage's failure fails it).",
        "num_kv_stage_load_failures",
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
        now = time.time()
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
        config = GaugeMetricFamily(
            "tandem:cache_config_info",
            "The KV cache of each instance (vLLM's info series: the labels carry it).",
            labels=[*LABELS, "block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        for iid, inst in sorted(instances.items()):
            if "block_size" in inst:
                values = [str(inst["block_size"]), str(inst["num_blocks"])]
                values.append(str(bool(inst.get("enable_prefix_caching"))))
                config.add_metric([self.model_name, iid, inst.get("role", ""), *values], 1.0)
        yield config
        loras = GaugeMetricFamily(
            "tandem:lora_requests_info",
            "LoRA adapters of each instance's running and waiting requests (vLLM's info "
            "series: the labels carry them, comma-separated; the value is the scrape time).",
            labels=[*LABELS, "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        for iid, inst in sorted(instances.items()):
            if "max_loras" in inst:
                values = [str(inst["max_loras"])]
                values += [",".join(inst[k]) for k in ("running_loras", "waiting_loras")]
                loras.add_metric([self.model_name, iid, inst.get("role", ""), *values], now)
        yield loras
        transport = self.stats.get("kv_transport")
        if transport:
            info = GaugeMetricFamily(
                "tandem:kv_transport_info",
                "The KV transport between prefill and decode instances (an info series: the "
                "label carries it; transport: auto shows what it chose).",
                labels=["model_name", "transport"],
            )
            info.add_metric([self.model_name, transport], 1.0)
            yield info
        moves = CounterMetricFamily(
            "tandem:request_moves", "Requests moved off failed instances.", labels=["model_name"]
        )
        moves.add_metric([self.model_name], float(self.stats.get("num_moves", 0)))
        yield moves
        scaling = self.stats.get("autoscaling") or {}
        if scaling:
            yield from _autoscaling_families(scaling, self.model_name)


def _autoscaling_families(scaling: dict[str, Any], model_name: str) -> Iterator[Metric]:
    """The autoscaler's pools (``control/autoscaler.Autoscaler.stats``)."""
    labels = ["model_name", "pool"]
    replicas = GaugeMetricFamily(
        "tandem:pool_replicas", "Instances serving in each autoscaled pool.", labels=labels
    )
    desired = GaugeMetricFamily(
        "tandem:pool_desired_replicas",
        "The size the autoscaler wants for each autoscaled pool (at its last reading).",
        labels=labels,
    )
    decisions = CounterMetricFamily(
        "tandem:autoscaler_decisions",
        "Resizes the autoscaler made, by direction (up, down) and what drove them (ongoing "
        "requests, ttft, tpot, kv_usage).",
        labels=[*labels, "direction", "reason"],
    )
    for pool, state in sorted(scaling.items()):
        replicas.add_metric([model_name, pool], float(state["replicas"]))
        if state.get("desired") is not None:
            desired.add_metric([model_name, pool], float(state["desired"]))
        for key, count in sorted(state["decisions"].items()):
            direction, _, reason = key.partition(":")
            decisions.add_metric([model_name, pool, direction, reason], float(count))
    yield replicas
    yield desired
    yield decisions


def merge_expositions(texts: list[str]) -> str:
    """Several registries' exposition texts as one: each family once (its HELP and TYPE from
    the first text that has it), samples with the same name and labels summed (counters and
    histogram buckets, sums and counts of one series recorded in several processes)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Any] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, family)
            into = values.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                before = into.get(key)
                if before is None:
                    into[key] = sample.value
                elif sample.name.endswith("_created"):  # a start time: the earliest
                    into[key] = min(before, sample.value)
                else:
                    into[key] = before + sample.value
    lines: list[str] = []
    for name, family in families.items():
        kind = family.type
        shown = f"{name}_total" if kind == "counter" else name
        lines.append(f"# HELP {shown} {_escape_help(family.documentation)}")
        lines.append(f"# TYPE {shown} {kind}")
        for (sample_name, labels), value in values[name].items():
            rendered = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels)
            lines.append(f"{sample_name}{{{rendered}}} {_number(value)}")
    return "\n".join(lines) + "\n" if lines else ""


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value)}.0"
    return repr(value)


def render_stats(stats: dict[str, Any], model_name: str) -> tuple[str, str]:
    """The instances' gauges and counters as exposition text, and its content type."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_StatsCollector(stats, model_name))
    return generate_latest(registry).decode(), CONTENT_TYPE_LATEST


CONTENT_TYPE = CONTENT_TYPE_LATEST
