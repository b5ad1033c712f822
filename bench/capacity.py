"""The capacity search both capacity benchmarks run: the highest arrival rate at which a
policy keeps its SLO attainment at the target, by doubling (or halving) from a start and then
bisecting. `bench.sim` runs it on the simulator, `bench.cluster` on the real local cluster."""

from __future__ import annotations

import math
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


def attainment_interval(met: int, requests: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of an SLO attainment of `met` out of `requests`: how far
    one window's figure may be from the policy's true attainment at that rate. At the rates a
    2-core machine serves, a window holds tens of requests, and 0.95 measured on 60 of them
    spans about 0.86-0.98: wider than the gap between two rates the search compares."""
    if requests <= 0:
        return 0.0, 1.0
    p = met / requests
    z2n = z * z / requests
    centre = (p + z2n / 2) / (1 + z2n)
    half = z * math.sqrt(p * (1 - p) / requests + z2n / (4 * requests)) / (1 + z2n)
    return max(0.0, centre - half), min(1.0, centre + half)
