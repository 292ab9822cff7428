"""The scheduler side of a KV connector (DESIGN §3.2, vLLM v1's role-split API).

The scheduler calls these hooks; ``kv_transfer/`` implements them for real transports, and the
worker side lives there too. Kept here so that ``scheduler/`` depends on nothing above it.

``kv_transfer_params`` (a plain dict on the request) carries: ``do_remote_prefill``,
``do_remote_decode``, ``remote_instance_id``, ``remote_block_ids``, ``remote_num_tokens``,
the transport's ``handle`` and a ``deadline``. The scheduler itself only reads
``do_remote_prefill`` and clears it when a failed load falls back to local recompute.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler.kv_cache_utils import KVCacheBlocks
    from scheduler.outputs import SchedulerOutput
    from scheduler.request import Request


class SchedulerConnector(ABC):
    """Hooks a ``Scheduler`` calls to move KV between instances."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond the local prefix hit (``num_computed_tokens``) that can be loaded
        from elsewhere, and whether the load is asynchronous (the request then waits in
        ``WAITING_FOR_REMOTE_KVS``). ``None`` means "ask again next step". Must have no side
        effects: it may be called for the same request on several steps. The async flag must
        be False when the count is 0."""

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Called for every admitted request once its blocks exist; ``blocks`` is its whole
        table. A connector that loads remote KV records where to write it here."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """Once per step, before ``num_computed_tokens`` advances: the worker-side
        instructions for this step (loads to start, saves to make). Resets per-step state."""

    def update_connector_output(self, connector_output: Any) -> None:  # noqa: B027
        """Once per step, before the step's outputs are applied: the worker side's report
        (``ModelRunnerOutput.kv_connector_output``, when not None). No-op by default."""

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called exactly once when a request finishes, before its blocks are freed.

        ``block_ids`` cover its computed tokens (a partial last block included). Returns
        ``(delay_free, kv_transfer_params)``: with ``delay_free`` the scheduler keeps the
        blocks until a ``finished_sending`` report names the request; the params travel to
        the client / decode instance with the request's final output.
        """

    def request_preempted(self, request: Request) -> bool:
        """``request`` was preempted: its blocks are freed and it will be computed again.
        True when a save of its blocks is still in flight: the scheduler then drops the
        output of its steps in flight (as vLLM does for a KV producer), whose sampled token
        would otherwise end the request with a save of blocks it no longer holds. False by
        default."""
        return False

    def remote_kv_dropped(self, request: Request) -> None:  # noqa: B027
        """Decode side: ``request`` will not read the remote KV its ``kv_transfer_params``
        name (its load failed, or it finished before loading): the source may let it go.
        No-op by default."""

    def has_pending(self) -> bool:
        """Instructions for the worker wait that no request's step would carry (a release
        of saved KV): the engine loop steps once more. False by default."""
        return False
