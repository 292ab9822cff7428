"""One trace per request across the P/D hop: the ingress span joins the caller's
``traceparent``; the SchedulerActor's spans (queue, prefill on the prefill node, KV transfer,
decode on the decode node) are its children; both processes export over OTLP/gRPC to a
receiver started by the test (tests/cluster/conftest.py)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.cluster.conftest import (
    API_KEY,
    PD_SPAN_NAMES,
    RayCluster,
    ServeApp,
    span_attributes,
    wait_until,
)

requests = pytest.importorskip("requests")


def test_one_trace_across_ingress_scheduler_prefill_and_decode(
    serve_app: ServeApp, ray_cluster: RayCluster
) -> None:
    trace_id, parent_id = os.urandom(16), os.urandom(8)
    headers = {
        "Authorization": f"Bearer {API_KEY}",
        "traceparent": f"00-{trace_id.hex()}-{parent_id.hex()}-01",
    }
    body = {
        "model": serve_app.model,
        "messages": [{"role": "user", "content": "Trace me"}],
        "max_tokens": 6,
        "ignore_eos": True,
        "temperature": 0,
    }
    r = requests.post(
        f"{serve_app.url}/v1/chat/completions", json=body, headers=headers, timeout=60
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    wanted = {"chat tiny-chat", *PD_SPAN_NAMES}  # the ingress's span too

    def arrived() -> bool:
        return wanted <= {s.name for _, s in serve_app.traces.trace(trace_id)}

    wait_until(arrived, 30, "the request's spans at the OTLP receiver")
    spans: dict[str, tuple[dict[str, Any], Any]] = {
        s.name: (res, s) for res, s in serve_app.traces.trace(trace_id)
    }
    ingress_res, ingress = spans["chat tiny-chat"]
    assert ingress.parent_span_id == parent_id  # joined the caller's trace
    assert ingress_res["tandem.component"] == "ingress"
    a = span_attributes(ingress)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == serve_app.model
    assert a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.response.id"] == r.json()["id"]

    request_res, request = spans["tandem.request"]
    assert request.parent_span_id == ingress.span_id  # the context crossed the Ray hop
    assert request_res["tandem.component"] == "scheduler"
    assert span_attributes(request)["gen_ai.usage.output_tokens"] == 6
    assert "first_token" in [e.name for e in request.events]
    for name in ("tandem.queue", "tandem.prefill", "tandem.kv_transfer", "tandem.decode"):
        assert spans[name][1].parent_span_id == request.span_id, name
        assert spans[name][1].start_time_unix_nano <= spans[name][1].end_time_unix_nano

    prefill = span_attributes(spans["tandem.prefill"][1])
    decode = span_attributes(spans["tandem.decode"][1])
    transfer = span_attributes(spans["tandem.kv_transfer"][1])
    assert prefill["tandem.instance"] == "p-0" and decode["tandem.instance"] == "d-0"
    assert prefill["tandem.prompt_tokens"] == usage["prompt_tokens"]
    assert decode["tandem.preemptions"] == 0
    assert prefill["tandem.node_id"] == ray_cluster.prefill_node_id
    assert decode["tandem.node_id"] == ray_cluster.decode_node_id
    assert decode["gen_ai.usage.output_tokens"] == 6
    # transport: auto -- nixl where it is installed (CI installs it), else ray.
    from kv_transfer.nixl_transport import nixl_available

    expected = "nixl" if nixl_available() else "ray"
    assert transfer["tandem.kv.transport"] == expected and transfer["tandem.kv.outcome"] == "ok"
    assert transfer["tandem.kv.bytes"] > 0 and transfer["tandem.kv.blocks"] >= 1
    # The decode worker's own span of the load, from its process on the decode node.
    load_res, load = spans["tandem.kv_load"]
    assert load.parent_span_id == spans["tandem.kv_transfer"][1].span_id
    assert load_res["tandem.component"] == "worker"
    assert load_res["tandem.node_id"] == ray_cluster.decode_node_id
    load_attrs = span_attributes(load)
    assert load_attrs["tandem.kv.outcome"] == "ok" and load_attrs["tandem.kv.bytes"] > 0
    assert load_attrs["tandem.kv.bytes"] == transfer["tandem.kv.bytes"]
    # ... and the prefill worker's save, from its process on the prefill node.
    save_res, save = spans["tandem.kv_save"]
    assert save.parent_span_id == request.span_id
    assert save_res["tandem.component"] == "worker"
    assert save_res["tandem.node_id"] == ray_cluster.prefill_node_id
    # The decode side loads only what its prefix cache lacks (the chat template's start may be
    # cached there by earlier requests), so the save may hold more.
    assert span_attributes(save)["tandem.kv.bytes"] >= load_attrs["tandem.kv.bytes"]
    # In order: queued, prefilled, handed off, decoded.
    order = [
        spans[n][1].start_time_unix_nano
        for n in ("tandem.queue", "tandem.prefill", "tandem.kv_transfer")
    ]
    assert order == sorted(order)
    assert spans["tandem.prefill"][1].end_time_unix_nano <= (
        spans["tandem.decode"][1].end_time_unix_nano
    )


def test_a_refused_request_is_an_error_span(serve_app: ServeApp) -> None:
    trace_id = os.urandom(16)
    headers = {
        "Authorization": f"Bearer {API_KEY}",
        "traceparent": f"00-{trace_id.hex()}-{os.urandom(8).hex()}-01",
    }
    body = {"model": serve_app.model, "prompt": "x", "max_tokens": 100_000}
    r = requests.post(f"{serve_app.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 400
    wait_until(lambda: serve_app.traces.trace(trace_id), 30, "the error span")
    [(_, span)] = serve_app.traces.trace(trace_id)
    assert span.name == "text_completion tiny-chat"
    assert span.status.code == 2  # ERROR
    assert span_attributes(span)["http.response.status_code"] == 400
