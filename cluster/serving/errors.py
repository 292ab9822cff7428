"""The API's view of errors: ``APIError`` carries the HTTP status and OpenAI's error body
(the gRPC API maps the status on to a status code); ``api_error`` maps whatever the engine
raised to one.
"""

from __future__ import annotations

import logging
from typing import Any

from cluster.errors import (
    AdapterLoadError,
    ClientDroppedError,
    OverloadedError,
    UnavailableError,
    UnknownModelError,
    is_rejection,
)

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
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
    if isinstance(exc, AdapterLoadError):  # (a ValueError: before the 400 of any other)
        return APIError(404 if exc.missing else 400, str(exc), param="model")
    if isinstance(exc, UnavailableError | ClientDroppedError):
        return APIError(503, str(exc))
    if _actor_gone(exc):
        # Ray's text names the actor's id, process id, node IP address and namespace (or the
        # address it could not reach): the operator's to read, in the log, not every client's.
        logger.warning("a cluster actor is unreachable: %s", exc)
        return APIError(503, "the cluster is unavailable (an actor died or restarts); retry")
    if _deployment_unavailable(exc):  # the app's TandemCluster failed to deploy
        return APIError(503, f"the cluster is unavailable: {getattr(exc, 'message', exc)}")
    if "no live decode-capable instance" in str(exc):  # every decode instance is gone
        return APIError(503, str(exc))
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), param=param)
    logger.exception("internal error", exc_info=exc)
    return APIError(500, "internal server error")


def _actor_gone(exc: BaseException) -> bool:
    """A Ray actor on the request's path (the central scheduler) died or cannot be reached:
    retryable, as its restart (``max_restarts``) brings it back."""
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover - the app runs in Ray
        return False
    return isinstance(exc, RayActorError)


def _deployment_unavailable(exc: BaseException) -> bool:
    """A Serve deployment on the request's path has no replica and will start none (it failed
    to deploy: e.g. ``TandemCluster`` refusing a running cluster's other settings). Its
    ``str`` is empty; ``message`` names it."""
    try:
        from ray.serve.exceptions import DeploymentUnavailableError
    except ImportError:  # pragma: no cover - the app runs in Ray
        return False
    return isinstance(exc, DeploymentUnavailableError)


def generation_error(error: str | None) -> APIError:
    """The API error for a sample the cluster ended with ``finish_reason="error"``: a request
    an instance engine refused (``cluster.errors.rejection``) is the client's 400; any other
    failure a 503 the client may retry."""
    if is_rejection(error):
        return APIError(400, error or "")
    return APIError(503, error or "generation failed")


def ended_by_cluster(sample: Any) -> bool:
    """A sample (``CompletionOutput``) the cluster ended, not its client or its limits:
    failed (``error``), or aborted by the cluster itself -- ``tandem down`` ends what is in
    flight with ``abort`` and a reason ("shutdown"); a client's abort carries none."""
    reason = sample.finish_reason
    return reason == "error" or (reason == "abort" and sample.error is not None)


def sample_error(sample: Any) -> APIError:
    """The API error of a sample ``ended_by_cluster``: an abort the cluster decided is a
    503 the client may retry (it was a 200 with ``finish_reason: "abort"``, which is none
    of OpenAI's values, and a truncated or empty answer)."""
    if sample.finish_reason == "abort":
        return APIError(503, f"the cluster ended the request ({sample.error}); retry")
    return generation_error(sample.error)


def body_path(loc: list[Any], body: Any, missing: bool) -> list[str]:
    """The parts of ``loc`` that step into ``body`` (keys and indexes the client sent),
    without pydantic's union-member tags; a missing field's name (last) is kept too."""
    path, value = [], body
    for i, part in enumerate(loc):
        if (isinstance(value, dict) and part in value) or (
            isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value)
        ):
            value = value[part]
        elif not (missing and i == len(loc) - 1):
            continue  # a union member ("str", "list[str]") or a key's check ("[key]")
        path.append(str(part))
    return path
