"""The Serve app over engine actors (``engine_actors: true``, what the KubeRay manifests
run): the OpenAI API over HTTP streams from the instances' engines, equal to the central
mode's app; ``/metrics`` merges every engine's; and an ingress replica that dies mid-stream
gets its request aborted on the engines, its blocks freed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster.conftest import ServeApp, assert_clean

ray = pytest.importorskip("ray")
requests = pytest.importorskip("requests")

from tests.cluster.serving.ingress_faults import chat, kill_the_ingress_mid_stream  # noqa: E402

APP = "tandem-engines"
PREFIX = "/engines"


@pytest.fixture(scope="module")
def engines_app(serve_app: ServeApp) -> Iterator[tuple[str, Any]]:
    """A second app on the same Serve instance: the same cluster config with engine actors,
    its own cluster; (its URL, its SchedulerActor)."""
    from ray import serve

    from cluster.control.launch import app_cluster_name, get_cluster, shutdown_cluster
    from cluster.serving.app import build_app_from_config

    base = serve_app.config
    tracing = base.tracing.model_copy(update={"enabled": False})  # (the receiver is the
    config = base.model_copy(update={"engine_actors": True, "tracing": tracing})  # other's)
    try:
        serve.run(build_app_from_config(config), name=APP, route_prefix=PREFIX)
        handle = serve.get_deployment_handle("TandemCluster", APP)
        yield f"{serve_app.url}{PREFIX}", handle.scheduler.remote().result()
    finally:
        serve.delete(APP)
        with contextlib.suppress(ValueError):  # (the cluster's lifetime is explicit)
            shutdown_cluster(get_cluster(app_cluster_name(APP), namespace="tandem"))


def _chat(url: str, model: str, stream: bool = False) -> Any:
    return chat(url, model, stream=stream, max_tokens=8, content="Say hello")


def test_the_api_streams_from_the_engines_as_the_central_mode_does(
    serve_app: ServeApp, engines_app: tuple[str, Any]
) -> None:
    import json

    url, scheduler = engines_app
    stats = ray.get(scheduler.stats.remote())
    pids = {i["engine_pid"] for i in stats["instances"].values()}
    assert len(pids) == 2 and stats["pid"] not in pids  # each engine in its own process
    central = _chat(serve_app.url, serve_app.model)
    whole = _chat(url, serve_app.model)
    assert central.status_code == whole.status_code == 200, whole.text
    expected = central.json()["choices"][0]["message"]["content"]
    assert whole.json()["choices"][0]["message"]["content"] == expected
    pieces, done = [], False
    with _chat(url, serve_app.model, stream=True) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: "):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                pieces.append(delta.get("content") or "")
    assert done and "".join(pieces) == expected
    metrics = requests.get(f"{url}/metrics", timeout=30).text
    # Both engines' request histograms merged into one family (the decode engine finished
    # the requests, the prefill engine sampled their first tokens).
    assert "tandem:time_to_first_token_seconds_count" in metrics
    assert "tandem:e2e_request_latency_seconds_count" in metrics
    assert_clean(scheduler, objects=False)


def test_a_dead_ingress_replicas_requests_are_aborted_on_the_engines(
    serve_app: ServeApp, engines_app: tuple[str, Any]
) -> None:
    """The ingress replica holding the client dies mid-stream: the engines drop its stream,
    the request is aborted once the replica's keep-alives stop, every block freed; Serve's
    new replicas serve again."""
    url, scheduler = engines_app
    client_timeout_s = serve_app.config.client_timeout_s
    kill_the_ingress_mid_stream(url, APP, serve_app.model, scheduler, client_timeout_s)
