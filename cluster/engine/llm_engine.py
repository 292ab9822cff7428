"""The in-process engine: one ``Scheduler`` and one ``ModelWorker`` driven by a step loop.

``LLMEngine`` is vLLM's low-level shape (``add_request`` / ``step`` / ``abort_request``); ``LLM``
(in ``cluster.engine.llm``) is the batch and streaming front end on top of it. The step is the whole
engine::

    scheduler_output = scheduler.schedule()
    runner_output = worker.execute_model(scheduler_output)
    core_outputs = scheduler.update_from_output(scheduler_output, runner_output)
    return processor.process(core_outputs)      # detokenize, stop strings, fan-in of n
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from actors.model.loader import DEFAULT_DENSE_MIN_ROWS
from actors.model.tokenizer import Tokenizer
from actors.worker import ModelWorker
from cluster.engine.frontend import RequestFactory
from cluster.engine.outputs import OutputProcessor, RequestOutput
from scheduler import (
    CacheConfig,
    LoRAConfig,
    LoRARequest,
    ModelRunnerOutput,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)

logger = logging.getLogger(__name__)


class LLMEngine:
    """Scheduler + worker in one process. Not thread-safe: call it from one thread."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        memory_budget_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int | None = None,
        enable_lora: bool = False,
        max_loras: int = 1,
        max_lora_rank: int = 16,
        max_cpu_loras: int | None = None,
        attention_backend: str | None = None,
        quantization: str = "auto",
        quant_dense_min_rows: int | None = DEFAULT_DENSE_MIN_ROWS,
        enforce_eager: bool = False,
        progress: bool = True,
        **scheduler_kwargs: Any,
    ) -> None:
        """``num_blocks`` sizes the KV cache directly; else ``memory_budget_bytes`` (weights +
        activations + cache, profiled by the worker); else ``kv_cache_memory_bytes`` of cache
        (1 GiB by default). Other keyword arguments go to ``SchedulerConfig``."""
        lora_config = (
            LoRAConfig(
                max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras
            )
            if enable_lora
            else None
        )
        budget_tokens = max_num_batched_tokens or 2048
        self.worker = ModelWorker(
            model,
            dtype=dtype,
            device=device,
            block_size=block_size,
            lora_config=lora_config,
            attention_backend=attention_backend,
            quantization=quantization,
            quant_dense_min_rows=quant_dense_min_rows,
            enforce_eager=enforce_eager,
            max_num_batched_tokens=budget_tokens,
            max_num_seqs=max_num_seqs,
            progress=progress,
        )
        self.worker.load_model()
        model_config = self.worker.config
        num_blocks = self.worker.size_kv_cache(
            num_blocks, kv_cache_memory_bytes, memory_budget_bytes
        )
        self.worker.init_kv_cache(num_blocks)
        self.tokenizer = Tokenizer.from_path(self.worker.model_path)
        # (rope scaling may stretch it, a sliding window cap it: ModelConfig)
        context, positions = model_config.max_context_len, model_config.max_positions
        if context < positions:
            what = f"sliding window ({context} tokens; attention here spans the whole context)"
        elif positions != model_config.max_position_embeddings:
            what = (
                f"context ({positions} positions: max_position_embeddings "
                f"{model_config.max_position_embeddings} x its rope scaling's factor)"
            )
        else:
            what = f"max_position_embeddings ({positions})"
        if max_model_len is None:  # the model's context, as far as the cache can hold it
            max_model_len = min(context, num_blocks * block_size)
            if max_model_len < context:
                logger.warning(
                    "max_model_len capped at %d tokens: the KV cache holds no more",
                    max_model_len,
                )
            elif context < positions:
                logger.warning("max_model_len capped at the model's %s", what)
        self.max_model_len = max_model_len
        if self.max_model_len > context:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's {what}")
        sched_args: dict[str, Any] = dict(
            max_num_seqs=max_num_seqs, max_model_len=self.max_model_len, **scheduler_kwargs
        )
        if max_num_batched_tokens is not None:
            sched_args["max_num_batched_tokens"] = max_num_batched_tokens
        self.scheduler_config = SchedulerConfig(**sched_args)
        self.cache_config = CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config, lora_config)
        self.factory = RequestFactory(
            self.tokenizer,
            vocab_size=model_config.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=list(model_config.eos_token_ids),
            priority_scheduling=self.scheduler_config.policy == "priority",
        )
        self.eos_token_id = self.factory.eos_token_id
        self.processor = OutputProcessor(self.tokenizer)
        self.last_step: tuple[list[str], int] = ([], 0)  # (see ``step``)
        logger.info(
            "engine ready: %d KV blocks of %d tokens (%.0f MiB), max_model_len %d",
            num_blocks,
            block_size,
            num_blocks * self.worker.bytes_per_block() / 2**20,
            self.max_model_len,
        )

    # -- requests ---------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a prompt (text or token ids). ``n > 1`` fans out into ``n`` scheduler requests
        (``{id}#{i}``; sample ``i`` of a seeded request uses ``seed + i``)."""
        if self.processor.in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        if lora_request is not None and self.worker.lora_manager is None:
            raise ValueError("LoRA requests need an engine built with enable_lora=True")
        child_ids = self.processor.child_ids(request_id, params.n)
        taken = [c for c in child_ids if c in self.scheduler.requests or self.processor.in_use(c)]
        if taken:  # e.g. a request named "x#0" next to an n > 1 request "x"
            raise ValueError(f"request id {taken[0]!r} is already in use")
        prepared = self.factory.prepare(
            request_id,
            prompt,
            params,
            lora_request=lora_request,
            priority=priority,
            arrival_time=arrival_time,
            child_ids=child_ids,
        )
        if lora_request is not None:
            self.worker.add_lora(lora_request)  # load now: a bad adapter fails here, not mid-step
        self.processor.add(request_id, prepared.prompt, prepared.prompt_token_ids, params)
        for request in prepared.requests:
            self.scheduler.add_request(request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        """Abort requests (by the ids given to ``add_request``); their blocks are freed and the
        next ``step`` reports them finished with ``finish_reason="abort"``."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        children = self.processor.abort(ids)
        self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or finished ones still holding blocks (a KV send); not the
        finished ones whose end only the workers have still to hear of (the scheduler's
        ``has_requests``: the next step tells them)."""
        return self.scheduler.holds_requests() or self.processor.has_pending()

    def get_num_unfinished_requests(self) -> int:
        return len(self.processor.requests)

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, execute and apply one step; return the requests that changed."""
        scheduler_output = self.scheduler.schedule()
        # (what the step took up: its samples scheduled for the first time, its tokens)
        self.last_step = (
            [r.req_id for r in scheduler_output.scheduled_new_reqs],
            scheduler_output.total_num_scheduled_tokens,
        )
        runner_output = self.worker.execute_model(scheduler_output)
        assert isinstance(runner_output, ModelRunnerOutput)  # one worker, no pipeline stages
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs, stopped = self.processor.process(core_outputs)
        if stopped:  # stop strings found while detokenizing
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs
