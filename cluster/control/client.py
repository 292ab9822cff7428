"""``ClusterClient``: generate through a running cluster's SchedulerActor from any Ray driver;
the ``EngineClient`` (``cluster.engine.protocol``) of a cluster, which the Serve ingress runs
the API on.

It is the front end the SchedulerActor leaves to its callers (DESIGN §2): tokenization, prompt
validation, ``n`` fan-out, incremental detokenization and stop strings happen here; the actor
deals in token ids.

    client = ClusterClient(handle)           # or ClusterClient.connect() for the named actor
    outs = client.generate(["Hello"], SamplingParams(max_tokens=32))
    async for out in client.generate_async("Hello", params): ...
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from pathlib import Path
from typing import Any

import ray

from actors.model.tokenizer import Tokenizer
from cluster.control.subscription import Subscription, unwrap_cause
from cluster.engine.frontend import RequestFactory
from cluster.engine.outputs import OutputProcessor, RequestOutput
from cluster.engine.protocol import EngineClient
from cluster.engine.streams import merge_streams
from scheduler import LoRARequest, SamplingParams
from scheduler.request import FinishReason

# How long /health waits for every worker to answer.
HEALTH_TIMEOUT_S = 10.0

logger = logging.getLogger(__name__)


class ClusterClient(EngineClient):
    """Streams requests through a SchedulerActor handle. Safe to use from one event loop (or
    one thread for the blocking ``generate``); ``abort`` from any thread."""

    def __init__(
        self,
        handle: Any,
        tokenizer: Tokenizer | None = None,
        info: dict[str, Any] | None = None,
    ) -> None:
        """``info``: the actor's ``model_info()`` when the caller has it (from async code)."""
        self.handle = handle
        self.info: dict[str, Any] = info or ray.get(handle.model_info.remote())
        self._tokenizer = tokenizer or Tokenizer.from_path(Path(self.info["model_path"]))
        self._max_model_len: int = self.info["max_model_len"]
        self.factory = RequestFactory(
            self._tokenizer,
            vocab_size=self.info["vocab_size"],
            max_model_len=self._max_model_len,
            eos_token_ids=self.info["eos_token_ids"],
            priority_scheduling=self.info.get("priority_scheduling", True),  # (an older actor)
        )
        self._ids = itertools.count()
        self._prefix = f"c{uuid.uuid4().hex[:12]}-"  # unique across processes
        self._sub: Subscription | None = None
        # The scheduler ids of each request streaming here: its ``n`` samples. Read by
        # ``abort`` from any thread (a dict lookup, no iteration).
        self._children: dict[str, list[str]] = {}

    @classmethod
    def connect(cls, name: str | None = None, namespace: str | None = None) -> ClusterClient:
        """The client of the running cluster named ``name`` (Ray must be initialized)."""
        from cluster.control.launch import DEFAULT_NAME, DEFAULT_NAMESPACE, get_cluster

        return cls(get_cluster(name or DEFAULT_NAME, namespace or DEFAULT_NAMESPACE))

    # -- blocking ----------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """All prompts at once (the cluster batches them); results in the prompts' order."""
        items = _as_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"{len(params)} sampling params for {len(items)} prompts")

        async def run_all() -> list[RequestOutput]:
            async def one(prompt: str | list[int], p: SamplingParams) -> RequestOutput:
                final = None
                async for out in self.generate_async(prompt, p, lora_request=lora_request):
                    final = out
                assert final is not None
                return final

            pairs = zip(items, params, strict=True)
            return list(await asyncio.gather(*(one(x, p) for x, p in pairs)))

        return asyncio.run(run_all())

    # -- streaming (EngineClient) -----------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def priority_scheduling(self) -> bool:
        return self.factory.priority_scheduling

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        self.factory.validate(prompt_token_ids)

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
        """Yield the request's ``RequestOutput`` each time it advances (deltas in ``new_text``
        / ``new_token_ids``). Raises ``ValueError`` for a prompt the cluster cannot serve.
        Leaving the loop early aborts the request on the cluster."""
        params = params or SamplingParams()
        rid = request_id or f"{self._prefix}{next(self._ids)}"
        processor = OutputProcessor(self.tokenizer)
        child_ids = processor.child_ids(rid, params.n)
        prepared = self.factory.prepare(
            rid,
            prompt,
            params,
            lora_request=lora_request,
            priority=priority,
            child_ids=child_ids,
            prompt_index=prompt_index,
        )
        processor.add(rid, prepared.prompt, prepared.prompt_token_ids, params)
        subscription = self._subscription()
        taken = [c for c in child_ids if c in subscription.request_ids]
        if taken or rid in self._children:  # refused before anything runs: the request
            # streaming under it goes on
            raise ValueError(f"request_id {(taken or [rid])[0]!r} is already in use")
        self._children[rid] = child_ids
        try:
            # Each sample's stream aborts its request if it is closed before the end (the
            # consumer left, another sample failed): closing the merge closes them all.
            samples = [subscription.stream(r, trace_context) for r in prepared.requests]
            open_children = set(child_ids)
            async with aclosing(merge_streams(samples)) as merged:
                async for _, item in merged:
                    if item.finished:
                        open_children.discard(item.request_id)
                    outputs, stopped = processor.process([item])
                    for child in stopped:  # a stop string: end it on the cluster too
                        open_children.discard(child)
                        self._abort_ids([child], stopped=True)
                    for out in outputs:
                        yield out
                    if not open_children:
                        break
        finally:
            del self._children[rid]

    def _subscription(self) -> Subscription:
        """This event loop's subscription (a new one after the loop changed or the old one
        ended: ``generate`` runs each batch in a fresh loop)."""
        loop = asyncio.get_running_loop()
        current = self._sub
        if current is None or current.loop is not loop or current.task.done():
            current = self._sub = Subscription(self.handle, f"{self._prefix}{uuid.uuid4().hex}")
        return current

    def abort(self, request_id: str) -> None:
        """End a request wherever it is, with each of its ``n`` samples (``{id}#{i}``), from
        any thread. From the moment ``generate_async`` is called: a request whose generator
        has not submitted it yet is aborted by its id, which the central scheduler keeps for
        it and for its samples (``EarlyAborts``)."""
        self._abort_ids(self._children.get(request_id) or [request_id])

    def _abort_ids(self, ids: list[str], stopped: bool = False) -> None:
        """Abort ``ids`` (``stopped``: they met a stop string, and end as ``stop``)."""
        sub = self._sub
        try:
            here = sub is not None and sub.loop is asyncio.get_running_loop()
        except RuntimeError:  # no event loop in this thread
            here = False
        for rid in ids:
            if here:  # in order with this loop's submits (an id reused at once stays safe)
                assert sub is not None
                sub.abort(rid, stopped)
            else:
                self.handle.abort.remote(rid, FinishReason.STOP if stopped else FinishReason.ABORT)

    # -- adapters, metrics, health (EngineClient) -------------------------------------------
    async def lora_adapters(self) -> dict[str, LoRARequest]:
        result: dict[str, LoRARequest] = await self.handle.lora_adapters.remote()
        return result

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        lora: LoRARequest = await self.handle.load_lora_adapter.remote(name, path)
        return lora

    async def unload_lora_adapter(self, name: str) -> None:
        await self.handle.unload_lora_adapter.remote(name)

    async def metrics_text(self) -> str:
        text: str = await self.handle.metrics_text.remote()
        return text

    async def check_health(self) -> dict[str, bool]:
        workers = await asyncio.wait_for(self.handle.worker_health.remote(), HEALTH_TIMEOUT_S)
        return {iid: all(s.get("ok") for s in h["stages"]) for iid, h in workers.items()}

    async def gone(self) -> bool:
        """Whether the SchedulerActor is dead for good (``tandem down`` killed it, or its
        restarts ran out): every call through this client fails from then on. A restart in
        progress, or an actor too busy to answer in time, is not gone."""
        return await actor_gone(self.handle, HEALTH_TIMEOUT_S)

    # -- for operators (EngineClient) --------------------------------------------------------
    async def engine_stats(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.handle.stats.remote()
        return result

    async def live_requests(self) -> dict[str, dict[str, Any]]:
        result: dict[str, dict[str, Any]] = await self.handle.requests.remote()
        return result

    async def transfer_history(self) -> dict[str, list[Any]]:
        result: dict[str, list[Any]] = await self.handle.transfer_history.remote()
        return result

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.handle.reset_prefix_cache.remote())

    async def scale_pool(self, pool: str, replicas: int) -> dict[str, Any]:
        try:
            result: dict[str, Any] = await self.handle.scale_pool.remote(pool, replicas)
        except ray.exceptions.RayTaskError as exc:  # ValueError, TimeoutError: say it as is
            raise unwrap_cause(exc, Exception) from None
        return result

    def stats(self) -> dict[str, Any]:
        """``engine_stats`` for blocking code (scripts, tests)."""
        result: dict[str, Any] = ray.get(self.handle.stats.remote())
        return result


async def actor_gone(handle: Any, timeout_s: float) -> bool:
    """Whether the actor behind ``handle`` is dead for good (``ActorDiedError``: killed without
    restart, or out of restarts); any other outcome, a timeout included, is not."""
    try:
        await asyncio.wait_for(handle.__ray_ready__.remote(), timeout_s)
    except ray.exceptions.ActorDiedError:
        return True
    except Exception:  # restarting (ActorUnavailableError), slow: it may come back
        return False
    return False


def _as_list(prompts: str | list[int] | Sequence[str | list[int]]) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]  # type: ignore[arg-type]
    return items  # type: ignore[return-value]
