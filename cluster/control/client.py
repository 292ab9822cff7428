"""``ClusterClient``: generate through a running cluster's SchedulerActor from any Ray driver.

It is the front end the SchedulerActor leaves to its callers (DESIGN §2): tokenization, prompt
validation, ``n`` fan-out, incremental detokenization and stop strings happen here; the actor
deals in token ids. The Serve ingress (issue 6) does the same per HTTP request.

    client = ClusterClient(handle)           # or ClusterClient.connect() for the named actor
    outs = client.generate(["Hello"], SamplingParams(max_tokens=32))
    async for out in client.generate_async("Hello", params): ...
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

import ray

from actors.model.tokenizer import Tokenizer
from cluster.frontend import RequestFactory
from cluster.outputs import OutputProcessor, RequestOutput
from scheduler import LoRARequest, Request, SamplingParams
from scheduler.outputs import EngineCoreOutput


class ClusterClient:
    """Streams requests through a SchedulerActor handle. Safe to use from one event loop (or
    one thread for the blocking ``generate``)."""

    def __init__(
        self,
        handle: Any,
        tokenizer: Tokenizer | None = None,
        info: dict[str, Any] | None = None,
    ) -> None:
        """``info``: the actor's ``model_info()`` when the caller has it (from async code)."""
        self.handle = handle
        self.info: dict[str, Any] = info or ray.get(handle.model_info.remote())
        self.tokenizer = tokenizer or Tokenizer.from_path(Path(self.info["model_path"]))
        self.max_model_len: int = self.info["max_model_len"]
        self.factory = RequestFactory(
            self.tokenizer,
            vocab_size=self.info["vocab_size"],
            max_model_len=self.max_model_len,
            eos_token_ids=self.info["eos_token_ids"],
        )
        self._ids = itertools.count()
        self._prefix = f"c{uuid.uuid4().hex[:12]}-"  # unique across processes

    @classmethod
    def connect(cls, name: str | None = None, namespace: str | None = None) -> ClusterClient:
        """The client of the running cluster named ``name`` (Ray must be initialized)."""
        from cluster.launch import DEFAULT_NAME, DEFAULT_NAMESPACE, get_cluster

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

    # -- streaming ---------------------------------------------------------------------------
    async def generate_async(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        trace_context: dict[str, str] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's ``RequestOutput`` each time it advances (deltas in ``new_text``
        / ``new_token_ids``). Raises ``ValueError`` for a prompt the cluster cannot serve.
        Leaving the loop early aborts the request on the cluster."""
        params = params or SamplingParams()
        rid = request_id or f"{self._prefix}{next(self._ids)}"
        processor = OutputProcessor(self.tokenizer)
        child_ids = processor.child_ids(rid, params.n)
        prepared = self.factory.prepare(
            rid, prompt, params, lora_request=lora_request, priority=priority, child_ids=child_ids
        )
        processor.add(rid, prepared.prompt, prepared.prompt_token_ids, params)
        queue: asyncio.Queue[EngineCoreOutput | BaseException] = asyncio.Queue()
        tasks = [
            asyncio.ensure_future(self._pump(r, queue, trace_context)) for r in prepared.requests
        ]
        open_children = set(child_ids)
        try:
            while open_children:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    open_children.discard(item.request_id)
                outputs, stopped = processor.process([item])
                for child in stopped:  # a stop string: end it on the cluster too
                    open_children.discard(child)
                    self.handle.abort.remote(child)
                for out in outputs:
                    yield out
        finally:
            for task in tasks:
                task.cancel()
            for child in open_children:
                self.handle.abort.remote(child)

    async def _pump(
        self,
        request: Request,
        queue: asyncio.Queue[EngineCoreOutput | BaseException],
        trace_context: dict[str, str] | None = None,
    ) -> None:
        try:
            async for ref in self.handle.generate.remote(request, trace_context):
                queue.put_nowait(await ref)
        except ray.exceptions.RayTaskError as exc:
            # A request the cluster refuses raises ValueError there; re-raise it as such.
            inner = getattr(exc, "cause", None)
            queue.put_nowait(inner if isinstance(inner, ValueError) else exc)
        except Exception as exc:
            queue.put_nowait(exc)

    # -- control -----------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        self.handle.abort.remote(request_id)

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = ray.get(self.handle.stats.remote())
        return result


def _as_list(prompts: str | list[int] | Sequence[str | list[int]]) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]  # type: ignore[arg-type]
    return items  # type: ignore[return-value]
