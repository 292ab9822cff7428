"""The Router: which instance prefills a request, which decodes it, and whether to split them.

Every instance is scored by the work it would do before this request's next token::

    prefill cost(i) = (uncached_i + queued_i) * (1 + kv_usage_i)
    decode cost(i)  = (queued_i + running_i) * (1 + kv_usage_i)        (KV arrives by transfer)

``uncached_i`` is the prompt minus the prefix instance ``i`` already caches (prefix affinity:
a repeated system prompt goes where its blocks are), ``queued_i`` the tokens it still has to
compute for the requests it holds, ``kv_usage_i`` the fraction of its blocks in use. Ties go
round-robin, so an idle cluster spreads requests.

The router reads ``InstanceView``s only (``cluster.control.summaries``): the engines' per-step
summaries, the requests sent since, and each instance's prefix cache mirrored from its
events -- never an engine itself, which may live in another process.

Conditional disaggregation: the best decode-capable instance is found as if it ran the whole
request; if the part of the prompt it does not cache is shorter than the threshold (or
``disaggregation: never``, or there is no prefill instance) it does, else the request is
prefilled on the best prefill instance and handed to the best decode instance.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduler.kv_cache_utils import update_block_hashes

if TYPE_CHECKING:
    from cluster.config import RouterConfig
    from cluster.control.summaries import InstanceView
    from scheduler import Request


@dataclass(frozen=True)
class Route:
    prefill: InstanceView | None  # None: the decode instance runs the whole request
    decode: InstanceView


class Router:
    """Stateless apart from the round-robin counter; reads the instances' views."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._turn = itertools.count()

    def route(
        self, request: Request, prefill: list[InstanceView], decode: list[InstanceView]
    ) -> Route:
        """``prefill``: live instances with role prefill; ``decode``: live instances with role
        decode or both. Raises ``RuntimeError`` when no decode-capable instance is left."""
        if not decode:
            raise RuntimeError("no live decode-capable instance (role decode or both)")
        turn = next(self._turn)
        full = self._best(decode, turn, lambda v: self._prefill_cost(request, v))
        threshold = self.config.disaggregation
        if not prefill or threshold == "never":
            return Route(None, full)
        if threshold != "always" and self.uncached_tokens(request, full) < threshold:
            return Route(None, full)
        p = self._best(prefill, turn, lambda v: self._prefill_cost(request, v))
        d = self._best(decode, turn, self._decode_cost)
        return Route(p, d)

    def best_decode(self, decode: list[InstanceView]) -> InstanceView:
        """The decode instance to continue a prefilled request on (its KV arrives by
        transfer, so only load counts)."""
        return self._best(decode, next(self._turn), self._decode_cost)

    # -- costs -------------------------------------------------------------------------------
    def uncached_tokens(self, request: Request, view: InstanceView) -> int:
        """Prompt tokens ``view``'s instance would have to compute (its prefix cache aside)."""
        return request.num_tokens - self.cached_tokens(request, view)

    def cached_tokens(self, request: Request, view: InstanceView) -> int:
        """Length of the prefix of ``request`` whose blocks ``view``'s instance caches, as of
        its last summary (block-aligned, never the last token: as the scheduler would find
        it)."""
        if not (self.config.prefix_affinity and view.enable_prefix_caching):
            return 0
        block_size = view.block_size
        # The request's own hash list is shared by every instance with this block size.
        hashes = update_block_hashes(request, block_size)
        max_blocks = (request.num_tokens - 1) // block_size
        return view.prefix.num_cached_blocks(hashes, max_blocks) * block_size

    def _prefill_cost(self, request: Request, view: InstanceView) -> float:
        work = self.uncached_tokens(request, view) + view.queued_tokens
        return work * (1.0 + view.kv_usage)

    @staticmethod
    def _decode_cost(view: InstanceView) -> float:
        work = view.queued_tokens + view.num_active
        return work * (1.0 + view.kv_usage)

    @staticmethod
    def _best(
        views: list[InstanceView], turn: int, cost: Callable[[InstanceView], float]
    ) -> InstanceView:
        n = len(views)
        order = [views[(turn + i) % n] for i in range(n)]  # rotate: ties go round-robin
        return min(order, key=cost)
