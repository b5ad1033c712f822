"""The keep-alive loop's pacing while Valkey is down (`policy.backoff`): it backs off, and
says so once when passes start failing and once when they work again."""

from __future__ import annotations

from policy.backoff import Backoff, Change


def test_passes_that_work_keep_their_period_and_log_nothing() -> None:
    b = Backoff(0.25, cap_s=5.0)
    steps = [b.step(True, now=float(t)) for t in range(5)]
    assert {(s.delay_s, s.change) for s in steps} == {(0.25, None)}


def test_failures_back_off_to_the_cap_and_log_once_down_once_up() -> None:
    b = Backoff(0.25, cap_s=5.0)
    down = [b.step(False, now=100.0 + i) for i in range(10)]
    assert [s.delay_s for s in down] == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0, 5.0]
    assert [s.change for s in down] == [Change.DOWN] + [None] * 9
    up = b.step(True, now=130.0)
    assert (up.delay_s, up.change, up.failures, up.down_s) == (0.25, Change.UP, 10, 30.0)
    assert b.step(True, now=131.0).change is None


def test_a_second_outage_is_logged_again() -> None:
    b = Backoff(0.25)
    assert b.step(False, now=0.0).change == Change.DOWN
    assert b.step(True, now=1.0).change == Change.UP
    again = b.step(False, now=2.0)
    assert (again.change, again.delay_s) == (Change.DOWN, 0.25)  # the backoff starts over


def test_a_long_outage_stays_at_the_cap() -> None:
    b = Backoff(0.25, cap_s=5.0)
    for i in range(5000):  # no float overflow of the exponent
        step = b.step(False, now=float(i))
    assert step.delay_s == 5.0 and step.change is None


def test_a_period_longer_than_the_cap_is_kept() -> None:
    b = Backoff(10.0, cap_s=5.0)
    assert b.step(False, now=0.0).delay_s == 10.0
    assert b.step(False, now=1.0).delay_s == 10.0
