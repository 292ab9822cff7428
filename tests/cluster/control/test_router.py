"""The Router over real ``Scheduler``s in ``EngineLoop``s (never run): conditional
disaggregation, least-loaded choice with round-robin ties, and prefix affinity. Load and cache
contents are made by driving the schedulers with hand-built outputs; the router sees them as
the central scheduler does, through ``InstanceView``s fed with the loops' summaries."""

from __future__ import annotations

import weakref
from collections import Counter

import pytest

from cluster.config import RouterConfig
from cluster.control.engine_loop import EngineLoop
from cluster.control.router import Route, Router, family_of
from cluster.control.summaries import InstanceView
from scheduler import (
    EngineCoreOutput,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    SchedulerOutput,
)
from tests.scheduler.helpers import make_request, make_scheduler, run_to_completion

BLOCK = 4
PREFIX = list(range(300, 308))  # two full blocks


class _NoExecutor:
    """The loops are never run: routing only reads their schedulers."""

    async def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise AssertionError("the router must not step an instance")


def _ignore(loop: EngineLoop, outputs: list[EngineCoreOutput]) -> None:
    raise AssertionError("no outputs expected")


def _loop(name: str) -> EngineLoop:
    s = make_scheduler(block_size=BLOCK, num_blocks=16, max_model_len=64)
    return EngineLoop(name, s, _NoExecutor(), _ignore)


_VIEWS: weakref.WeakKeyDictionary[EngineLoop, InstanceView] = weakref.WeakKeyDictionary()


def _v(*loops: EngineLoop) -> list[InstanceView]:
    """Each loop's view, brought up to date with a summary of it now (as after a step)."""
    views = []
    for loop in loops:
        kv = loop.scheduler.kv_cache_manager
        view = _VIEWS.setdefault(
            loop, InstanceView(loop.instance_id, "both", kv.block_size, kv.enable_caching)
        )
        view.update(loop.summary())
        views.append(view)
    return views


def _router(**config: object) -> Router:
    return Router(RouterConfig.model_validate(config))


def _cache_prefix(loop: EngineLoop, tail: list[int]) -> None:
    """Run a request starting with ``PREFIX`` to completion on ``loop``: its blocks stay in the
    prefix cache, free."""
    loop.scheduler.add_request(make_request([*PREFIX, *tail], max_tokens=2))
    run_to_completion(loop.scheduler)
    _assert_free(loop)


def _assert_free(*loops: EngineLoop) -> None:
    for loop in loops:
        s = loop.scheduler
        s.check_integrity()
        pool = s.kv_cache_manager.block_pool
        assert pool.num_free_blocks == pool.num_blocks
        assert not s.requests and not s.has_unfinished_requests()


def _busy(loop: EngineLoop, num_tokens: int = 12) -> Request:
    """Give ``loop`` queued work: a request waiting in its scheduler, nothing computed."""
    r = make_request(num_tokens, max_tokens=4)
    loop.scheduler.add_request(r)
    assert loop.queued_tokens() == num_tokens
    return r


def _names(route: Route) -> tuple[str | None, str]:
    return (None if route.prefill is None else route.prefill.instance_id, route.decode.instance_id)


# -- conditional disaggregation ----------------------------------------------------------------


def test_never_keeps_every_request_on_a_decode_instance() -> None:
    p, d = _loop("p"), _loop("d")
    router = _router(disaggregation="never")
    for _ in range(3):
        assert _names(router.route(make_request(40), _v(p), _v(d))) == (None, "d")
    _assert_free(p, d)


def test_always_goes_through_a_prefill_instance() -> None:
    p, d = _loop("p"), _loop("d")
    router = _router(disaggregation="always")
    assert _names(router.route(make_request(3), _v(p), _v(d))) == ("p", "d")
    # Without a live prefill instance the decode instance runs it all.
    assert _names(router.route(make_request(3), _v(), _v(d))) == (None, "d")
    _assert_free(p, d)


def test_threshold_splits_only_long_uncached_prompts() -> None:
    p, d = _loop("p"), _loop("d")
    router = _router(disaggregation=10)
    assert _names(router.route(make_request(9), _v(p), _v(d))) == (None, "d")
    assert _names(router.route(make_request(10), _v(p), _v(d))) == ("p", "d")
    assert _names(router.route(make_request(30), _v(p), _v(d))) == ("p", "d")
    _assert_free(p, d)


def test_long_prompt_mostly_cached_on_the_decode_instance_stays_there() -> None:
    p, d = _loop("p"), _loop("d")
    _cache_prefix(d, [1, 3])
    prompt = [*PREFIX, 20, 21, 22, 23, 24, 25]  # 14 tokens, 8 of them cached on d
    router = _router(disaggregation=10)
    assert router.uncached_tokens(make_request(prompt), _v(d)[0]) == 6
    assert _names(router.route(make_request(prompt), _v(p), _v(d))) == (None, "d")
    # The same prompt with another prefix is computed in full: it is prefilled apart.
    other = [50 + t for t in prompt]
    assert _names(router.route(make_request(other), _v(p), _v(d))) == ("p", "d")
    _assert_free(p, d)


# -- least loaded ------------------------------------------------------------------------------


def test_new_request_goes_to_the_idle_instance() -> None:
    a, b = _loop("a"), _loop("b")
    queued = _busy(a)
    router = _router(disaggregation="never")
    for _ in range(4):  # whatever the round-robin turn
        assert _names(router.route(make_request(6), _v(), _v(a, b))) == (None, "b")
    a.scheduler.finish_requests(queued.request_id, RequestStatus.FINISHED_ABORTED)
    _assert_free(a, b)


def test_decode_instance_of_a_split_request_is_the_least_loaded() -> None:
    p1, p2, d1, d2 = _loop("p1"), _loop("p2"), _loop("d1"), _loop("d2")
    queued = [_busy(p1), _busy(d2)]
    router = _router(disaggregation="always")
    for _ in range(4):
        assert _names(router.route(make_request(20), _v(p1, p2), _v(d1, d2))) == ("p2", "d1")
    p1.scheduler.finish_requests(queued[0].request_id, RequestStatus.FINISHED_ABORTED)
    d2.scheduler.finish_requests(queued[1].request_id, RequestStatus.FINISHED_ABORTED)
    _assert_free(p1, p2, d1, d2)


def test_pending_arrivals_count_as_load() -> None:
    a, b = _loop("a"), _loop("b")
    b.add_request(make_request(12))  # not yet admitted by b's (idle) loop
    router = _router(disaggregation="never")
    for _ in range(4):
        assert _names(router.route(make_request(6), _v(), _v(a, b))) == (None, "a")
    _assert_free(a, b)


@pytest.mark.parametrize("num_instances", [2, 3])
def test_ties_are_spread_round_robin(num_instances: int) -> None:
    loops = [_loop(f"i{k}") for k in range(num_instances)]
    router = _router(disaggregation="never")
    picks = [
        _names(router.route(make_request(6), [], _v(*loops)))[1] for _ in range(2 * num_instances)
    ]
    # Every instance in turn, each window of num_instances consecutive calls covering all.
    assert Counter(picks) == {loop.instance_id: 2 for loop in loops}
    assert len(set(picks[:num_instances])) == num_instances
    _assert_free(*loops)


def test_split_requests_spread_over_idle_prefill_and_decode_instances() -> None:
    ps, ds = [_loop("p0"), _loop("p1")], [_loop("d0"), _loop("d1")]
    router = _router(disaggregation="always")
    routes = [_names(router.route(make_request(20), _v(*ps), _v(*ds))) for _ in range(4)]
    assert Counter(p for p, _ in routes) == {"p0": 2, "p1": 2}
    assert Counter(d for _, d in routes) == {"d0": 2, "d1": 2}
    _assert_free(*ps, *ds)


# -- the samples of an n > 1 request ---------------------------------------------------------


def _samples(name: str, n: int, prompt_len: int = 20) -> list[Request]:
    """The front end's children of request ``name``: ``{name}#{i}``, sample i of n."""
    out = []
    for i in range(n):
        r = make_request(prompt_len, req_id=f"{name}#{i}")
        r.num_samples, r.sample_index = n, i
        out.append(r)
    return out


def _route_sent(
    router: Router, r: Request, prefill: list[InstanceView], decode: list[InstanceView]
) -> Route:
    """Route as the central scheduler does: the chosen instance counts the request at once."""
    route = router.route(r, prefill, decode)
    (route.prefill or route.decode).sent(r.num_tokens)
    return route


def test_the_samples_of_a_split_request_are_prefilled_on_one_instance() -> None:
    """The first sample's queued prompt makes its prefill instance the dearer one; the others
    follow it anyway (they hit its blocks there) and spread over the decode instances."""
    ps, ds = [_loop("p0"), _loop("p1")], [_loop("d0"), _loop("d1")]
    router = _router(disaggregation="always")
    prefill, decode = _v(*ps), _v(*ds)
    for name in ("a", "b"):
        routes = []
        for r in _samples(name, 4):
            route = router.route(r, prefill, decode)
            assert route.prefill is not None
            route.prefill.sent(r.num_tokens)
            route.decode.sent(1)
            routes.append(_names(route))
        assert len({p for p, _ in routes}) == 1, routes
        assert Counter(d for _, d in routes) == {"d0": 2, "d1": 2}
    # The two requests still spread: b's samples went to the other prefill instance.
    assert {v.instance_id for v in prefill if v.queued_tokens == 80} == {"p0", "p1"}
    assert not router._families  # every sample came: nothing is remembered
    _assert_free(*ps, *ds)


def test_the_samples_of_a_colocated_request_stay_on_one_instance() -> None:
    loops = [_loop("a"), _loop("b"), _loop("c")]
    router = _router(disaggregation="never")
    views = _v(*loops)
    picks = {_names(_route_sent(router, r, [], views))[1] for r in _samples("x", 3)}
    assert len(picks) == 1
    other = _names(_route_sent(router, make_request(20), [], views))[1]
    assert other not in picks  # a request of its own goes by load
    _assert_free(*loops)


def test_a_later_sample_chooses_afresh_when_the_first_ones_instance_left() -> None:
    a, b = _loop("a"), _loop("b")
    router = _router(disaggregation="never")
    first, second, third = _samples("y", 3)
    chosen = _names(_route_sent(router, first, [], _v(a, b)))[1]
    left = b if chosen == "a" else a  # the instance still serving
    assert _names(router.route(second, [], _v(left)))[1] == left.instance_id
    # The third follows the second's choice now.
    assert _names(router.route(third, [], _v(a, b)))[1] == left.instance_id
    assert not router._families
    _assert_free(a, b)


def test_a_sample_placed_again_neither_follows_nor_counts() -> None:
    """A sample moved (or routed again after its instance failed) is routed on its own, and
    its siblings still to come follow the first sample's choice."""
    a, b = _loop("a"), _loop("b")
    router = _router(disaggregation="never")
    first, second = _samples("m", 2)
    chosen = _names(_route_sent(router, first, [], _v(a, b)))[1]
    other = "b" if chosen == "a" else "a"
    again = router.route(first, [], _v(a, b), first=False)  # by load: the idle one
    assert _names(again)[1] == other
    assert _names(router.route(second, [], _v(a, b)))[1] == chosen
    assert not router._families
    _assert_free(a, b)


def test_the_later_samples_follow_a_first_one_routed_again_without_its_adapter() -> None:
    """The first sample's instance lacked the adapter's files and it went elsewhere: the
    samples still to come follow it there (each would fail on the first instance too)."""
    a, b = _loop("a"), _loop("b")
    router = _router(disaggregation="never")
    first, second, third = _samples("f", 3)
    chosen = _names(router.route(first, [], _v(a, b)))[1]
    elsewhere = b if chosen == "a" else a
    again = router.route(first, [], _v(elsewhere), first=False)
    router.follow(first, again)
    for later in (second, third):
        assert _names(router.route(later, [], _v(a, b)))[1] == elsewhere.instance_id
    assert not router._families


def test_only_the_front_ends_sample_ids_make_a_family() -> None:
    """``num_samples`` with an id that is not ``{id}#{sample_index}``: routed on its own."""
    a, b = _loop("a"), _loop("b")
    router = _router(disaggregation="never")
    odd = make_request(20, req_id="plain")
    odd.num_samples, odd.sample_index = 2, 1
    assert family_of(odd) is None
    assert family_of(_samples("z#1", 2)[1]) == "z#1"  # a '#' in the user's own id is kept
    picks = {_names(_route_sent(router, r, [], _v(a, b)))[1] for r in (odd, make_request(20))}
    assert picks == {"a", "b"}
    assert not router._families
    _assert_free(a, b)


# -- prefix affinity ---------------------------------------------------------------------------


def test_prompt_goes_where_its_prefix_is_cached() -> None:
    a, b = _loop("a"), _loop("b")
    _cache_prefix(b, [1, 3])
    router = _router(disaggregation="never")
    prompt = [*PREFIX, 40, 41, 42]
    assert router.cached_tokens(make_request(prompt), _v(b)[0]) == 8
    assert router.cached_tokens(make_request(prompt), _v(a)[0]) == 0
    for _ in range(4):  # a is as idle as b: only the cache tells them apart
        assert _names(router.route(make_request(prompt), _v(), _v(a, b))) == (None, "b")
    _assert_free(a, b)


def test_cached_prefix_never_counts_the_last_token() -> None:
    b = _loop("b")
    _cache_prefix(b, [1, 3])
    router = _router()
    # 8 tokens, all cached: the last must still be computed, so one block (4) is the hit.
    assert router.cached_tokens(make_request(PREFIX), _v(b)[0]) == 4
    assert router.cached_tokens(make_request([*PREFIX, 9]), _v(b)[0]) == 8
    _assert_free(b)


def test_without_prefix_affinity_the_cache_is_not_preferred() -> None:
    a, b = _loop("a"), _loop("b")
    _cache_prefix(b, [1, 3])
    router = _router(disaggregation="never", prefix_affinity=False)
    prompt = [*PREFIX, 40, 41, 42]
    assert router.cached_tokens(make_request(prompt), _v(b)[0]) == 0
    picks = [_names(router.route(make_request(prompt), _v(), _v(a, b)))[1] for _ in range(4)]
    assert Counter(picks) == {"a": 2, "b": 2}
    _assert_free(a, b)


def test_no_decode_instance_is_an_error() -> None:
    p = _loop("p")
    router = _router(disaggregation="always")
    with pytest.raises(RuntimeError, match="no live decode-capable instance"):
        router.route(make_request(6), _v(p), _v())
    _assert_free(p)


# -- views: what the router knows between summaries ------------------------------------------


def test_requests_sent_between_summaries_count_until_a_summary_shows_them() -> None:
    """A burst routed before the next step spreads over idle instances (each request sent is
    counted in its view at once), and a summary that has seen a request replaces the guess."""
    loops = [_loop("a"), _loop("b")]
    views = _v(*loops)
    router = _router(disaggregation="never")
    picks = []
    for _ in range(4):
        request = make_request(6)
        view = router.route(request, [], views).decode
        view.sent(request.num_tokens)
        picks.append(view.instance_id)
        next(lp for lp in loops if lp.instance_id == view.instance_id).add_request(request)
    assert Counter(picks) == {"a": 2, "b": 2}
    a = views[0]
    assert (a.num_waiting, a.queued_tokens) == (2, 12)
    # A summary taken before the engine received them keeps them counted...
    stale = loops[0].summary()
    stale.num_received, stale.num_waiting, stale.queued_tokens = 0, 0, 0
    a.update(stale)
    assert (a.num_waiting, a.queued_tokens) == (2, 12)
    # ... one taken after counts them once.
    a.update(loops[0].summary())
    assert (a.num_waiting, a.num_active, a.queued_tokens) == (2, 2, 12)
    for loop in loops:
        loop.abort([r.request_id for r in loop.pending])
    _assert_free(*loops)


def test_prefix_index_follows_evictions() -> None:
    """A prefix evicted from an instance's cache leaves its view with the next summary."""
    b = _loop("b")
    _cache_prefix(b, [1, 3])
    router = _router(disaggregation="never")
    prompt = [*PREFIX, 40, 41, 42]
    (view,) = _v(b)
    assert router.cached_tokens(make_request(prompt), view) == 8
    # Fill every block with other content: the prefix's blocks are reused.
    for k in range(4):
        b.scheduler.add_request(make_request([900 + 16 * k + t for t in range(15)], max_tokens=2))
    run_to_completion(b.scheduler)
    assert router.cached_tokens(make_request(prompt), view) == 8  # not summarized yet
    _v(b)
    assert router.cached_tokens(make_request(prompt), view) == 0
    assert view.prefix.hashes == set(b.scheduler.kv_cache_manager.block_pool.cached)
    _assert_free(b)
