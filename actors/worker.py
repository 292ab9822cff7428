"""``ModelWorker``: runs one instance's model on a paged KV cache, one ``SchedulerOutput`` at a
time, and answers with a ``ModelRunnerOutput`` (DESIGN.md §3.3).

A plain class (the cluster wraps it in a Ray actor). It mirrors each request from the
scheduler's diffs (``actors.batch``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from actors.batch import RequestState, Scheduled, TokenSpan, collect_batch, update_requests
from actors.cores import CoreShare
from actors.model.attention import AttentionMetadata, TorchAttention, select_backend
from actors.model.llama import LlamaForCausalLM
from actors.model.loader import DEFAULT_DENSE_MIN_ROWS, load_model, resolve_model_path
from actors.pipeline import IntermediateOutput, stage_report
from actors.prompt_logprobs import prompt_logprobs
from actors.sampler import Sampler, SamplingRow
from actors.structured_output import WorkerGrammars
from actors.worker_kv import WorkerKV
from actors.worker_memory import WorkerMemory
from scheduler import LoRAConfig, ModelRunnerOutput, SchedulerOutput
from scheduler.outputs import TokenLogprobs
from scheduler.request import LoRARequest

if TYPE_CHECKING:
    from actors.lora import LoRAManager
    from actors.model.cuda_graphs import DecodeGraphs
    from kv_transfer.base import WorkerConnector

logger = logging.getLogger(__name__)


class ModelWorker(WorkerMemory, WorkerKV):
    """One model instance's executor: ``load_model`` → ``init_kv_cache`` → ``execute_model``*."""

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str = "cpu",
        block_size: int = 16,
        lora_config: LoRAConfig | None = None,
        attention_backend: str | None = None,
        max_num_batched_tokens: int | None = 2048,
        max_num_seqs: int = 256,
        progress: bool = True,
        kv_transfer: str | None = None,
        kv_transfer_options: dict[str, Any] | None = None,
        kv_transfer_fallback: str | None = None,
        num_threads: int | str | None = None,
        pp_rank: int = 0,
        pp_size: int = 1,
        tracing: Any = None,
        quantization: str = "auto",
        quant_dense_min_rows: int | None = DEFAULT_DENSE_MIN_ROWS,
        enforce_eager: bool = False,
    ) -> None:
        """``kv_transfer`` names a KV transport (``nixl``, ``ray``, ``grpc``) for prefill/
        decode hand-off, built with ``kv_transfer_options``; if it cannot be built here (no
        NIXL on this node), ``kv_transfer_fallback`` (no options) is used instead, when given
        (``transport: auto``: the control plane sees it and moves every worker to it);
        ``num_threads`` sets torch's intra-op threads (a Ray actor otherwise gets one);
        ``"auto"`` shares the machine's cores with the other workers on it, step by step
        (``actors.cores``). ``pp_rank`` of ``pp_size``: this worker is one pipeline stage
        and holds only its layers (``actors.pipeline``). ``tracing``: a ``TracingConfig``;
        when enabled, KV loads are spans of their requests' traces.
        ``quantization`` / ``quant_dense_min_rows``: weights held quantized (see
        ``actors.model.loader.quantize_model``). On CUDA, decode steps replay captured CUDA
        graphs (``actors.model.cuda_graphs``) unless ``enforce_eager``."""
        self.tracing = tracing
        self.core_share: CoreShare | None = None
        if num_threads == "auto":
            self.core_share = CoreShare()
            num_threads = None
        elif isinstance(num_threads, str):
            raise ValueError(f"num_threads must be a count or 'auto', not {num_threads!r}")
        self.num_threads = num_threads
        self.pp_rank, self.pp_size = pp_rank, pp_size
        self.layers = range(0)  # the model layers this worker holds (set by load_model)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.model_path: Path = resolve_model_path(model)
        self.dtype_arg = dtype
        self.quantization = quantization
        self.quant_dense_min_rows = quant_dense_min_rows
        self.device = torch.device(device)
        self.block_size = block_size
        self.lora_config = lora_config
        self.attention_backend_arg = attention_backend
        self.enforce_eager = enforce_eager
        self.decode_graphs: DecodeGraphs | None = None
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.progress = progress
        self.model: LlamaForCausalLM | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.requests: dict[str, RequestState] = {}
        self.sampler = Sampler()
        self.grammars = WorkerGrammars(self.model_path)  # structured outputs' matchers
        self.lora_manager: LoRAManager | None = None
        self.num_steps = 0
        self.kv_transfer = kv_transfer
        self.kv_transfer_options = dict(kv_transfer_options or {})
        self.kv_transfer_fallback = kv_transfer_fallback
        self.connector: WorkerConnector | None = None
        self.step_delay_s = 0.0  # fault injection (tests)
        self.step_seconds = 0.0  # time spent in execute_model (for benchmarks)
        # A Ray actor answers health() while a step runs (two threads); steps and adapter
        # changes must not interleave.
        self._step_lock = threading.Lock()

    # -- set-up ---------------------------------------------------------------------------
    def load_model(self) -> None:
        """Load the weights and choose the attention backend (logged)."""
        model = load_model(
            self.model_path,
            self.dtype_arg,
            self.device,
            progress=self.progress,
            pp_rank=self.pp_rank,
            pp_size=self.pp_size,
            quantization=self.quantization,
            quant_dense_min_rows=self.quant_dense_min_rows,
        )
        cfg = model.config
        self.model = model
        if self.core_share is not None:
            model.between_layers = self.core_share.adjust
        self.layers = model.layer_range
        self.dtype = model.dtype
        if self.device.type == "cpu" and os.environ.get("TANDEM_CPU_KERNELS", "1") != "0":
            packed = model.pack_for_cpu(batch_hint=min(64, self.max_num_seqs))
            logger.info("CPU GEMMs with pre-packed weights: %s", "on" if packed else "off")
        self.attn = select_backend(
            self.device,
            self.dtype,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.block_size,
            self.attention_backend_arg,
        )
        if self.lora_config is not None:
            from actors.lora import LoRAManager

            self.lora_manager = LoRAManager(
                cfg, self.lora_config, self.device, self.dtype, layers=self.layers
            )

    @property
    def config(self) -> Any:
        return self._model.config

    @property
    def _model(self) -> LlamaForCausalLM:
        if self.model is None:
            raise RuntimeError("call load_model() first")
        return self.model

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks per layer (zeroed). Drops all request state."""
        # Under the step lock: a KV probe (its own thread) may be using the connector.
        with self._step_lock:
            self._init_kv_cache(num_blocks)

    def _init_kv_cache(self, num_blocks: int) -> None:
        from kv_transfer.blocks import allocate_kv_caches

        model = self._model
        cfg = model.config
        if self.connector is not None:  # before the old cache can go: no peer reads it now
            self.connector.release_caches()
        self.kv_caches = []  # the old cache goes before the new one is allocated
        self.decode_graphs = None
        graphs = (
            self.device.type == "cuda"
            and not self.enforce_eager
            and model.is_first
            and isinstance(self.attn, TorchAttention)
        )
        self.kv_caches = allocate_kv_caches(
            len(self.layers),
            num_blocks + graphs,  # the graphs' padding rows write to one scratch block
            self.block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
        )
        self.num_blocks = num_blocks
        if graphs:
            from actors.model.cuda_graphs import DecodeGraphs

            assert isinstance(self.attn, TorchAttention)
            self.decode_graphs = DecodeGraphs(
                model,
                self.kv_caches,
                self.attn,
                self.block_size,
                scratch_block=num_blocks,
                max_batch=min(self.max_num_seqs, 512),
                max_width=min(num_blocks, -(-cfg.max_context_len // self.block_size)),
            )
        self.requests.clear()
        if self.kv_transfer is not None:
            self._attach_connector()

    # -- LoRA -------------------------------------------------------------------------------
    def add_lora(self, lora: LoRARequest) -> bool:
        if self.lora_manager is None:
            raise ValueError("LoRA is not enabled on this worker (no lora_config)")
        with self._step_lock:
            return self.lora_manager.add_lora(lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        if self.lora_manager is None:
            return False
        with self._step_lock:
            return bool(self.lora_manager.remove_lora(lora_int_id))

    def list_loras(self) -> set[int]:
        return set() if self.lora_manager is None else self.lora_manager.list_loras()

    def health(self) -> dict[str, Any]:
        return {
            "ok": self.model is not None and bool(self.kv_caches),
            "num_blocks": self.num_blocks,
            "num_requests": len(self.requests),
            "num_steps": self.num_steps,
            "step_seconds": self.step_seconds,
            "device": str(self.device),
            "num_loading": 0 if self.connector is None else self.connector.num_loading(),
            "kv_reads_started": 0 if self.connector is None else self.connector.num_reads_started,
            # nixl: reads copied straight from a worker of this machine (kv_transfer/cma.py)
            "kv_direct_reads": getattr(self.connector, "num_direct_reads", 0),
            # nixl, grpc: leases that ran out unread (released ones end at once)
            "kv_leases_expired": getattr(getattr(self.connector, "leases", None), "num_expired", 0),
            "kv_transport": None if self.connector is None else self.connector.transport,
            "kv_peers": 0 if self.connector is None else self.connector.num_peers(),
            "ucx_tls": os.environ.get("UCX_TLS"),  # nixl: UCX's transports, if restricted
            "node_id": _ray_node_id(),
            "pid": os.getpid(),
        }

    def info(self) -> dict[str, Any]:
        """What the control plane needs to build this instance's scheduler."""
        cfg = self._model.config
        return {
            "model_path": str(self.model_path),
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "bytes_per_block": self.bytes_per_block(),
            "num_layers": cfg.num_hidden_layers,
            "layers": [self.layers.start, self.layers.stop],
            "pp_rank": self.pp_rank,
            "pp_size": self.pp_size,
            "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_position_embeddings,
            "max_context_len": cfg.max_context_len,  # (a sliding window's cap: ModelConfig)
            "eos_token_ids": list(cfg.eos_token_ids),
            "dtype": str(self.dtype).removeprefix("torch."),
            "node_id": _ray_node_id(),
        }

    def transfer_history(self) -> list[Any]:
        """Finished KV loads (for benchmarks); empty without a connector."""
        return [] if self.connector is None else list(self.connector.history)

    def set_fault_injection(self, load_delay_s: float = 0.0, step_delay_s: float = 0.0) -> None:
        """Testing: delay every KV fetch by ``load_delay_s`` (to trip the transfer deadline)
        and every step by ``step_delay_s`` (to catch a request mid-step)."""
        if load_delay_s and self.connector is None:
            raise ValueError("no KV connector on this worker")
        if self.connector is not None:
            self.connector.load_delay_s = load_delay_s
        self.step_delay_s = step_delay_s

    # -- one step -------------------------------------------------------------------------
    def execute_model(
        self, scheduler_output: SchedulerOutput, intermediate: IntermediateOutput | None = None
    ) -> ModelRunnerOutput | IntermediateOutput:
        """Run one step: update request state from the diffs, one forward over the flattened
        batch, sample the requests that reached their last known token. A pipeline stage
        other than the first continues from the previous stage's ``intermediate``; one other
        than the last returns its own for the next stage instead of sampling."""
        with self._step_lock:
            start = time.perf_counter()
            try:
                if self.core_share is None or not scheduler_output.total_num_scheduled_tokens:
                    return self._execute_model(scheduler_output, intermediate)
                with self.core_share.busy(scheduler_output.total_num_scheduled_tokens):
                    return self._execute_model(scheduler_output, intermediate)
            finally:
                self.step_seconds += time.perf_counter() - start

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def _execute_model(
        self, scheduler_output: SchedulerOutput, intermediate: IntermediateOutput | None
    ) -> ModelRunnerOutput | IntermediateOutput:
        if self.num_threads is not None and torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        so = scheduler_output
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        meta = so.kv_connector_metadata
        if self.connector is not None:
            self.connector.start_load_kv(meta, idle=so.total_num_scheduled_tokens == 0)
        update_requests(self.requests, so)
        batch = collect_batch(self.requests, so, self.block_size)
        self.num_steps += 1
        if not batch:
            return self._with_connector_reports(ModelRunnerOutput.empty(), None, meta, intermediate)
        # Decodes first: the attention backend batches them. (Every stage sorts the same
        # scheduler output the same way, so hidden-state rows line up across stages.)
        batch.sort(key=lambda s: s.num_tokens != 1)
        # Requests whose adapter cannot be read fail alone: their rows are computed without
        # it (shapes stay those of the step, on every stage) and never sampled.
        failed = self._unreadable_adapters(batch, intermediate)
        hidden_in = None if intermediate is None else intermediate.hidden_states
        hidden = self._forward(batch, hidden_in, failed)
        if not self.is_last_stage:
            return self._with_connector_reports(None, hidden, meta, intermediate, failed)
        logits = self._logits(batch, hidden, failed)
        sampling = [s for s in batch if s.samples and s.state.req_id not in failed]
        eos_ids = tuple(self.config.eos_token_ids)  # (min_tokens holds them all back)
        rows = [
            SamplingRow(
                params=s.state.params,
                prompt_token_ids=TokenSpan(s.state.token_ids, 0, s.state.num_prompt_tokens),
                output_token_ids=TokenSpan(
                    s.state.token_ids, s.state.num_prompt_tokens, len(s.state.token_ids)
                ),
                eos_token_id=s.state.eos_token_id,
                other_eos_ids=eos_ids,
            )
            for s in sampling
        ]
        grammar = self.grammars.bitmask([s.state for s in sampling], logits.shape[1])
        sampled = self.sampler(logits, rows, grammar) if rows else None
        by_req: dict[str, tuple[list[int], list[TokenLogprobs] | None]] = {}
        for i, s in enumerate(sampling):
            assert sampled is not None
            token = sampled.token_ids[i]
            s.state.token_ids.append(token)
            if s.state.grammar is not None:
                s.state.grammar.accept(s.state.req_id, token)
            lp = sampled.logprobs[i]
            by_req[s.state.req_id] = ([token], None if lp is None else [lp])
        for s in batch:
            if failed and s.samples and s.state.req_id in failed:
                # A stand-in for the sample it did not get, so that a step already scheduled
                # after this one (async scheduling) still finds its input token; the
                # scheduler ends the request with this step's output and drops the rest.
                s.state.token_ids.append(0)
        req_ids = [s.state.req_id for s in batch]
        tokens = [by_req.get(r, ([], None))[0] for r in req_ids]
        logprobs = [by_req.get(r, ([], None))[1] for r in req_ids]
        prompt_lps = prompt_logprobs(self._model, batch, hidden)
        if prompt_lps and failed:
            prompt_lps = {r: v for r, v in prompt_lps.items() if r not in failed} or None
        output = ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=tokens,
            logprobs=logprobs if any(lp is not None for lp in logprobs) else None,
            prompt_logprobs=prompt_lps,
            failed_req_ids=failed or None,
        )
        return self._with_connector_reports(output, None, meta, intermediate)

    def _unreadable_adapters(
        self, batch: list[Scheduled], intermediate: IntermediateOutput | None
    ) -> dict[str, str]:
        """The step's requests that fail here, with why: those whose LoRA adapter cannot be
        read (``LoRAManager.unreadable``), and those an earlier pipeline stage failed."""
        failed = {} if intermediate is None else dict(intermediate.failed_req_ids)
        if self.lora_manager is None:
            return failed
        loras = [s.state.lora for s in batch if s.state.lora is not None and s.num_tokens > 0]
        if not loras:
            return failed
        bad = self.lora_manager.unreadable(loras)
        if bad:
            for s in batch:
                lora = s.state.lora
                if lora is not None and lora.lora_int_id in bad:
                    failed.setdefault(s.state.req_id, bad[lora.lora_int_id])
        return failed

    def _with_connector_reports(
        self,
        output: ModelRunnerOutput | None,
        hidden: torch.Tensor | None,
        meta: Any,
        intermediate: IntermediateOutput | None,
        failed: dict[str, str] | None = None,
    ) -> ModelRunnerOutput | IntermediateOutput:
        """Save this step's hand-offs (the forward pass has written their KV) and attach the
        connector's reports: to ``output`` for a single worker; for a pipeline stage, to the
        stages' list that travels with the hidden states (``actors.pipeline``), with the
        requests failed so far (``failed``)."""
        report = None
        if self.connector is not None:
            if meta and (meta.saves or meta.releases):
                # Block tables only for the (rare) steps that save.
                saving = meta.saves
                tables = {r: s.block_ids for r, s in self.requests.items()} if saving else {}
                self.connector.wait_for_save(meta, tables)
            report = stage_report(
                self.pp_rank, self.connector.get_finished(), self.connector.report()
            )
        if self.pp_size == 1:
            assert output is not None
            if report is not None:
                output.finished_sending = report.finished_sending
                output.finished_recving = report.finished_recving
                output.failed_recving = report.failed_recving
                output.kv_connector_output = report.kv
            return output
        reports = [] if intermediate is None else list(intermediate.stage_reports)
        if report is not None:
            reports.append(report)
        if not self.is_last_stage:
            return IntermediateOutput(hidden, reports, dict(failed or {}))
        assert output is not None
        output.kv_connector_output = reports  # merged by the instance's StageReportMerger
        return output

    def shutdown(self) -> None:
        if self.core_share is not None:
            with self._step_lock:  # not under a running step's feet
                self.core_share.close()
        if self.connector is not None:
            with self._step_lock:  # (a KV probe's thread may be using it)
                self.connector.close()

    def _forward(
        self,
        batch: list[Scheduled],
        hidden_in: torch.Tensor | None,
        failed: dict[str, str] | None = None,
    ) -> torch.Tensor:
        """One forward over the flattened batch (this stage's layers); hidden states of every
        token. The rows of ``failed`` requests run without their adapter (never sampled)."""
        model = self._model
        input_ids: list[int] = []
        positions: list[int] = []
        for s in batch:
            end = s.start + s.num_tokens
            if model.is_first:
                input_ids.extend(s.state.token_ids[s.start : end])
            positions.extend(range(s.start, end))
        max_pos = model.config.max_positions  # (the rope table's length)
        if positions and max(positions) >= max_pos:
            raise ValueError(f"position {max(positions)} exceeds the model's {max_pos} positions")
        lora = None
        if self.lora_manager is not None:
            skip = failed or {}
            lora = self.lora_manager.prepare(
                [(None if s.state.req_id in skip else s.state.lora, s.num_tokens) for s in batch]
            )
        graphs = self.decode_graphs
        if graphs is not None and lora is None and all(s.num_tokens == 1 for s in batch):
            # Single-token decodes only: a captured step, when a bucket fits.
            captured = graphs.run(input_ids, positions, [s.state.block_ids for s in batch])
            if captured is not None:
                return captured
        meta = AttentionMetadata.build(
            [s.num_tokens for s in batch],
            [s.start + s.num_tokens for s in batch],
            [s.state.block_ids for s in batch],
            self.block_size,
            self.device,
            with_flash=self.attn.needs_flash_metadata,
        )
        dev = self.device
        if hidden_in is not None:
            hidden_in = hidden_in.to(dev)
        hidden: torch.Tensor = model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
            self.attn,
            lora,
            hidden_in,
        )
        return hidden

    def _logits(
        self, batch: list[Scheduled], hidden: torch.Tensor, failed: dict[str, str] | None = None
    ) -> torch.Tensor:
        """Logits of the last token of each sampling request (not of ``failed`` ones)."""
        model = self._model
        logit_rows: list[int] = []
        row = 0
        skip = failed or {}
        for s in batch:
            row += s.num_tokens
            if s.samples and s.state.req_id not in skip:
                logit_rows.append(row - 1)
        if not logit_rows:
            return hidden.new_empty((0, model.config.vocab_size))
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        logits: torch.Tensor = model.compute_logits(hidden.index_select(0, rows))
        return logits


def _ray_node_id() -> str | None:
    """The Ray node this process runs on, or None outside Ray."""
    try:
        import ray
    except ImportError:
        return None
    if not ray.is_initialized():
        return None
    node_id: str = ray.get_runtime_context().get_node_id()
    return node_id
