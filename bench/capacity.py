"""The capacity search both capacity benchmarks run: the highest arrival rate at which a
policy keeps its SLO attainment at the target, by doubling (or halving) from a start and then
bisecting. `bench.sim` runs it on the simulator, `bench.cluster` on the real local cluster."""

from __future__ import annotations

from collections.abc import Callable

SLO_TARGET = 0.95
"""LLM-Mesh §8.1: a policy's capacity is the highest rate it serves with 95 % of requests
within their SLOs."""


def capacity_search(
    attainment_at: Callable[[float], float],
    start: float,
    *,
    steps: int,
    target: float = SLO_TARGET,
    max_doublings: int = 11,
    max_halvings: int = 3,
) -> tuple[float, list[tuple[float, float]]]:
    """The highest rate (within the bisection's `steps`) whose attainment is >= `target`, and
    every (rate, attainment) tried, by rate. 0.0 when even `start` / 2**max_halvings misses.

    Attainment is taken as falling with the rate (a noisy measurement may not be: the search
    trusts each point once, as a person bisecting by hand would)."""
    points: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        att = attainment_at(rate)
        points.append((rate, att))
        return att >= target

    if ok(start):
        lo, hi = start, start * 2
        for _ in range(max_doublings):
            if not ok(hi):
                break
            lo, hi = hi, hi * 2
        else:
            return lo, sorted(points)  # passes everything tried: the capacity is at least lo
    else:
        lo, hi = start / 2, start
        for _ in range(max_halvings):
            if ok(lo):
                break
            lo, hi = lo / 2, lo
        else:
            return 0.0, sorted(points)
    for _ in range(steps):
        mid = (lo + hi) / 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo, sorted(points)
