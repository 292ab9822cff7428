"""API keys: the one check every HTTP route and the gRPC method make."""

from __future__ import annotations

import secrets

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
