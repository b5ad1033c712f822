"""Who gets a node's cores besides the requests: a start beside busy instances, and the
tier-up that waits for an idle node. Pure: the node's state and a clock in, a decision out;
the engine (`services/engine/starts.py`) acts on it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def start_cores(cores: Sequence[int], share: float, others_busy: bool) -> tuple[int, ...] | None:
    """The cores a start may use (its load and first forward pass): all of them (None) while
    nothing else runs on the node; else the last `share` of them, one at least, so that the
    instances decoding keep the rest (TIDAL §5's pre-warm off their path)."""
    if not others_busy:
        return None
    ordered = sorted(cores)
    n = max(1, int(len(ordered) * share))
    return tuple(ordered[-n:]) if n < len(ordered) else None


@dataclass(frozen=True)
class StartTierWorker:
    key: str
    on_start_tier: bool
    tiering: bool = False
    tier_up_failed: bool = False


def next_tier_up(workers: Sequence[StartTierWorker], idle_since: float | None, now: float, idle_s: float) -> str | None:
    """The worker to tier up now, if any: one at a time (a tier-up takes about a core-second),
    only once the whole node has been idle `idle_s` (`idle_since` None: something runs or
    starts), never one whose tier-up failed (it keeps serving from its START tier)."""
    if idle_since is None or now - idle_since < idle_s:
        return None
    if any(w.tiering for w in workers):
        return None
    return next((w.key for w in workers if w.on_start_tier and not w.tier_up_failed), None)
