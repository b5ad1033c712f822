"""Pacing of a periodic loop whose dependency may be down (Valkey, for the scheduler's
keep-alive): it backs off while its passes fail, and says so once per change of state, down
then up, instead of once per pass. Pure: the loop reports each outcome and the clock, and
reads how long to wait and what to log."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Change(StrEnum):
    DOWN = "down"
    """The first failure after a success (or at the start): log it once, with its error."""
    UP = "up"
    """The first success after failures: log it once."""


@dataclass(frozen=True)
class Step:
    delay_s: float
    """How long to wait before the next pass."""
    change: Change | None = None
    """What changed with this outcome (None: nothing to log)."""
    failures: int = 0
    """Failed passes in a row: those before this success on UP."""
    down_s: float = 0.0
    """On UP: seconds since the first of those failures."""


class Backoff:
    """`period_s` between passes while they succeed; after a failure `period_s`, then twice as
    long at each further failure, up to `cap_s` (never below `period_s`)."""

    def __init__(self, period_s: float, cap_s: float = 5.0, factor: float = 2.0) -> None:
        self.period_s = period_s
        self.cap_s = max(cap_s, period_s)
        self.factor = factor
        self.failures = 0
        self.down_since = 0.0

    def step(self, ok: bool, now: float) -> Step:
        if ok:
            failures, self.failures = self.failures, 0
            if failures:
                return Step(self.period_s, Change.UP, failures, now - self.down_since)
            return Step(self.period_s)
        self.failures += 1
        if self.failures == 1:
            self.down_since = now
        # The exponent stops growing once the cap is reached (no float overflow in a long outage).
        exponent = min(self.failures - 1, 64)
        delay = min(self.cap_s, self.period_s * self.factor**exponent)
        return Step(delay, Change.DOWN if self.failures == 1 else None, self.failures)
