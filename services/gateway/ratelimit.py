"""Rate-limit decisions, pure: counts and a clock in, allow or deny (and when to retry) out.

The counters live in Valkey so that every gateway replica enforces one limit (`auth.Quotas`
moves the numbers); the arithmetic is here so that it is tested on plain data.

The window is a sliding window approximated from two fixed windows (the current one and the
one before it): the previous window's count is weighted by how much of it still overlaps the
sliding window. It needs two integers per limit instead of a log of timestamps, never admits a
burst of twice the limit across a window boundary the way a fixed window does, and is exact
when traffic within the previous window was uniform.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Counts:
    """What Valkey holds for one limit, after this request's cost was added to `current`
    (counting first is what keeps concurrent replicas from admitting past the limit)."""

    limit: int
    previous: int
    """Total of the previous fixed window."""
    current: int
    """Total of the current fixed window, this request included."""
    cost: int
    """This request's share of `current`: 1 for requests, tokens for tokens."""


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after_s: float | None = None
    """When a retry of the same cost would be allowed, if nothing else arrives; None when it
    never would be (the cost alone is over the limit) or when allowed."""


def estimate(previous: int, current: int, elapsed_s: float, window_s: float) -> float:
    """Requests (or tokens) in the sliding window that ends now."""
    return previous * (1.0 - elapsed_s / window_s) + current


def decide(c: Counts, now: float, window_s: float) -> Decision:
    """Allow the request if the sliding-window total, its cost included, is within the limit."""
    elapsed = now % window_s
    if c.cost > c.limit:
        return Decision(False, None)
    if estimate(c.previous, c.current, elapsed, window_s) <= c.limit:
        return Decision(True)
    others = c.current - c.cost  # refunded on denial: a retry finds these, plus its own cost
    room = c.limit - c.cost
    if c.previous > 0 and others <= room:
        # Still in this window: the previous window's weight decays until the total fits.
        t = window_s * (1.0 - (room - others) / c.previous) - elapsed
        return Decision(False, max(t, 0.0))
    # Only after the window turns over: `others` becomes the decaying previous window.
    until_turn = window_s - elapsed
    t = window_s * (1.0 - room / others) if others > 0 else 0.0
    return Decision(False, until_turn + max(t, 0.0))


def retry_after_header(seconds: float) -> int:
    """Whole seconds, rounded up (an early retry would only be refused again), at least 1."""
    return max(1, math.ceil(seconds - 1e-9))
