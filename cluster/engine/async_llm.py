"""``AsyncLLM``: the in-process engine (``LLMEngine``) behind the ``EngineClient`` contract, so
the serving code that fronts a Ray cluster fronts one process just as well (a laptop, tests)::

    engine = AsyncLLM.from_config(model, num_blocks=256)
    serving = OpenAIServing(engine, "my-model")       # the same API as the cluster's

One asyncio task steps the engine while requests are live; each step runs in a worker thread
so the event loop keeps accepting and streaming. ``LLMEngine`` is not thread-safe, so every
call into it (add, abort, a step, an adapter load) holds one lock. Outputs cross from the
step's thread to each request's consumer as snapshots: the engine updates its outputs in
place, and a consumer that lags still sees every step's delta.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import threading
from collections.abc import AsyncGenerator
from typing import Any

from actors.model.tokenizer import Tokenizer
from cluster.engine.llm_engine import LLMEngine
from cluster.engine.local_metrics import LocalMetrics
from cluster.engine.outputs import RequestOutput
from cluster.engine.protocol import EngineClient
from cluster.engine.streams import Mailbox
from cluster.errors import EngineDeadError
from scheduler import LoRARequest, RequestStatus, SamplingParams

logger = logging.getLogger(__name__)

INSTANCE_ID = "local"  # the one instance, as metrics and health name it


class AsyncLLM(EngineClient):
    """An ``LLMEngine`` stepped by an asyncio task. Use it from one event loop at a time (a
    later one, e.g. the next ``asyncio.run``, takes it over)."""

    def __init__(self, engine: LLMEngine, model_name: str = "local", metrics: Any = None) -> None:
        """``metrics``: a ``MetricsConfig`` (the SLOs goodput is judged against, vLLM's
        names); None: its defaults, as a cluster's."""
        self.engine = engine
        self.model_name = model_name  # the ``model_name`` label of its metrics
        # (fed from the event loop)
        self.metrics = LocalMetrics(model_name, INSTANCE_ID, slo=metrics)
        self._lock = asyncio.Lock()  # one call into the engine at a time (``_locked``)
        self._lock_loop: asyncio.AbstractEventLoop | None = None
        # The engine itself, held by a step's thread: a step whose event loop ends (its task
        # cancelled, the asyncio lock let go) runs on, and nothing may touch the engine
        # until it returns (the next loop's abort, or step).
        self._engine_lock = threading.Lock()
        self._queues: dict[str, Mailbox[RequestOutput | BaseException]] = {}
        self._aborts: set[str] = set()  # applied before the next step
        self._task: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None  # a step failed: the engine is dead
        self._ids = itertools.count()
        self._adapters: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)

    @classmethod
    def from_config(cls, model: str | None = None, **config: Any) -> AsyncLLM:
        """Build the engine (``LLMEngine``'s knobs) and wrap it."""
        name = config.pop("model_name", None) or "local"
        metrics = config.pop("metrics", None)  # (a MetricsConfig)
        return cls(LLMEngine(model, **config), name, metrics)

    # -- EngineClient ------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def priority_scheduling(self) -> bool:
        return self.engine.factory.priority_scheduling

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        self.engine.factory.validate(prompt_token_ids)

    async def generate_async(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        trace_context: dict[str, str] | None = None,
        prompt_index: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs, one per step that moved it (``trace_context`` and
        ``prompt_index`` are accepted and unused: the in-process engine emits no spans and
        bounds no queue)."""
        rid = request_id or f"local-{next(self._ids)}"
        queue: Mailbox[RequestOutput | BaseException] = Mailbox()
        async with self._locked():
            if self._failure is not None:
                raise EngineDeadError(f"the engine failed and serves no more: {self._failure!r}")
            if rid in self._queues:  # (a finished stream not closed yet holds it)
                raise ValueError(f"request id {rid!r} is in use")
            with self._engine_lock:
                if rid in self._aborts:  # an earlier request of this id, left: it ends now
                    self._aborts.discard(rid)  # (as vLLM's abort), so the id is free at once
                    self.engine.abort_request([rid])
                    self.engine.processor.forget({rid})  # (its final has no reader)
                    self.metrics.forgotten(rid)
                # Raises ValueError (bad prompt, id in use, LoRA not enabled) before any output.
                self.engine.add_request(
                    rid, prompt, params, lora_request=lora_request, priority=priority
                )
                taken = self.engine.processor.requests[rid]
                self.metrics.added(rid, len(taken.output.prompt_token_ids), taken.samples[0].params)
            self._queues[rid] = queue
        self._ensure_stepping()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine failed: nothing left to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            if self._queues.get(rid) is queue:
                del self._queues[rid]
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """End a request (its stream ends with ``abort``), from any thread: outside the
        event loop serving the engine it is handed to that loop."""
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        serving = self._lock_loop  # the loop of the latest calls into the engine
        elsewhere = serving is not None and serving is not running and serving.is_running()
        if running is not None and not elsewhere:
            self._aborts.add(request_id)
            self._ensure_stepping()
            return
        if serving is not None and elsewhere:
            with contextlib.suppress(RuntimeError):  # (it closed meanwhile: as below)
                serving.call_soon_threadsafe(self.abort, request_id)
                return
        self._aborts.add(request_id)  # no loop serves it now: the next one's step applies it

    async def lora_adapters(self) -> dict[str, LoRARequest]:
        return dict(self._adapters)

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        if name in self._adapters:
            raise ValueError(f"adapter {name!r} is already loaded")
        lora = LoRARequest(lora_name=name, lora_int_id=next(self._lora_ids), lora_path=path)
        async with self._locked():  # loaded now: a bad adapter fails here, not on a request
            try:
                await asyncio.to_thread(self.engine.worker.add_lora, lora)
            except Exception as exc:  # (a missing file is an OSError): the caller's path
                raise ValueError(f"lora_path {path!r} could not be loaded: {exc}") from None
        self._adapters[name] = lora
        return lora

    async def unload_lora_adapter(self, name: str) -> None:
        lora = self._adapters.pop(name)  # KeyError: not served
        async with self._locked():
            self.engine.worker.remove_lora(lora.lora_int_id)

    async def metrics_text(self) -> str:
        """Prometheus text: the request-level series the cluster's SchedulerActor records
        (``LocalMetrics``), then the engine's gauges (running, waiting, KV usage, steps)."""
        s = self.engine.scheduler
        instance = {
            "role": "both",
            "alive": int(self._failure is None),
            "num_running": len(s.running),
            "num_waiting": len(s.waiting) + len(s.holding),
            "kv_cache_usage": s.kv_cache_manager.usage,
            "num_free_blocks": s.kv_cache_manager.block_pool.num_free_blocks,
            "num_steps": s.num_steps,
        }
        return self.metrics.render({"instances": {INSTANCE_ID: instance}})

    async def engine_stats(self) -> dict[str, Any]:
        s = self.engine.scheduler
        instance = {
            "role": "both",
            "alive": self._failure is None,
            "num_requests": len(s.requests),
            "num_unfinished": s.get_num_unfinished_requests(),
            "num_running": len(s.running),
            "num_waiting": len(s.waiting) + len(s.holding),
            "kv_cache_usage": s.kv_cache_manager.usage,
            "num_free_blocks": s.kv_cache_manager.block_pool.num_free_blocks,
            "num_blocks": s.cache_config.num_blocks,
            "num_steps": s.num_steps,
        }
        return {"num_flights": len(self._queues), "instances": {INSTANCE_ID: instance}}

    async def live_requests(self) -> dict[str, dict[str, Any]]:
        """The requests being streamed; ``phase``: queued (waiting or preempted), prefill
        (running, prompt not all computed) or decode."""
        # A step (in another thread) may add or drop requests meanwhile: iterating the dict
        # could raise; list() copies it in one go (no Python code runs, so the GIL is held).
        by_client: dict[str, list[Any]] = {}
        for r in list(self.engine.scheduler.requests.values()):
            rid = r.request_id  # or a sample's: "<rid>#<i>"
            client = rid if rid in self._queues else rid.rpartition("#")[0]
            by_client.setdefault(client, []).append(r)
        result: dict[str, dict[str, Any]] = {}
        for rid in sorted(self._queues):
            samples = by_client.get(rid, [])
            running = [r for r in samples if r.status == RequestStatus.RUNNING]
            prefill = any(r.num_computed_tokens < r.num_prompt_tokens for r in running)
            result[rid] = {
                "instance": INSTANCE_ID,
                "phase": ("prefill" if prefill else "decode") if running else "queued",
                "num_tokens_sent": sum(r.num_output_tokens for r in samples),
                "num_moves": 0,
            }
        return result

    async def transfer_history(self) -> dict[str, list[Any]]:
        return {INSTANCE_ID: []}  # one instance: no KV moves between instances

    async def reset_prefix_cache(self) -> bool:
        async with self._locked():
            return self.engine.scheduler.reset_prefix_cache()

    async def scale_pool(self, pool: str, replicas: int) -> dict[str, Any]:
        raise ValueError("the in-process engine is one instance: it has no pool to resize")

    async def check_health(self) -> dict[str, bool]:
        ok = self._failure is None and bool(self.engine.worker.health()["ok"])
        return {INSTANCE_ID: ok}

    def _locked(self) -> asyncio.Lock:
        """The lock of the running event loop's calls: a lock binds to the first loop that
        waits on it, so one made in an earlier loop (closed, its holder maybe cancelled)
        would refuse this one's calls ("bound to a different event loop")."""
        loop = asyncio.get_running_loop()
        if self._lock_loop is not loop:
            self._lock, self._lock_loop = asyncio.Lock(), loop
        return self._lock

    # -- the step loop -----------------------------------------------------------------------
    def _ensure_stepping(self) -> None:
        if self._failure is not None:  # dead: never stepped again (its requests are aborted)
            return
        task = self._task
        loop = asyncio.get_running_loop()
        # (A task of an earlier loop that ended, or stopped, while it waited never runs again.)
        if (
            task is None
            or task.done()
            or (task.get_loop() is not loop and not task.get_loop().is_running())
        ):
            self._task = loop.create_task(self._step_until_idle())

    async def _step_until_idle(self) -> None:
        engine = self.engine

        def step() -> tuple[list[RequestOutput], tuple[list[str], int]] | tuple[None, Exception]:
            with self._engine_lock:
                try:
                    # Snapshots, taken before the next step can change the outputs again.
                    return [_snapshot(out) for out in engine.step()], engine.last_step
                except Exception as exc:  # (the engine's own failure, told from the loop's)
                    return None, exc

        try:
            while True:
                async with self._locked():
                    with self._engine_lock:
                        aborts, self._aborts = self._aborts, set()
                        if aborts:
                            engine.abort_request(sorted(aborts))
                        # (and one more step for the workers to hear of the last ends)
                        idle = not engine.has_unfinished_requests()
                        if idle and not engine.scheduler.has_requests():
                            return
                    try:
                        snapshots, took = await asyncio.to_thread(step)
                    except RuntimeError as exc:
                        if "shutdown" not in str(exc):
                            raise
                        # The loop is shutting down (an ``asyncio.run`` ends with a stream
                        # open: its abort came here): no step ran; the next loop's calls
                        # step on. (Its aborts stay asked for: each frees its id again.)
                        self._aborts |= aborts
                        logger.debug("the event loop ends: stepping stops", exc_info=True)
                        return
                    if isinstance(took, Exception):
                        raise took
                    assert snapshots is not None
                    self.metrics.stepped(*took, snapshots)
                for out in snapshots:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except Exception as exc:  # a failed step ends every live request with the error
            self._failure = exc  # and the engine (vLLM: EngineDeadError): its state after a
            dead = EngineDeadError(f"the engine's step failed: {exc!r}")  # half-done step
            dead.__cause__ = exc  # cannot be trusted
            for queue in self._queues.values():
                queue.put_nowait(dead)
            with contextlib.suppress(Exception), self._engine_lock:  # their blocks back, as
                engine.abort_request(list(engine.processor.requests))  # far as it can
            self.metrics.failed_all()  # (their ends are counted: no step reports them)
            logger.exception("the engine's step failed; it serves no more requests")


def _snapshot(out: RequestOutput) -> RequestOutput:
    samples = [
        dataclasses.replace(
            o,
            token_ids=list(o.token_ids),
            new_token_ids=list(o.new_token_ids),
            logprobs=None if o.logprobs is None else list(o.logprobs),
        )
        for o in out.outputs
    ]
    return dataclasses.replace(out, outputs=samples)
