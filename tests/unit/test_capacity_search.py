"""The capacity search `bench.sim` and `bench.cluster` both run, and the interval `bench.cluster`
puts around each measured attainment (bench/capacity.py)."""

from __future__ import annotations

import pytest

from bench.capacity import attainment_interval, capacity_search


def knee(at: float, below: float = 0.99, above: float = 0.80):  # type: ignore[no-untyped-def]
    """Attainment that holds up to the rate `at` and falls past it."""
    return lambda rate: below if rate <= at else above


@pytest.mark.parametrize("cap", [0.3, 1.0, 1.37, 2.9, 11.0])
def test_it_finds_the_knee_within_the_bisection_from_either_side(cap: float) -> None:
    start, steps = 1.4, 4
    found, points = capacity_search(knee(cap), start, steps=steps)
    # Never above the knee; below it by less than the bracket left after `steps` halvings
    # (the bracket is the start's octave that holds the knee).
    assert found <= cap
    octave = max(start * 2 ** round_down_log2(cap / start), 0.0)
    assert cap - found <= octave / 2**steps + 1e-9
    # Every point is reported once, in rate order, with the attainment seen there.
    rates = [r for r, _ in points]
    assert rates == sorted(rates) and len(set(rates)) == len(rates)
    assert all(a == knee(cap)(r) for r, a in points)


def round_down_log2(x: float) -> int:
    n = 0
    while x >= 2:
        x, n = x / 2, n + 1
    while x < 1:
        x, n = x * 2, n - 1
    return n


def test_a_policy_that_misses_even_far_below_the_start_has_no_capacity() -> None:
    found, points = capacity_search(lambda rate: 0.5, 1.0, steps=3, max_halvings=3)
    assert found == 0.0
    assert [r for r, _ in points] == [0.125, 0.25, 0.5, 1.0]


def test_the_target_is_inclusive_and_each_rate_is_measured_once() -> None:
    calls: list[float] = []

    def at(rate: float) -> float:
        calls.append(rate)
        return 0.95 if rate <= 3.0 else 0.9

    found, _ = capacity_search(at, 1.5, steps=2)
    assert found == 3.0  # 0.95 meets a 0.95 target
    assert calls == [1.5, 3.0, 6.0, 4.5, 3.75]


def test_an_attainments_interval_is_wilsons_and_shows_one_window_is_noise() -> None:
    # Wilson's interval: none of 10 met spans up to z²/(n + z²) = 0.2775; all of 10, down to 0.7225.
    assert attainment_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert attainment_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    lo, hi = attainment_interval(57, 60)
    assert lo < 0.95 < hi and lo == pytest.approx(0.8630, abs=1e-4) and hi == pytest.approx(0.9829, abs=1e-4)
    # More requests, a narrower interval around the same attainment.
    wide, narrow = attainment_interval(19, 20), attainment_interval(190, 200)
    assert narrow[1] - narrow[0] < wide[1] - wide[0]
    assert attainment_interval(0, 0) == (0.0, 1.0)
