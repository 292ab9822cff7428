"""The cluster's lifetime is explicit: redeploying the Serve app with a new ingress
configuration (fewer replicas, another port setting) keeps the running cluster -- the same
SchedulerActor, its counters going on, requests served through the new replicas -- and a
deployment with other cluster settings is refused, naming them, instead of tearing the
cluster down under running requests."""

from __future__ import annotations

from typing import Any

import pytest

from tests.cluster.conftest import API_KEY, ServeApp, assert_clean

ray = pytest.importorskip("ray")
requests = pytest.importorskip("requests")


def _steps(handle: Any) -> int:
    stats = ray.get(handle.stats.remote())
    return sum(i["num_steps"] for i in stats["instances"].values())


def _chat(app: ServeApp) -> Any:
    body = {
        "model": app.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return requests.post(f"{app.url}/v1/chat/completions", json=body, headers=headers, timeout=60)


def test_redeploying_the_ingress_keeps_the_cluster(serve_app: ServeApp) -> None:
    from ray import serve

    from cluster.serving.app import build_app_from_config

    before = serve_app.scheduler
    assert _chat(serve_app).status_code == 200
    steps = _steps(before)
    config = serve_app.config
    fewer = config.model_copy(
        update={"serve": config.serve.model_copy(update={"ingress_replicas": 1})}
    )
    try:
        serve.run(build_app_from_config(fewer), name="tandem-test", route_prefix="/")
        after = serve_app.scheduler
        assert after._actor_id == before._actor_id  # the same SchedulerActor, not a new one
        reply = _chat(serve_app)
        assert reply.status_code == 200, reply.text
        assert _steps(after) > steps  # its counters went on: nothing was restarted
    finally:
        serve.run(build_app_from_config(config), name="tandem-test", route_prefix="/")
    assert serve_app.scheduler._actor_id == before._actor_id
    assert_clean(before, objects=False)


def test_other_cluster_settings_are_refused_by_name(serve_app: ServeApp) -> None:
    from cluster.control.launch import app_cluster_name, get_or_build_cluster

    changed = serve_app.config.model_copy(update={"block_size": 8})
    with pytest.raises(ValueError, match=r"running with other settings \(block_size\)"):
        get_or_build_cluster(changed, name=app_cluster_name("tandem-test"))
    same = get_or_build_cluster(serve_app.config, name=app_cluster_name("tandem-test"))
    assert same._actor_id == serve_app.scheduler._actor_id


def test_a_dead_ingress_replicas_requests_are_aborted(serve_app: ServeApp) -> None:
    """The ingress replica holding a client dies mid-stream: the client's stream ends with an
    error (no [DONE]), the request is aborted on the cluster and its blocks freed once the
    replica's keep-alives stop (client_timeout_s), and Serve's new replicas serve again."""
    from tests.cluster.serving.ingress_faults import kill_the_ingress_mid_stream

    kill_the_ingress_mid_stream(
        serve_app.url,
        "tandem-test",
        serve_app.model,
        serve_app.scheduler,
        serve_app.config.client_timeout_s,
    )
