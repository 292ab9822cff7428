"""Aborts that overtake their request (Ray runs an async actor's calls out of order): kept for a
while and applied when the request arrives, but never to a new request that reuses the id of
one that finished."""

from __future__ import annotations

import time

from cluster.control.remembered import EarlyAborts


def test_an_abort_before_its_request_waits_for_it() -> None:
    aborts = EarlyAborts(ttl_s=60.0)
    aborts.remember("r")
    assert aborts.take("r") is True
    assert aborts.take("r") is False  # once
    assert aborts.take("never-aborted") is False


def test_an_abort_of_a_finished_request_is_not_kept_for_a_reused_id() -> None:
    aborts = EarlyAborts(ttl_s=60.0)
    aborts.finished("r")
    aborts.remember("r")  # a late abort of the finished request
    assert aborts.take("r") is False  # the id's next request runs
    aborts.remember("r")  # now "r" is unknown again: an abort of its next request
    assert aborts.take("r") is True


def test_old_and_surplus_aborts_are_forgotten() -> None:
    aborts = EarlyAborts(ttl_s=0.05, max_ids=3)
    aborts.remember("old")
    time.sleep(0.1)
    assert aborts.take("old") is False  # expired
    for i in range(10):
        aborts.remember(f"r{i}")
    assert len(aborts._pending) <= 4
    assert aborts.take("r9") is True and aborts.take("r0") is False


def test_an_abort_by_the_users_id_waits_for_every_sample_of_it() -> None:
    """``abort("r")`` before the samples ``r#0`` .. ``r#2`` of an ``n = 3`` request came:
    each ends on arrival, in whatever order they come; then it is forgotten."""
    aborts = EarlyAborts(ttl_s=60.0)
    aborts.remember("r")
    assert aborts.take_sample("r", 3) is True  # (the last sample first, say)
    assert aborts.take_sample("r", 3) is True
    assert aborts.take_sample("r", 3) is True
    assert aborts.take_sample("r", 3) is False  # a later request's samples run
    assert aborts.take_sample("other", 2) is False


def test_a_late_abort_of_a_finished_n_request_is_not_kept_for_a_reused_id() -> None:
    """The samples finished (the central scheduler marks the user's id finished with them);
    an abort by that id afterwards must not end the samples of a new request reusing it."""
    aborts = EarlyAborts(ttl_s=60.0)
    aborts.finished("r")
    aborts.remember("r")
    assert aborts.take_sample("r", 2) is False
    assert aborts.take_sample("r", 2) is False


def test_an_abort_by_the_users_id_counts_the_samples_that_came_already() -> None:
    """``abort("r")`` of an ``n = 3`` request: one sample running (the caller ends it) and
    one ended lately -- kept for the one still to come, then forgotten; with every sample
    come, not kept at all; with none here and its sample 0 ended lately, not kept either
    (a late abort: the id may be reused)."""
    aborts = EarlyAborts(ttl_s=60.0)
    aborts.finished("r#1")
    aborts.remember_family("r", running=1, num_samples=3)
    assert aborts.take_sample("r", 3) is True  # r#2
    assert aborts.take_sample("r", 3) is False  # a new request's samples run
    aborts.finished("s#0")
    aborts.remember_family("s", running=2, num_samples=3)
    assert aborts.take_sample("s", 3) is False
    aborts.finished("t#0")
    aborts.remember_family("t", running=0, num_samples=None)
    assert aborts.take_sample("t", 2) is False
    aborts.remember_family("u", running=0, num_samples=None)  # yet to come
    assert aborts.take_sample("u", 2) is True


def test_an_abort_aimed_at_a_submit_ends_only_that_submit() -> None:
    """A client aborts a submit it got no answer for (the central actor seemed away) as that
    submit: remembered, it ends that submit when it arrives late -- never a later submit of
    the same id (after a long outage, a caller that reuses its ids)."""
    aborts = EarlyAborts(ttl_s=60.0)
    aborts.remember("r", aimed=("c", 1))
    assert aborts.take("r", ("c", 2)) is False  # a later submit of the id runs
    assert aborts.take("r", ("c", 1)) is True  # the late first try ends on arrival
    assert aborts.take("r", ("c", 1)) is False  # (once)
    aborts.remember("r")
    assert aborts.take("r", ("c", 5)) is True  # a plain abort: any submit of the id


def test_an_aimed_abort_is_kept_for_an_id_that_finished_lately() -> None:
    """An earlier submit of the id finished (kept 60 s, so a late plain abort of it does not
    end the id's next request): an abort aimed at a later submit was dropped on that account,
    and its submit, arriving late, ran for a client that had given up on it."""
    aborts = EarlyAborts(ttl_s=60.0)
    aborts.finished("r")  # submission 1 of r ended
    aborts.remember("r", aimed=("c", 2))  # submission 2 got no answer: its abort came first
    assert aborts.take("r", ("c", 3)) is False  # a later submit runs
    assert aborts.take("r", ("c", 2)) is True
    aborts.finished("r")
    aborts.remember("r")  # a plain late abort of the finished one: still not kept
    assert aborts.take("r", ("c", 4)) is False


def test_two_aimed_aborts_of_one_id_each_end_their_submit() -> None:
    """Two unanswered submits of one id (an outage), each aborted as itself: the first to
    arrive took both aborts away, and the second ran."""
    aborts = EarlyAborts(ttl_s=60.0)
    aborts.remember("r", aimed=("c", 1))
    aborts.remember("r", aimed=("c", 2))
    assert aborts.take("r", ("c", 1)) is True
    assert aborts.take("r", ("c", 3)) is False  # neither is this one
    assert aborts.take("r", ("c", 2)) is True
    assert aborts.take("r", ("c", 2)) is False  # (once)


def test_an_aimed_abort_never_ends_the_samples_of_a_request_reusing_its_id() -> None:
    """A request "r" met a stop string: its client sent its abort (as that submit) twice,
    the second after "r" had finished -- kept, aimed at that submit. The client then reuses
    the id for an ``n = 2`` request: its samples ``r#0``, ``r#1`` took the aimed abort for an
    abort by the user's id, and both ended as soon as they came."""
    aborts = EarlyAborts(ttl_s=60.0)
    aborts.finished("r")
    aborts.remember("r", aimed=("c", 0))  # the late second abort of submit 0
    assert aborts.take_sample("r", 2) is False
    assert aborts.take_sample("r", 2) is False
    assert aborts.take("r", ("c", 0)) is True  # (still there for the submit it is aimed at)
    aborts.remember("r")  # a plain abort by the id: the samples still to come end
    assert aborts.take_sample("r", 2) is True


def test_what_an_abort_keeps_goes_with_it_and_a_consumed_ones_count_is_not_reused() -> None:
    """``_aimed`` and ``_samples`` were swept whole on every ``remember`` (O(all) each); they
    hold ids in ``_pending`` only, and now go with theirs. Where ``take`` consumed an abort by
    a request with the very id of a user's ``n > 1`` request, its count of samples went too:
    a new abort by that id waits for every sample again, not for what the old count left."""
    aborts = EarlyAborts(ttl_s=0.05)
    aborts.remember("a", aimed=("c", 1))
    aborts.remember("s", taken=1)
    time.sleep(0.1)
    aborts.remember("z")  # the two expire
    assert not aborts._aimed and not aborts._samples and list(aborts._pending) == ["z"]

    aborts = EarlyAborts(ttl_s=60.0)
    aborts.remember("r", taken=1)  # by the user's id: 1 of its 3 samples came already
    assert aborts.take("r") is True  # a request under the very id "r" took it
    aborts.remember("r")  # a new abort by "r", before any sample of its request came
    assert [aborts.take_sample("r", 3) for _ in range(4)] == [True, True, True, False]
