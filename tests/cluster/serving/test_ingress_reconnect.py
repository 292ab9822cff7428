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
from cluster.serving.errors import APIError  # noqa: E402

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
