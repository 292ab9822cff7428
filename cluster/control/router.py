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

The samples of one ``n > 1`` request (``{id}#{i}``, sample ``i`` of ``num_samples``) follow
their first sample's choice while its instance serves: the prompt is computed once there and
the others hit its blocks (the first sample's queued tokens would otherwise send them to an
idle instance that computes the prompt again). Each sample of a split request still goes to
the least-loaded decode instance.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
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


MAX_FAMILIES = 4096  # n > 1 requests whose other samples are still to come


def family_of(request: Request) -> str | None:
    """The id of the ``n > 1`` request that ``request`` is a sample of (its id without the
    ``#{sample_index}`` the front end adds), or None for a request of its own."""
    if request.num_samples <= 1:
        return None
    suffix = f"#{request.sample_index}"
    rid = request.request_id
    return rid[: -len(suffix)] if rid.endswith(suffix) else None


class Router:
    """Stateless apart from the round-robin counter and the routes of the samples still to
    come of ``n > 1`` requests; reads the instances' views."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._turn = itertools.count()
        # family -> (instance that computes the prompt, whether split, samples still to come)
        self._families: OrderedDict[str, tuple[str, bool, int]] = OrderedDict()

    def route(
        self,
        request: Request,
        prefill: list[InstanceView],
        decode: list[InstanceView],
        first: bool = True,
    ) -> Route:
        """``prefill``: live instances with role prefill; ``decode``: live instances with role
        decode or both. ``first``: the request's first placement (a sample placed again --
        moved, or routed again after its instance failed -- neither follows nor counts as one
        of its request's). Raises ``RuntimeError`` when no decode-capable instance is left."""
        if not decode:
            raise RuntimeError("no live decode-capable instance (role decode or both)")
        family = family_of(request) if first else None
        if family is None:
            return self._route(request, prefill, decode)
        known = self._families.pop(family, None)
        route = self._sibling_route(known, prefill, decode) if known is not None else None
        if route is None:  # the first sample, or its instance left: choose afresh
            route = self._route(request, prefill, decode)
        left = (known[2] if known is not None else request.num_samples) - 1
        if left > 0:
            target = route.prefill or route.decode
            self._families[family] = (target.instance_id, route.prefill is not None, left)
            while len(self._families) > MAX_FAMILIES:
                self._families.popitem(last=False)
        return route

    def follow(self, request: Request, route: Route) -> None:
        """The samples still to come of ``request``'s family follow ``route``: the first
        sample's instance could not take it after all (its node lacks the adapter's files),
        and each sibling would fail there first too."""
        family = family_of(request)
        known = self._families.get(family) if family is not None else None
        if family is not None and known is not None:
            target = route.prefill or route.decode
            self._families[family] = (target.instance_id, route.prefill is not None, known[2])

    def _sibling_route(
        self,
        known: tuple[str, bool, int],
        prefill: list[InstanceView],
        decode: list[InstanceView],
    ) -> Route | None:
        """The route of a later sample: its first sample's instance, if it still serves."""
        instance_id, split, _ = known
        for view in prefill if split else decode:
            if view.instance_id == instance_id:
                return Route(view, self.best_decode(decode)) if split else Route(None, view)
        return None

    def _route(
        self, request: Request, prefill: list[InstanceView], decode: list[InstanceView]
    ) -> Route:
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
