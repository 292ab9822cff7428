"""The gRPC API's request mapping (``cluster.serving.grpc_api``), without a server: the
served end to end is in ``test_serve_errors.py``."""

from __future__ import annotations

import pytest

from cluster.proto import tandem_pb2
from cluster.serving.errors import APIError
from cluster.serving.grpc_api import completion_request


def test_a_request_without_a_model_is_for_the_served_one_as_over_http() -> None:
    """proto3 has no unset string: ``model`` left out reads "", which means the served model
    (it was refused: "model: String should have at least 1 character")."""
    request = completion_request(tandem_pb2.GenerateRequest(prompt="hi", max_tokens=3))
    assert request.model is None and request.prompt == "hi" and request.max_tokens == 3


def test_max_tokens_left_out_is_what_the_context_leaves() -> None:
    """tandem.proto: max_tokens unset = what the context leaves (None), not HTTP's 16."""
    assert completion_request(tandem_pb2.GenerateRequest(prompt="hi")).max_tokens is None


def test_a_bad_field_is_named_in_the_error() -> None:
    with pytest.raises(APIError) as info:
        completion_request(tandem_pb2.GenerateRequest(prompt="hi", temperature=5.0))
    assert info.value.status == 400 and info.value.param == "temperature"
    assert "temperature" in info.value.message


def test_a_bad_prompt_is_named_as_the_field_not_as_pydantics_union_member() -> None:
    with pytest.raises(APIError) as info:
        completion_request(tandem_pb2.GenerateRequest(prompt_token_ids=[-1]))
    assert info.value.status == 400 and info.value.param == "prompt"
    assert "list[" not in info.value.message and "prompt.0:" in info.value.message


def test_an_app_whose_cluster_deployment_failed_answers_503_not_500() -> None:
    """A redeploy that ``TandemCluster`` refuses (a running cluster's other settings) leaves
    it with no replica for good: every ingress's first call to it raises Serve's
    ``DeploymentUnavailableError`` (whose ``str`` is empty). That is the cluster being
    unavailable -- 503 / UNAVAILABLE naming the deployment -- not an internal error (500)."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.exceptions import DeploymentUnavailableError

    from cluster.serving.errors import api_error
    from cluster.serving.grpc_api import STATUS_CODES

    exc = DeploymentUnavailableError(DeploymentID(name="TandemCluster", app_name="tandem"))
    error = api_error(exc)
    assert error.status == 503 and "TandemCluster" in error.message
    assert STATUS_CODES[error.status].name == "UNAVAILABLE"


def test_a_stopping_ingress_lets_its_own_grpc_calls_end_then_takes_no_more() -> None:
    """The gRPC server an ingress replica runs itself (TLS, or grpc_server: ingress): Serve
    drains only the requests it counts before it kills a stopping replica, and these calls
    are not among them. Serve's last call on the replica (its ingress wrapper's ``__del__``,
    which calls the class's own) stops the server with a grace: the call in flight runs to
    its end, then a new one is refused. (The calls were cut mid-stream.)"""
    import asyncio
    from types import SimpleNamespace
    from typing import Any

    import grpc

    from cluster.config import ClusterConfig
    from cluster.engine.outputs import CompletionOutput, RequestOutput
    from cluster.proto import tandem_pb2_grpc
    from cluster.serving.app import OpenAIIngress
    from cluster.serving.grpc_api import IngressGenerateServer
    from tests.cluster.conftest import free_port

    steps = 20

    class Slow:
        """What ``generate_stream`` asks of ``OpenAIServing``: one job, a step every 20 ms."""

        tracer = None
        model_name = "m"

        async def resolve(self, model: Any) -> None:
            return None

        async def completion_jobs(self, request: Any) -> list[Any]:
            return [SimpleNamespace(prompt_ids=[1, 2, 3])]

        async def run(self, rid: str, jobs: list[Any], *args: Any) -> Any:
            async def outputs() -> Any:
                sample = CompletionOutput(index=0)
                for step in range(steps):
                    await asyncio.sleep(0.02)
                    sample.new_token_ids, sample.new_text = [step], "x"
                    sample.token_ids.append(step)
                    sample.finish_reason = "length" if step == steps - 1 else None
                    yield jobs[0], RequestOutput(rid, None, [1, 2, 3], [sample])

            return outputs()

    async def serving() -> Any:
        return Slow()

    config = ClusterConfig.model_validate({"model": "m", "pools": [{"name": "c"}]})
    wrapper = OpenAIIngress.func_or_class  # Serve's ingress wrapper over the class
    ingress = wrapper.__mro__[1](SimpleNamespace(), config)  # (the class as written)

    async def main() -> None:
        address = f"127.0.0.1:{free_port()}"
        server = IngressGenerateServer(serving, None, address, None, None, 1 << 20, 8)
        await server.start()
        ingress._grpc_server = server
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = tandem_pb2_grpc.GenerateStub(channel)
                request = tandem_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3])
                call = stub.Generate(request, timeout=30)
                responses = [await call.read()]
                stopping = asyncio.ensure_future(wrapper.__del__(ingress))  # as Serve calls it
                while (response := await call.read()) is not grpc.aio.EOF:
                    responses.append(response)
                assert await call.code() == grpc.StatusCode.OK
                assert len(responses) == steps and responses[-1].finish_reason == "length"
                await asyncio.wait_for(stopping, 30)
                later = stub.Generate(tandem_pb2.GenerateRequest(prompt_token_ids=[1]), timeout=5)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await later.read()
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:  # (a failed check leaves no server running)
            await server.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_the_ingress_grpc_server_refuses_a_call_without_the_key_before_reading_it() -> None:
    """As the HTTP API checks the key before the body: a call without it is UNAUTHENTICATED
    from its metadata, its message never read -- so one over the size limit too (it was
    received first, up to the limit, and refused as too large: any caller could make the
    replica take in a message of that size on each of its concurrent calls)."""
    import asyncio
    from typing import Any

    import grpc

    from cluster.proto import tandem_pb2_grpc
    from cluster.serving.grpc_api import IngressGenerateServer
    from tests.cluster.conftest import free_port

    asked: list[bool] = []

    async def serving() -> Any:
        asked.append(True)
        raise AssertionError("no call gets this far")

    async def code(stub: Any, key: str | None) -> Any:
        metadata = [("authorization", f"Bearer {key}")] if key else []
        request = tandem_pb2.GenerateRequest(prompt="x" * 4096)  # over the limit of 1 KiB
        try:
            async for _ in stub.Generate(request, metadata=metadata, timeout=10):
                pass
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        raise AssertionError("the call succeeded")

    async def main() -> None:
        address = f"127.0.0.1:{free_port()}"
        server = IngressGenerateServer(serving, "k" * 20, address, None, None, 1024, 8)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = tandem_pb2_grpc.GenerateStub(channel)
                assert await code(stub, None) == grpc.StatusCode.UNAUTHENTICATED
                assert await code(stub, "wrong") == grpc.StatusCode.UNAUTHENTICATED
                # With the key the message is read, and its size refused.
                assert await code(stub, "k" * 20) == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            await server.stop()
        assert asked == []

    asyncio.run(asyncio.wait_for(main(), 60))
