"""The Serve ingress and a cluster gone for good (``tandem down`` killed it while the app
ran): its health check lets go of the dead cluster's client, and the next request connects
to the cluster Serve's replacement ``TandemCluster`` builds; until that one answers, requests
get a retryable 503, not a 500. The ingress class is driven directly, with stand-ins for the
cluster deployment's handle (nothing of Ray or Serve runs)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from cluster.config import ClusterConfig  # noqa: E402
from cluster.serving.app import OpenAIIngress  # noqa: E402
from cluster.serving.errors import APIError, api_error  # noqa: E402

CONFIG = ClusterConfig.model_validate({"model": "m", "pools": [{"name": "c"}]})


def _ingress(cluster: Any) -> Any:
    # Serve's ingress wrapper (an async constructor) over the class as written.
    return OpenAIIngress.func_or_class.__mro__[1](cluster, CONFIG)


def test_a_request_to_a_cluster_gone_and_not_replaced_yet_is_a_503() -> None:
    async def dead() -> Any:
        raise ray.exceptions.ActorDiedError()

    async def scheduler() -> Any:  # the old TandemCluster replica's dead handle
        return SimpleNamespace(model_info=SimpleNamespace(remote=dead))

    ingress = _ingress(SimpleNamespace(scheduler=SimpleNamespace(remote=scheduler)))

    async def run() -> None:
        with pytest.raises(APIError) as caught:
            await ingress.serving()
        assert caught.value.status == 503

    asyncio.run(run())


@pytest.mark.parametrize("gone", [True, False])
def test_the_health_check_lets_go_only_of_a_cluster_gone_for_good(gone: bool) -> None:
    closed: list[bool] = []

    async def is_gone() -> bool:
        return gone

    ingress = _ingress(SimpleNamespace())
    client = SimpleNamespace(gone=is_gone)
    serving = SimpleNamespace(close=lambda: closed.append(True))
    ingress._client, ingress._serving = client, serving
    asyncio.run(ingress.check_health())  # healthy either way: the ingress itself is fine
    if gone:  # the next request connects anew; the old one's threads end
        assert (ingress._client, ingress._serving, closed) == (None, None, [True])
    else:  # restarting, or only slow: kept
        assert (ingress._client, ingress._serving, closed) == (client, serving, [])


UNREACHABLE = (
    "RpcError: failed to connect to all addresses; last error: UNKNOWN: "
    "ipv4:10.1.2.3:10123: Failed to connect to remote host: Connection refused"
)


def test_a_503_for_an_actor_away_names_none_of_rays_internals() -> None:
    """Ray's actor errors name the actor's id, process id, node IP address and namespace (or
    the address it could not reach): a client -- over HTTP, gRPC, or the open /health route
    -- gets the retryable 503 and no more; the operator reads the rest in the log."""
    died = ray.exceptions.RayActorError(
        None,
        "The actor died unexpectedly before finishing this task.\n\tclass_name: "
        "SchedulerActor\n\tactor_id: 5f3c\n\tpid: 4242\n\tnamespace: tandem\n\tip: 10.1.2.3",
    )
    for exc in (ray.exceptions.ActorUnavailableError(UNREACHABLE, None), died):
        error = api_error(exc)
        assert error.status == 503
        assert "10.1.2.3" not in error.message and "4242" not in error.message

    async def unreachable() -> Any:
        raise ray.exceptions.ActorUnavailableError(UNREACHABLE, None)

    async def scheduler() -> Any:
        return SimpleNamespace(model_info=SimpleNamespace(remote=unreachable))

    ingress = _ingress(SimpleNamespace(scheduler=SimpleNamespace(remote=scheduler)))
    response = asyncio.run(ingress.health())  # (no key: an open route)
    assert response.status_code == 503 and b"10.1.2.3" not in response.body


def test_health_says_why_the_workers_could_not_be_asked_without_a_remote_traceback() -> None:
    from cluster.serving.serving_admin import ModelsAndOperations

    async def check_health() -> Any:  # what str() of a RayTaskError reads like
        raise RuntimeError(
            "ray::SchedulerActor.worker_health() (pid=4242, ip=10.1.2.3)\n  File "
            '"/srv/tandem/cluster/control/scheduler_actor.py", line 812, in worker_health'
        )

    serving = SimpleNamespace(engine=SimpleNamespace(check_health=check_health))
    status, body = asyncio.run(ModelsAndOperations.health(serving))  # type: ignore[arg-type]
    assert status == 503 and body["status"] == "unavailable"
    assert "10.1.2.3" not in body["error"] and "scheduler_actor.py" not in body["error"]
