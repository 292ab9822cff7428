"""``RequestObserver``: what it records of a request's events (no Ray, no engine)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from cluster.config import default_cluster_config
from cluster.control.observer import RequestObserver
from scheduler import Request, SamplingParams
from scheduler.outputs import EngineCoreOutput
from scheduler.request import FinishReason


def _sums(observer: RequestObserver) -> dict[str, float]:
    text = observer.render({"instances": {}})
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.labels.get("instance") == "p-0"
    }


def test_a_request_ended_on_its_prefill_instance_counts_its_clients_max_tokens() -> None:
    """A prefill part runs with max_tokens 1; ended there (an EOS first, an abort), the
    request's max_tokens is what its client asked, not 1."""
    observer = RequestObserver(default_cluster_config(), {}, {})
    where = SimpleNamespace(instance_id="p-0", role="prefill")
    observer.add_instance("p-0", "prefill")
    part = Request("r", [1, 2, 3], SamplingParams(max_tokens=1), eos_token_id=2)
    now = time.monotonic()
    record = SimpleNamespace(
        request=part,
        trace=None,
        sent=[2],
        first_token_at=now,
        first_scheduled_at=now,
        placement=SimpleNamespace(client_params=SamplingParams(max_tokens=64)),
    )
    observer.finished(record, EngineCoreOutput("r", [2], FinishReason.STOP), where)
    assert _sums(observer)["tandem:request_params_max_tokens_sum"] == 64


def test_a_step_that_computes_nothing_is_no_iteration() -> None:
    """Steps that only carry instructions (finished ids, KV releases) or wait for loads are
    not iterations (vLLM records none): they flooded the lowest bucket."""
    observer = RequestObserver(default_cluster_config(), {}, {})
    where = SimpleNamespace(instance_id="p-0", role="prefill")
    observer.add_instance("p-0", "prefill")
    for tokens in (0, 0, 0, 48):
        observer.step(where, tokens)
    sums = _sums(observer)
    assert sums["tandem:iteration_tokens_total_count"] == 1
    assert sums["tandem:iteration_tokens_total_sum"] == 48
