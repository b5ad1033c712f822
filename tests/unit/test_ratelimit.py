"""The rate-limit arithmetic on plain numbers: counts and a clock in, a decision out."""

from __future__ import annotations

import pytest

from services.gateway.ratelimit import Counts, decide, estimate, retry_after_header

W = 60.0


def test_requests_up_to_the_limit_are_allowed_and_the_next_is_denied() -> None:
    now = 1_000 * W + 5  # 5 s into a window
    for n in (1, 2, 3):
        assert decide(Counts(limit=3, previous=0, current=n, cost=1), now, W).allowed
    assert not decide(Counts(limit=3, previous=0, current=4, cost=1), now, W).allowed


def test_a_denied_request_with_an_empty_previous_window_waits_for_the_next_window_and_some() -> None:
    # 3 requests counted in this window, limit 3: after the turn they weigh 3 * (1 - t/60);
    # a retry fits once 3 * (1 - t/60) + 1 <= 3, i.e. 20 s into the next window.
    d = decide(Counts(limit=3, previous=0, current=4, cost=1), 1_000 * W + 10, W)
    assert not d.allowed
    assert d.retry_after_s == pytest.approx(50 + 20)


def test_the_previous_window_weighs_by_its_overlap_with_the_sliding_window() -> None:
    # 45 s into the window, 3/4 of the previous window is out of the sliding window.
    assert estimate(previous=8, current=1, elapsed_s=45, window_s=W) == pytest.approx(3.0)
    assert decide(Counts(limit=3, previous=8, current=1, cost=1), 1_000 * W + 45, W).allowed
    assert not decide(Counts(limit=3, previous=8, current=1, cost=1), 1_000 * W + 44, W).allowed


def test_retry_within_the_window_is_when_the_previous_window_has_decayed_enough() -> None:
    # previous 8, nothing else now; a retry fits when 8 * (1 - t/60) + 1 <= 3: t = 45 s.
    d = decide(Counts(limit=3, previous=8, current=1, cost=1), 1_000 * W + 30, W)
    assert not d.allowed
    assert d.retry_after_s == pytest.approx(15)
    assert decide(Counts(limit=3, previous=8, current=1, cost=1), 1_000 * W + 30 + 15, W).allowed


def test_no_burst_of_twice_the_limit_across_a_window_boundary() -> None:
    # A fixed window would allow 3 at 59.9 s and 3 more at 60.1 s.
    end_of_previous = Counts(limit=3, previous=3, current=1, cost=1)
    assert not decide(end_of_previous, 1_001 * W + 0.1, W).allowed


def test_token_cost_counts_whole_and_a_cost_over_the_limit_is_never_allowed() -> None:
    assert decide(Counts(limit=1000, previous=0, current=1000, cost=600), 5.0, W).allowed
    d = decide(Counts(limit=1000, previous=0, current=1600, cost=600), 5.0, W)
    assert not d.allowed and d.retry_after_s is not None
    never = decide(Counts(limit=1000, previous=0, current=1200, cost=1200), 5.0, W)
    assert not never.allowed and never.retry_after_s is None


def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one() -> None:
    assert retry_after_header(0.0) == 1
    assert retry_after_header(0.2) == 1
    assert retry_after_header(20.0) == 20
    assert retry_after_header(20.01) == 21


def test_a_retry_at_the_announced_time_is_allowed() -> None:
    for previous, current, elapsed in [(0, 4, 10.0), (8, 1, 30.0), (5, 3, 50.0), (2, 6, 0.5)]:
        counts = Counts(limit=3, previous=previous, current=current, cost=1)
        now = 1_000 * W + elapsed
        d = decide(counts, now, W)
        assert not d.allowed and d.retry_after_s is not None
        later = now + d.retry_after_s + 1e-6
        others = current - 1
        # What Valkey would hold then, if nothing else arrived (the denied request was refunded).
        if later // W == now // W:
            retry = Counts(limit=3, previous=previous, current=others + 1, cost=1)
        else:
            retry = Counts(limit=3, previous=others, current=1, cost=1)
        assert decide(retry, later, W).allowed, (previous, current, elapsed, d)
        sooner = now + max(d.retry_after_s - 1.0, 0.0)
        if sooner // W == now // W and d.retry_after_s >= 1.0:
            assert not decide(Counts(limit=3, previous=previous, current=current, cost=1), sooner, W).allowed
