"""schemathesis against the app's own OpenAPI schema (from the live app): generated requests,
valid and not, to every route. None may end in a 5xx or hang (bounded: a few examples per
route, each call with a timeout)."""

from __future__ import annotations

from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from tests.cluster.conftest import API_KEY, ServeApp, assert_clean  # noqa: E402


def _prepare(case: Any, app: ServeApp) -> None:
    body = case.body if isinstance(case.body, dict) else None
    # Mostly the real model, so that generation runs (random names stop at the 404); never
    # "broken", the adapter the fixture misconfigures on purpose (its 500 is tested in
    # test_serve_errors).
    model = None if body is None else body.get("model")
    if body is not None and isinstance(model, str) and (model == "broken" or len(model) % 4):
        body["model"] = app.model
    if case.path == "/v1/unload_lora_adapter" and body is not None:
        body["lora_name"] = f"x-{body.get('lora_name')}"  # never the real adapters


def test_no_server_error_and_no_hang(serve_app: ServeApp) -> None:
    api = schemathesis.openapi.from_url(f"{serve_app.url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= paths
    seen: dict[str, set[int]] = {}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=12,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: Any) -> None:
            _prepare(case, serve_app)
            response = case.call(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
            seen.setdefault(case.path, set()).add(response.status_code)
            case.validate_response(response, checks=[not_a_server_error])
            assert response.status_code < 500, (case.path, case.body, response.text)

        check()
    # The fuzzing reached past validation: some generations succeeded, some were refused.
    assert 200 in seen["/v1/completions"] | seen["/v1/chat/completions"], seen
    assert 400 in seen["/v1/completions"], seen


def test_nothing_left_after_the_fuzzing(serve_app: ServeApp) -> None:
    assert_clean(serve_app.scheduler, timeout_s=30, objects=False)
