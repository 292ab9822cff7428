"""Errors the control plane raises to its callers, whatever their front end.

The SchedulerActor raises ``OverloadedError`` and ``UnknownModelError`` (a ``ValueError`` stays
what it is everywhere: a request that can never be served); ``cluster.serving.errors`` maps
them to HTTP statuses and OpenAI's error body. Both cross Ray intact (``__reduce__``).
"""

from __future__ import annotations


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


class UnavailableError(RuntimeError):
    """The central scheduler is restarting and did not recover in time (503); the request
    may be sent again."""

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (type(self), (str(self),))


class EngineDeadError(UnavailableError):
    """The in-process engine's step failed (vLLM's name): its state cannot be trusted, so it
    serves no more requests until it is restarted (503)."""


class StreamLostError(UnavailableError):
    """A request's stream from the cluster broke before its end -- the central scheduler
    dropped its client or lost the request in a restart, an output went missing with a
    broken stream (503); the request may be sent again."""


class ClientDroppedError(RuntimeError):
    """A submit (or subscribe) of a client the central scheduler dropped -- it fell silent for
    ``client_timeout_s``, or its stream ended -- that arrived after the drop: the request was
    not placed and may be sent again (503: a new subscription takes it), not a bug's 500. Not
    an ``UnavailableError``: a client that reads it must not wait for a restart that is not
    happening (``subscription._central_gone``)."""

    def __reduce__(self) -> tuple[type, tuple[str]]:  # crosses Ray intact
        return (type(self), (str(self),))


REJECTED = "request rejected: "


def rejection(reason: str) -> str:
    """The error text of a request an instance engine refused as unservable (its own fault:
    the API answers 400). The text travels as it is through every hop to the ingress, so the
    mark is its prefix; anything else the cluster failed is a 503."""
    return REJECTED + reason


def is_rejection(error: str | None) -> bool:
    return error is not None and error.startswith(REJECTED)


class UnknownModelError(LookupError):
    """A model name that is neither the served model nor a loaded LoRA adapter (404)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"The model `{name}` does not exist.")
        self.name = name

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (type(self), (self.name,))


class AdapterLoadError(ValueError):
    """The LoRA adapter a request names (as its model) could not be loaded on the instance it
    was routed to: its files are not on that instance's node (``missing``: 404, as vLLM's
    "No adapter found"), or the model cannot take it (400). The message names the adapter and
    the instance, never the adapter's path (it goes to any client with the API key; the
    actor logs the loader's own error)."""

    def __init__(self, name: str, instance_id: str, missing: bool) -> None:
        why = (
            "its files are not on that instance's node"
            if missing
            else "the model cannot take it (see the cluster's log)"
        )
        super().__init__(
            f"The model `{name}` (a LoRA adapter) could not be loaded on instance "
            f"{instance_id}: {why}."
        )
        self.name = name
        self.instance_id = instance_id
        self.missing = missing

    def __reduce__(self) -> tuple[type, tuple[str, str, bool]]:  # crosses Ray intact
        return (type(self), (self.name, self.instance_id, self.missing))


def failure_text(exc: BaseException) -> str:
    """``Kind: message`` of a failure that ends requests: their error reaches clients (the
    503 of a request that could not move elsewhere). Ray's own errors name an actor's id,
    process id, node address and namespace, and a remote task's its traceback's files: of
    those only the kind (a task's: its own exception's kind and message) -- the rest is the
    log's."""
    try:
        from ray.exceptions import RayError, RayTaskError
    except ImportError:  # pragma: no cover - the control plane runs in Ray
        return f"{type(exc).__name__}: {exc}"
    cause = getattr(exc, "cause", None)
    if isinstance(exc, RayTaskError) and isinstance(cause, BaseException):
        exc = cause  # (the worker's own exception: its text is the worker code's)
    if isinstance(exc, RayError):
        return type(exc).__name__
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
