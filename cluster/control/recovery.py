"""Worker-side mechanics of fault recovery: finding dead workers of idle instances, and
bringing a restarted instance's workers back to a clean state. What happens to the requests
(they move) and to routing is the SchedulerActor's part."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from cluster.control.engine_loop import EngineLoop
from cluster.control.placement import MONITOR, InstanceSpec


async def probe_workers(spec: InstanceSpec, timeout_s: float) -> list[str]:
    """Ask every worker of the instance at once how it is, on its monitor thread (which answers
    while a step runs): ``"ok"`` (alive, with its model and cache), ``"empty"`` (Ray restarted
    it: a new process), ``"dead"`` (gone, or restarting), or ``"silent"`` (no answer within
    ``timeout_s``, or an error)."""
    import ray

    calls = [a.health.options(concurrency_group=MONITOR).remote() for a in spec.actors]
    tasks = [asyncio.ensure_future(_awaitable(c)) for c in calls]
    await asyncio.wait(tasks, timeout=timeout_s)
    states = []
    for task in tasks:
        if not task.done():
            task.cancel()
            states.append("silent")
        elif isinstance(task.exception(), ray.exceptions.RayActorError):
            states.append("dead")
        elif task.exception() is not None:  # health() itself failed: no usable answer
            states.append("silent")
        else:
            states.append("ok" if task.result()["ok"] else "empty")
    return states


async def check_workers(loop: EngineLoop, spec: InstanceSpec, timeout_s: float) -> None:
    """Fail the instance if one of its workers died or came back empty (a silent one may be
    busy: a hung step is the step timeout's to find)."""
    states = await probe_workers(spec, timeout_s)
    iid = spec.instance_id
    if "dead" in states and loop.alive:
        loop.fail(f"instance {iid}: a worker died (RayActorError)")
    elif "empty" in states and loop.alive:
        loop.fail(f"instance {iid}: a worker restarted and lost its state")


async def end_hung_workers(spec: InstanceSpec, timeout_s: float = 5.0) -> None:
    """The instance's step outlived ``step_timeout_s``. Kill each worker that still holds its
    state or does not answer at all: it hangs (Ray restarts it under ``max_restarts``). A
    worker that died or already came back empty is left alone: the step was late only because
    its death had not been reported yet, and killing the new process would spend another
    restart."""
    import ray

    states = await probe_workers(spec, timeout_s)
    for actor, state in zip(spec.actors, states, strict=True):
        if state in ("ok", "silent"):
            ray.kill(actor, no_restart=False)


async def restore_workers(spec: InstanceSpec, timeout_s: float) -> bool:
    """Wait for Ray to restart the instance's workers (``max_restarts``), reload the model
    where a process is new and reset every stage's cache (survivors' too: their requests'
    state is stale). True when the workers are ready for a fresh scheduler; False if they did
    not come back within ``timeout_s``."""
    import ray

    deadline = time.monotonic() + timeout_s

    async def within(ref: Any) -> Any:  # (a worker Ray cannot place again waits for ever)
        return await asyncio.wait_for(_awaitable(ref), max(0.0, deadline - time.monotonic()))

    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        try:
            health = [
                await within(a.health.options(concurrency_group=MONITOR).remote())
                for a in spec.actors
            ]
            for actor, state in zip(spec.actors, health, strict=True):
                if not state["ok"]:
                    await within(actor.load_model.remote())
            for actor in spec.actors:
                await within(actor.init_kv_cache.remote(spec.info["num_blocks"]))
            spec.info = await within(spec.actors[-1].info.remote())
        except ray.exceptions.RayActorError:
            continue  # still restarting (or dead for good: then until the deadline)
        except TimeoutError:
            return False
        merger = getattr(spec.executor, "merger", None)
        if merger is not None:  # a pipeline's half-merged stage reports are stale
            merger.forget()
        return True
    return False


async def _awaitable(ref: Any) -> Any:
    return await ref
