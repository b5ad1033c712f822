"""Headroom-based token-level scheduling on one node (LLM-Mesh §5.1).

A node runs one iteration of one instance at a time (a prefill of one request, or a decode
step of the instance's whole batch) and then picks again. It picks the instance holding the
most urgent request: the one with the least headroom, eq. 1,

    headroom = ST + TTFT_SLO + TPOT_SLO · O − CT,

the longest the request's next token may still be delayed without missing its SLO. A
negative headroom is a missed SLO. The engine's interleaving loop and shadow validation both
step through this same choice.

Pure: state and a clock in, a choice out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass


def headroom(start: float, ttft_slo: float, tpot_slo: float, generated: int, now: float) -> float:
    """Eq. 1: seconds the request's next token may still wait (negative: SLO already missed)."""
    return start + ttft_slo + tpot_slo * generated - now


@dataclass(frozen=True)
class RequestClock:
    """What the scheduler knows about one running request."""

    request_id: str
    start: float
    """ST: when the request arrived."""
    ttft_slo: float
    tpot_slo: float
    generated: int = 0
    """O: tokens produced so far (0: its prefill has not run)."""

    def headroom(self, now: float) -> float:
        return headroom(self.start, self.ttft_slo, self.tpot_slo, self.generated, now)

    def after_token(self) -> RequestClock:
        return RequestClock(self.request_id, self.start, self.ttft_slo, self.tpot_slo, self.generated + 1)


@dataclass(frozen=True)
class Pick:
    """The next iteration to run: `instance`, a prefill of `request_id` or a decode step."""

    instance: str
    prefill_of: str | None
    """The request whose prefill runs; None for a decode step of the whole batch."""
    headroom_s: float


def pick_next(instances: Mapping[str, Iterable[RequestClock]], now: float) -> Pick | None:
    """The iteration to run next: the instance with the shortest request headroom.

    Within the chosen instance, a request still waiting for its prefill is served by a prefill
    iteration; otherwise the instance runs a decode step for its batch. Ties go to the
    instance named first in sorted order, so the choice is deterministic.
    """
    best: Pick | None = None
    for name in sorted(instances):
        for r in instances[name]:
            h = r.headroom(now)
            if best is None or h < best.headroom_s:
                best = Pick(name, r.request_id if r.generated == 0 else None, h)
    return best


def run_iteration(instances: Mapping[str, tuple[RequestClock, ...]], pick: Pick) -> dict[str, tuple[RequestClock, ...]]:
    """The request clocks after `pick` has run: one token more for each request it served."""
    out = dict(instances)
    reqs = instances[pick.instance]
    if pick.prefill_of is not None:
        out[pick.instance] = tuple(r.after_token() if r.request_id == pick.prefill_of else r for r in reqs)
    else:
        out[pick.instance] = tuple(r.after_token() if r.generated > 0 else r for r in reqs)
    return out
