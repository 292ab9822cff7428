"""Virtual time for asyncio: an event loop whose clock jumps to the next timer instead of
waiting for it, so the control plane's own coroutines -- the ``SchedulerActor``, its
``InstanceEngine``s and their ``EngineLoop``s -- run unchanged in simulated time.

asyncio's loop asks its selector to wait until the next timer is due (``select(timeout)``);
this selector advances the loop's clock by that timeout and returns at once. Everything that
``asyncio.sleep``s, ``call_later``s or waits with a timeout runs in virtual seconds, and while
``run_virtual`` runs, ``time.monotonic()`` reads the virtual clock too: the control plane's own
timestamps (a request's first token, its latencies in the metrics and the autoscaler's
signals, a drain's deadline) are simulated ones. Nothing may wait on a thread or a socket: a
loop with no timer and nothing ready would wait forever, and raises ``SimulationStalled``.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Mapping
from typing import Any
from unittest import mock


class SimulationStalled(RuntimeError):
    """The simulated cluster waits for something that no timer will bring (a bug)."""


class _Keys(Mapping[Any, selectors.SelectorKey]):
    def __init__(self, keys: dict[int, selectors.SelectorKey]) -> None:
        self._keys = keys

    def __getitem__(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys[_fd(fileobj)]

    def __iter__(self) -> Any:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _fd(fileobj: Any) -> int:
    return fileobj if isinstance(fileobj, int) else int(fileobj.fileno())


class _VirtualSelector(selectors.BaseSelector):
    """Keeps the loop's registrations (its self-pipe) and never waits."""

    def __init__(self) -> None:
        self._keys: dict[int, selectors.SelectorKey] = {}
        self.loop: VirtualTimeLoop | None = None

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, _fd(fileobj), events, data)
        self._keys[key.fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(_fd(fileobj))

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        assert self.loop is not None
        if timeout is None:
            raise SimulationStalled(
                "the simulated cluster waits with no timer pending (it would hang forever)"
            )
        self.loop.advance(max(timeout, 0.0))
        return []

    def close(self) -> None:
        self._keys.clear()

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return _Keys(self._keys)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop on a virtual clock that starts at 0 and moves only when every ready
    callback has run and the next timer is due."""

    def __init__(self) -> None:
        selector = _VirtualSelector()
        self._now = 0.0
        super().__init__(selector)
        selector.loop = self

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += seconds


def run_virtual(main: Any) -> Any:
    """Run coroutine ``main`` to completion on a fresh ``VirtualTimeLoop``."""
    loop = VirtualTimeLoop()
    try:
        with mock.patch("time.monotonic", loop.time):
            return loop.run_until_complete(main)
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            loop.close()
