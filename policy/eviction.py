"""What to evict when memory is needed (Tangram §3.2.2, minimal-cost eviction).

Used for two tiers: compiled models kept resident in an engine's workers after their
instances scaled to zero (Tangram §3.1: parameters stay in memory after the instance is
released; TIDAL's template kept warm), and artifacts in a loader's host block cache. When
memory runs short, entries that nothing uses are evicted in ascending order of their eviction
cost (eq. 2), the cheapest first, until enough is freed: the paper's greedy, by the whole
entry's cost, not its cost per byte. The cost of evicting one is what it would cost to need it
again: its reload time s / b_m (eq. 3's load time with nothing of it reusable; measured where
the caller has it), weighted by how likely it is to be needed (Tangram's p_m, estimated here
from its access rate and how recently it was used) and by the model's latency sensitivity α
(1 by default). Plain LRU would ignore both the reload time and the likelihood.

Priority comes before the cost (issue 35, keep warm): a model's `priority` orders its residents
(the lowest first, then by cost), and a pinned model's (`min_instances > 0`) are never taken
for a model of its own priority or lower (`may_take`).

Pure: state and a clock in, a decision out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class Resident:
    key: str
    """The artifact id: names registered on one GGUF share one resident model."""
    nbytes: int
    reload_s: float
    """Seconds its last load took: what evicting it costs the next start."""
    first_used: float
    last_used: float
    uses: int = 1
    users: int = 0
    """Instances running on it now; a resident in use is never evicted."""
    alpha: float = 1.0
    priority: int = 0
    """Its model's priority: lower priorities are evicted first, whatever their cost."""
    pinned: bool = False
    """Its model is kept warm: never evicted for a model of its priority or lower."""


def may_take(priority: int, pinned: bool, for_priority: int | None) -> bool:
    """Whether a model of `priority` may be evicted or preempted to make room for one of
    `for_priority` (None: for no model in particular, as a pool over its budget): an unpinned
    one always; a pinned one only for a model of higher priority."""
    return not pinned or (for_priority is not None and for_priority > priority)


def reuse_likelihood(r: Resident, now: float) -> float:
    """An estimate of p_m in (0, 1]: frequent and recent use make reuse likely."""
    age = max(now - r.first_used, 1.0)
    rate = r.uses / age  # uses per second over its life
    idle = max(now - r.last_used, 0.0)
    return min(1.0, rate * 60.0) / (1.0 + idle / 60.0)


def eviction_cost(r: Resident, now: float) -> float:
    """Tangram eq. 2: c = p_m · (s / b_m) · α, with s / b_m the measured reload time."""
    return reuse_likelihood(r, now) * r.reload_s * r.alpha


def choose_evictions(
    residents: Iterable[Resident], need_bytes: int, now: float, for_priority: int | None = None
) -> list[str]:
    """Idle residents to evict so that `need_bytes` are freed: Tangram §3.2.2 stage 1.

    The paper's greedy: idle residents in ascending eviction cost (eq. 2, the whole
    resident's cost, its size already in it as s / b_m), evicted until what they free meets
    the need. Not cost per byte: eq. 2 is already the price of evicting all of it, and a
    per-byte order would take a big resident that is unlikely to be needed (4 GB at p = 0.5:
    cost 2 GB / b) before a small one that is (1 GB at p = 1: cost 1 GB / b) when the small
    one alone makes room, paying twice the expected reload.

    One step the paper does not spell out: a victim that the ones after it made unnecessary
    (a cheap small one taken before a big one that alone frees enough) is kept after all,
    the dearest such first. It only takes evictions away, so what is freed still meets the
    need and the total cost (eq. 1's objective, Σ c_j y_j) only falls.

    Ties in cost go to the bigger (more room for the same price), then the least recently
    used. Returns [] when even evicting every idle resident would not free enough: evicting
    then would cost reloads and still not make room.

    Before the cost, the priority: residents of a lower priority go first (and of the
    unnecessary victims, the highest priority is kept first); a pinned resident is no
    candidate unless `for_priority`, the priority of the model the room is for, is higher
    (`may_take`).
    """
    if need_bytes <= 0:
        return []
    idle = [r for r in residents if r.users == 0 and may_take(r.priority, r.pinned, for_priority)]
    if sum(r.nbytes for r in idle) < need_bytes:
        return []
    cost = {id(r): eviction_cost(r, now) for r in idle}
    idle.sort(key=lambda r: (r.priority, cost[id(r)], -r.nbytes, r.last_used, r.key))
    chosen: list[Resident] = []
    freed = 0
    for r in idle:
        if freed >= need_bytes:
            break
        chosen.append(r)
        freed += r.nbytes
    kept: set[int] = set()
    for r in sorted(chosen, key=lambda r: (r.priority, cost[id(r)]), reverse=True):
        if freed - r.nbytes >= need_bytes:
            kept.add(id(r))
            freed -= r.nbytes
    return [r.key for r in chosen if id(r) not in kept]


def over_budget(residents: Iterable[Resident], budget_bytes: int) -> int:
    """Bytes by which idle residents exceed the pool's budget (0 if within)."""
    return max(0, sum(r.nbytes for r in residents if r.users == 0) - budget_bytes)
