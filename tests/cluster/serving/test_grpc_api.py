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
