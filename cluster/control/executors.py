"""How an ``EngineLoop`` runs its instance's steps: a Ray worker actor, a chain of pipeline-stage
actors, or an in-process worker.

``execute_model`` starts the step as soon as it is called (before its first ``await``), so a
loop keeping several steps in flight starts them in order, and each worker runs them in that
order (Ray runs one caller's tasks on a ``max_concurrency=1`` actor in submission order).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from typing import Any, Protocol

from actors.pipeline import StageReportMerger
from scheduler import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    """Runs one instance's steps."""

    async def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class RayExecutor:
    """Steps a ``ModelWorker`` Ray actor."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def execute_model(self, scheduler_output: SchedulerOutput) -> Any:
        # Not a coroutine: the task is submitted now, the caller awaits the reference.
        return self.handle.execute_model.remote(scheduler_output)


class PipelineExecutor:
    """Steps a ``pp_size`` instance: stage i's output is stage i+1's input (Ray resolves the
    reference, across nodes if need be), so one step is a chain of tasks submitted at once and
    only the last stage's result comes back. The stages' KV reports are merged here."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles
        self.merger = StageReportMerger(len(handles))

    def execute_model(self, scheduler_output: SchedulerOutput) -> Any:
        ref = self.handles[0].execute_model.remote(scheduler_output)
        for handle in self.handles[1:]:
            ref = handle.execute_model.remote(scheduler_output, ref)
        return self._merged(ref)

    async def _merged(self, ref: Any) -> ModelRunnerOutput:
        result: ModelRunnerOutput = await ref
        return self.merger.merge(result)


class LocalExecutor:
    """Steps an in-process ``ModelWorker`` (tests, single-process runs) on one thread, so steps
    in flight run in the order they were started."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix="local-worker")

    async def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        loop = asyncio.get_running_loop()
        result: ModelRunnerOutput = await loop.run_in_executor(
            self._thread, self.worker.execute_model, scheduler_output
        )
        return result


class LocalPipelineExecutor:
    """Steps in-process pipeline stages one after another on one thread (tests; the stages
    do not overlap, but every hand-over and report merge is the real one)."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self.merger = StageReportMerger(len(workers))
        self._thread = cf.ThreadPoolExecutor(1, thread_name_prefix="local-pipeline")

    async def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        loop = asyncio.get_running_loop()
        result: ModelRunnerOutput = await loop.run_in_executor(
            self._thread, self._step, scheduler_output
        )
        return result

    def _step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        carried = None
        for worker in self.workers:
            carried = worker.execute_model(scheduler_output, carried)
        assert isinstance(carried, ModelRunnerOutput)
        return self.merger.merge(carried)
