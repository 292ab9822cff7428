"""API keys: the one check every HTTP route and the gRPC method make, and the admin routes' gate."""

from __future__ import annotations

import json
import secrets
from typing import Any

from cluster.serving.errors import APIError


def check_api_key(api_key: str | None, authorization: str | None) -> None:
    """401 unless ``authorization`` (an HTTP header or gRPC metadata value) is
    ``Bearer <api_key>``; with no key configured, anything goes. Constant-time comparison."""
    if api_key is None:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(
        token.strip().encode(), api_key.encode()
    ):
        raise APIError(401, "missing or wrong API key (Authorization: Bearer <key>)")


_ADMIN_SETTINGS = {"lora": "allow_runtime_lora_updates", "scaling": "allow_runtime_scaling"}


class AdminAccess:
    """Who may call the admin routes: runtime LoRA loading (``lora``) and pool scaling
    (``scaling``). Each is off unless its setting is on (403 naming the setting); when an admin
    key is set they take it and no other (the inference key is a 401 there), else the API key.
    """

    def __init__(
        self,
        api_key: str | None,
        admin_key: str | None,
        *,
        lora: bool,
        scaling: bool,
    ) -> None:
        self.key = admin_key if admin_key is not None else api_key
        self.enabled = {"lora": lora, "scaling": scaling}

    @classmethod
    def from_config(cls, serve: Any) -> AdminAccess:
        """From a ``ServeConfig``."""

        def secret(value: Any) -> str | None:
            return None if value is None else str(value.get_secret_value())

        return cls(
            secret(serve.api_key),
            secret(serve.admin_api_key),
            lora=serve.allow_runtime_lora_updates,
            scaling=serve.allow_runtime_scaling,
        )

    def check(self, route: str, authorization: str | None) -> None:
        """401 for a missing or wrong key, then 403 if the route is off."""
        check_api_key(self.key, authorization)
        if not self.enabled[route]:
            setting = _ADMIN_SETTINGS[route]
            raise APIError(403, f"this route is disabled; set serve.{setting}: true to enable it")


# -- the HTTP check, before the body is read ---------------------------------------------------
# Serve freezes the FastAPI app when the ingress is decorated, so the keys cannot be the
# middleware's arguments: each ingress replica sets them when it starts (``set_access``).
_access: dict[str, Any] = {"api_key": None, "admin": None}
# Routes that take the inference key (besides everything under /v1/), and the admin routes.
_KEYED = ("/tokenize", "/detokenize")
_ADMIN_ROUTES = {
    "/v1/load_lora_adapter": "lora",
    "/v1/unload_lora_adapter": "lora",
    "/admin/scale_pool": "scaling",
}


def set_access(api_key: str | None, admin: AdminAccess | None) -> None:
    """This process's keys (the ingress replica's ``serve.api_key`` and admin access)."""
    _access["api_key"], _access["admin"] = api_key, admin


def check_route(path: str, authorization: str | None) -> None:
    """The key check of route ``path`` (``APIError`` 401 / 403); open routes pass."""
    route = _ADMIN_ROUTES.get(path)
    admin = _access["admin"]
    if route is not None and admin is not None:
        admin.check(route, authorization)
    elif path.startswith("/v1/") or path in _KEYED:
        check_api_key(_access["api_key"], authorization)


class KeyCheck:
    """A pure ASGI middleware: a request without the right key is a 401 (or 403 for a
    disabled admin route) before its body is read -- as vLLM checks it, so a caller without
    the key learns nothing of the body's validation (it was a 400 naming the fields)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            authorization = None
            for name, value in scope.get("headers", ()):
                if name.lower() == b"authorization":
                    authorization = value.decode("latin-1")
            # The route's own path: under a Serve route prefix, ``path`` starts with it
            # (``root_path``).
            path, root = scope.get("path", ""), scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root) :] or "/"
            try:
                check_route(path, authorization)
            except APIError as exc:
                body = json.dumps(exc.body()).encode()
                headers = [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ]
                await send(
                    {"type": "http.response.start", "status": exc.status, "headers": headers}
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
