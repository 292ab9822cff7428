"""The admin routes' gate, without a server: runtime LoRA loading and pool scaling are off
unless enabled, take the admin key (and no other) when one is set, and adapters load only from
below the configured root -- ``..`` and symlinks out of it refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cluster.config import ServeConfig
from cluster.serving.auth import AdminAccess
from cluster.serving.errors import APIError
from cluster.serving.openai_serving import OpenAIServing


def _status(fn: object, *args: object) -> int:
    try:
        fn(*args)  # type: ignore[operator]
    except APIError as exc:
        return exc.status
    return 200


def test_admin_routes_are_off_by_default_and_say_which_setting_enables_them() -> None:
    serve = ServeConfig()
    assert not serve.allow_runtime_lora_updates and not serve.allow_runtime_scaling
    access = AdminAccess.from_config(serve)
    for route, setting in (
        ("lora", "allow_runtime_lora_updates"),
        ("scaling", "allow_runtime_scaling"),
    ):
        with pytest.raises(APIError) as refused:
            access.check(route, None)
        assert refused.value.status == 403 and f"serve.{setting}" in refused.value.message


def test_the_admin_key_replaces_the_api_key_on_admin_routes() -> None:
    both = AdminAccess("user-key", "admin-key", lora=True, scaling=True)
    assert _status(both.check, "lora", "Bearer admin-key") == 200
    assert _status(both.check, "lora", "Bearer user-key") == 401
    assert _status(both.check, "scaling", None) == 401
    api_only = AdminAccess("user-key", None, lora=True, scaling=False)
    assert _status(api_only.check, "lora", "Bearer user-key") == 200
    assert _status(api_only.check, "lora", "Bearer other") == 401
    assert _status(api_only.check, "scaling", "Bearer user-key") == 403
    assert _status(AdminAccess(None, None, lora=True, scaling=True).check, "lora", None) == 200


def test_the_config_refuses_unsafe_combinations() -> None:
    with pytest.raises(ValidationError, match="lora_adapter_root"):
        ServeConfig(allow_runtime_lora_updates=True)
    with pytest.raises(ValidationError, match="must differ"):
        ServeConfig.model_validate({"api_key": "same", "admin_api_key": "same"})
    with pytest.raises(ValidationError, match="absolute"):
        ServeConfig.model_validate({"admin_api_key": "k" * 20, "lora_adapter_root": "adapters"})
    for allow in ("allow_runtime_lora_updates", "allow_runtime_scaling"):  # open to anyone
        with pytest.raises(ValidationError, match="need a key"):
            ServeConfig.model_validate({allow: True, "lora_adapter_root": "/srv/adapters"})
    for key in ("api_key", "admin_api_key"):
        with pytest.raises(ValidationError, match="empty"):
            ServeConfig.model_validate({key: " "})
    ok = ServeConfig.model_validate(
        {
            "allow_runtime_lora_updates": True,
            "lora_adapter_root": "/srv/adapters",
            "admin_api_key": "k" * 20,
        }
    )
    assert ok.lora_adapter_root == "/srv/adapters"


class _Serving:
    """``OpenAIServing.adapter_path`` needs nothing but the root."""

    def __init__(self, root: Path | None) -> None:
        self.lora_adapter_root = None if root is None else str(root)

    adapter_path = OpenAIServing.adapter_path


def test_adapters_load_only_from_below_the_root(tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    (root / "team" / "a").mkdir(parents=True)
    outside = tmp_path / "secrets"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    (root / "alias").symlink_to(root / "team" / "a")
    serving = _Serving(root)
    resolved = str((root / "team" / "a").resolve())
    assert serving.adapter_path("team/a") == resolved  # relative: from the root
    assert serving.adapter_path(str(root / "team" / "a")) == resolved
    assert serving.adapter_path("alias") == resolved  # a symlink that stays inside
    for path in ("/etc", str(outside), "../secrets", "team/../../secrets", "escape", "escape/x"):
        with pytest.raises(APIError) as refused:
            serving.adapter_path(path)
        assert refused.value.status == 403 and refused.value.param == "lora_path", path
    (root / "loop").symlink_to(root / "loop")
    for path in ("nul\x00byte", "loop"):
        with pytest.raises(APIError) as refused:
            serving.adapter_path(path)
        assert refused.value.status == 400 and refused.value.param == "lora_path", path
    assert _Serving(None).adapter_path("/anywhere") == "/anywhere"  # in-process: trusted
    with pytest.raises(APIError) as missing:  # the root is not mounted on this node
        _Serving(tmp_path / "nowhere").adapter_path("a")
    assert missing.value.status == 503


def _call(path: str, authorization: str | None = None, root_path: str = "") -> tuple[int, bool]:
    """``KeyCheck`` in front of an app that answers 200: (status, whether the app was
    reached)."""
    import asyncio

    from cluster.serving.auth import KeyCheck

    reached: list[bool] = []
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(True)
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def receive() -> dict[str, Any]:
        raise AssertionError("the body was read")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    scope = {"type": "http", "path": path, "root_path": root_path, "headers": headers}
    asyncio.run(KeyCheck(app)(scope, receive, send))
    return sent[0]["status"], bool(reached)


@pytest.fixture
def keys() -> Any:
    from cluster.serving.auth import set_access

    admin = AdminAccess("user-key", "admin-key", lora=True, scaling=False)
    set_access("user-key", admin)
    yield
    set_access(None, None)


def test_keys_are_checked_before_the_body_on_the_routes_that_take_them(keys: Any) -> None:
    user, admin = "Bearer user-key", "Bearer admin-key"
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"):
        assert _call(path) == (401, False)
        assert _call(path, "Bearer wrong") == (401, False)
        assert _call(path, user) == (200, True)
    for path in ("/health", "/metrics", "/docs", "/openapi.json"):
        assert _call(path) == (200, True)  # open
    # Admin routes take the admin key and no other; a route that is off is a 403.
    assert _call("/v1/load_lora_adapter", user) == (401, False)
    assert _call("/v1/load_lora_adapter", admin) == (200, True)
    assert _call("/admin/scale_pool", admin) == (403, False)
    # Under a Serve route prefix, the route's own path is what is checked.
    assert _call("/llm/v1/completions", root_path="/llm") == (401, False)
    assert _call("/llm/v1/completions", user, root_path="/llm") == (200, True)
    assert _call("/llm/health", root_path="/llm") == (200, True)
