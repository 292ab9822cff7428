"""A call that reaches a restarted central scheduler before its rebuild waits for it, at most
``RECOVERY_WAIT_S``, then fails with ``UnavailableError`` -- HTTP 503 at the API -- never a
hang."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.control import restart
from cluster.control.restart import Restart
from cluster.errors import UnavailableError
from cluster.serving.errors import api_error


class _Rebuilding(Restart):
    """A restarted actor whose rebuild takes ``seconds`` (and then fails with ``error``)."""

    def __init__(self, seconds: float, error: Exception | None = None) -> None:
        self.recovering = True
        self._recovery = None
        self.seconds = seconds
        self.error = error

    async def _recover(self) -> None:
        await asyncio.sleep(self.seconds)
        self.recovering = False
        if self.error is not None:
            raise self.error


def test_a_call_waits_for_a_rebuild_that_ends_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(restart, "RECOVERY_WAIT_S", 5.0)
    actor = _Rebuilding(0.05)
    asyncio.run(actor._ready())
    assert not actor.recovering


def test_a_rebuild_that_lasts_gives_a_clear_503(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(restart, "RECOVERY_WAIT_S", 0.1)
    actor = _Rebuilding(3600.0)

    async def call() -> BaseException:
        with pytest.raises(UnavailableError) as caught:
            await actor._ready()
        return caught.value

    started = time.monotonic()
    exc = asyncio.run(call())
    assert time.monotonic() - started < 5.0
    error = api_error(exc)
    assert error.status == 503 and "restarting" in str(exc)


def test_a_rebuild_that_failed_gives_every_call_a_503_naming_why() -> None:
    """Not the "not started yet" of an actor that never started: the calls that wait for the
    rebuild and the ones after it say the restart failed and why."""
    actor = _Rebuilding(0.01, RuntimeError("no engine actor left to rebuild the cluster from"))

    async def calls() -> list[BaseException]:
        errors = []
        for _ in range(2):
            with pytest.raises(UnavailableError) as caught:
                await actor._ready()
            errors.append(caught.value)
        return errors

    for exc in asyncio.run(calls()):
        error = api_error(exc)
        assert error.status == 503
        assert "could not rebuild its state: no engine actor left" in error.message


def test_a_client_passes_the_503_on_and_sends_again_only_while_the_process_is_down() -> None:
    """``Subscription._send_batch`` sends its submits again while the central actor's process
    is down or restarting, but passes a restarted one's ``UnavailableError`` on at once (it
    already waited ``RECOVERY_WAIT_S``: sending again doubled the wait)."""
    from ray.exceptions import RayActorError, RayTaskError

    from cluster.control.subscription import send_again

    unavailable = UnavailableError("the central scheduler is restarting")
    wrapped = RayTaskError("submit_many", "traceback", unavailable)
    assert send_again(RayActorError(), engine_actors=True)
    assert not send_again(RayActorError(), engine_actors=False)  # nothing outlives it
    assert not send_again(unavailable, engine_actors=True)
    assert not send_again(wrapped, engine_actors=True)
    assert not send_again(ValueError("refused"), engine_actors=True)


def test_operator_calls_wait_for_the_rebuild(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter registry and the pools of a restarted actor are what its rebuild finds (the
    engines keep the registry, adapters loaded at run time included): a listing, an unload or
    a resize before it ended answered from the empty state, and a change was undone by it.
    Each waits for the rebuild (and starts it: an idle cluster sends nothing else)."""
    from types import SimpleNamespace

    from cluster.control.operations import ClusterOperations

    monkeypatch.setattr(restart, "RECOVERY_WAIT_S", 5.0)

    class _Actor(_Rebuilding, ClusterOperations):
        async def _recover(self) -> None:
            await asyncio.sleep(0.05)
            self.lora.by_name = {"first": "its engines' copy", "second": "another"}
            self.recovering = False

    def fresh() -> _Actor:
        actor = _Actor(0.0)
        actor.lora = SimpleNamespace(by_name={})
        actor.lora.unload = lambda name: actor.lora.by_name.pop(name)
        actor.config = SimpleNamespace(pools=[])
        return actor

    actor = fresh()
    assert asyncio.run(actor.lora_adapters()) == {
        "first": "its engines' copy",
        "second": "another",
    }
    actor = fresh()
    asyncio.run(actor.unload_lora_adapter("second"))  # applied after the rebuild: it stays
    assert actor.lora.by_name == {"first": "its engines' copy"}
    actor = fresh()
    with pytest.raises(ValueError, match="no pool named 'd'"):
        asyncio.run(actor.scale_pool("d", 2))
    assert not actor.recovering  # (refused by the rebuilt actor, not the empty one)


@pytest.mark.parametrize("final", [False, True])
def test_a_failed_rebuild_ends_the_process_for_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch, final: bool
) -> None:
    """Its state half rebuilt, the actor does not try again in place: its calls answer 503
    naming why, and a little later its process ends, for Ray to start a fresh one
    (max_restarts) that tries again -- it answered 503 for good, and kept its engines and
    workers alive by answering their watch. With no engine left at all a fresh one would fail
    alike, for ever: the actor ends for good (the app's health check then builds anew)."""
    ended: list[tuple[str, float]] = []
    monkeypatch.setattr(restart, "REBUILD_RETRY_S", 0.2, raising=False)
    for how in ("_end_process", "_end_for_good"):
        record = lambda how=how: ended.append((how, time.monotonic()))  # noqa: E731
        monkeypatch.setattr(restart, how, record, raising=False)
    error = (
        restart.NothingToRebuild("no engine actor left to rebuild the cluster from")
        if final
        else RuntimeError("no engine actor answered (2 did not, for now)")
    )

    async def failing(actor: object) -> None:
        raise error

    monkeypatch.setattr(restart, "rebuild", failing)

    class _Actor(Restart):
        def __init__(self) -> None:
            self.recovering, self._recovery, self._held_reports = True, None, []

    async def run() -> float:
        actor = _Actor()
        with pytest.raises(UnavailableError, match="no engine actor"):
            await actor._ready()
        failed = time.monotonic()
        assert not ended  # not at once: its calls say why meanwhile
        await asyncio.sleep(0.6)
        return failed

    failed = asyncio.run(run())
    assert len(ended) == 1 and ended[0][1] - failed >= 0.1
    assert ended[0][0] == ("_end_for_good" if final else "_end_process")
