"""Errors, and the API's view of them.

The SchedulerActor raises ``OverloadedError`` and ``UnknownModelError`` to its callers (a
``ValueError`` stays what it is everywhere: a request that can never be served, 400);
``api_error`` maps whatever the cluster raised to an ``APIError``: the HTTP status and OpenAI's
error body (the gRPC API maps the status on to a status code).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class OverloadedError(RuntimeError):
    """More requests wait to be scheduled than ``serve.max_waiting_requests`` allows (429)."""

    def __init__(self, num_waiting: int, bound: int, retry_after_s: int) -> None:
        super().__init__(
            f"the cluster is overloaded: {num_waiting} requests are waiting to be scheduled "
            f"(bound: {bound}); retry in {retry_after_s} s"
        )
        self.num_waiting = num_waiting
        self.bound = bound
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[type, tuple[int, int, int]]:  # crosses Ray intact
        return (type(self), (self.num_waiting, self.bound, self.retry_after_s))


class UnknownModelError(LookupError):
    """A model name that is neither the served model nor a loaded LoRA adapter (404)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.")
        self.name = name

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (type(self), (self.name,))


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error with its HTTP status and OpenAI's JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:  # crosses Ray (the gRPC proxy) intact
        return (type(self), (self.status, self.message, self.param, self.headers))

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES.get(self.status, "APIError"),
                "param": self.param,
                "code": self.status,
            }
        }


def api_error(exc: BaseException, param: str | None = None) -> APIError:
    """The API error for what the cluster raised (internal failures: 500, no details)."""
    if isinstance(exc, APIError):
        return exc
    cause = getattr(exc, "cause", None)  # a RayTaskError: the actor's own exception
    if isinstance(cause, BaseException):
        exc = cause
    if isinstance(exc, OverloadedError):
        return APIError(429, str(exc), headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, UnknownModelError):
        return APIError(404, str(exc), param="model")
    if "no live decode-capable instance" in str(exc):  # every decode instance is gone
        return APIError(503, str(exc))
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), param=param)
    logger.exception("internal error", exc_info=exc)
    return APIError(500, "internal server error")
