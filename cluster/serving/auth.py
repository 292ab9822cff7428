"""API keys: the one check every HTTP route and the gRPC method make, and the admin routes' gate."""

from __future__ import annotations

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
