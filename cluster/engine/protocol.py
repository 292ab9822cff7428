"""``EngineClient``: the contract between a front end (the OpenAI-compatible API, the gRPC
service) and an engine -- what serving needs from an engine, and nothing more (vLLM's
``EngineClient`` plays the same part).

``cluster.control.client.ClusterClient`` implements it for a Ray cluster and
``cluster.engine.async_llm.AsyncLLM`` for the in-process engine, so the same serving code
(``cluster.serving.openai_serving.OpenAIServing``) runs on either. Serving code calls these
methods only: never a private method, never a handle behind them.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from actors.model.tokenizer import Tokenizer
    from cluster.engine.outputs import RequestOutput
    from scheduler import LoRARequest, SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    """An engine as serving sees it: token ids in, ``RequestOutput``s out."""

    @property
    def tokenizer(self) -> Tokenizer:
        """The served model's tokenizer (prompts, chat templates, logprob tokens)."""
        ...

    @property
    def max_model_len(self) -> int:
        """Prompt plus output tokens one request may hold."""
        ...

    @property
    def priority_scheduling(self) -> bool:
        """Whether some scheduler orders its queue by ``priority`` (``policy: priority``);
        a request's non-zero priority is refused otherwise."""
        ...

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raise ``ValueError`` naming the problem for a prompt the engine cannot take
        (empty, out of the vocabulary, too long)."""
        ...

    def generate_async(
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
        """The request's ``RequestOutput`` each time it advances (``new_text`` /
        ``new_token_ids`` hold the delta; the object is updated in place between items), the
        last one finished. Raises ``ValueError`` for a request that can never be served and
        the engine's own errors (``cluster.errors``) before the first item. Closing the
        generator early aborts the request. ``trace_context``: the caller's span as a W3C
        carrier, when tracing is on. ``prompt_index``: this prompt's place among one API
        request's prompts (a batched completion): an engine with an admission bound takes
        the prompts after the first with the first (a batch is refused or taken whole)."""
        ...

    def abort(self, request_id: str) -> None:
        """End a request wherever it is (returns at once; its stream ends with ``abort``)."""
        ...

    async def lora_adapters(self) -> dict[str, LoRARequest]:
        """The LoRA adapters served by name (the API's extra model names)."""
        ...

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        """Serve the adapter at ``path`` as model ``name``; ``ValueError`` for a bad one."""
        ...

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``; ``KeyError`` if it is not served."""
        ...

    async def metrics_text(self) -> str:
        """Prometheus exposition text of the engine's metrics (``/metrics``)."""
        ...

    async def check_health(self) -> dict[str, bool]:
        """Instance id -> whether all its workers answer (``/health``). Raises when the engine
        itself cannot be reached."""
        ...

    # -- for operators -----------------------------------------------------------------------
    async def engine_stats(self) -> dict[str, Any]:
        """Counters and state: ``instances`` (instance id -> its scheduler's and loop's
        numbers, ``role`` included), and cluster-wide ones (requests in flight, moves)."""
        ...

    async def live_requests(self) -> dict[str, dict[str, Any]]:
        """Request id -> where it is: ``instance``, ``phase`` (queued, prefill, transfer,
        decode), ``num_tokens_sent``, ``num_moves``."""
        ...

    async def transfer_history(self) -> dict[str, list[Any]]:
        """Instance id -> the KV loads its workers finished (``TransferRecord``s)."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """Drop every instance's cached prefixes (blocks in use stay); False if some
        instance could not (blocks still cached by running requests)."""
        ...

    async def scale_pool(self, pool: str, replicas: int) -> dict[str, Any]:
        """Resize a pool of instances while serving (removed ones drain first); returns the
        pool's instances. ``ValueError`` for an unknown pool, fewer than one replica, or an
        engine that cannot be resized."""
        ...
