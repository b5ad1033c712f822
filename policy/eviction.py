"""What to evict when memory is needed (Tangram §3.2.2, minimal-cost eviction).

Used for two tiers: compiled models kept resident in an engine's workers after their
instances scaled to zero (Tangram §3.1: parameters stay in memory after the instance is
released; TIDAL's template kept warm), and artifacts in a loader's host block cache. When
memory runs short, entries that nothing uses are evicted
in ascending order of cost per byte freed. The cost of evicting one is what it would cost to
need it again: its measured reload time, weighted by how likely it is to be needed (Tangram's
p_m, estimated here from its access rate and how recently it was used) and by the model's
latency sensitivity α (1 by default). Plain LRU would ignore both the reload time and the size.

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


def reuse_likelihood(r: Resident, now: float) -> float:
    """An estimate of p_m in (0, 1]: frequent and recent use make reuse likely."""
    age = max(now - r.first_used, 1.0)
    rate = r.uses / age  # uses per second over its life
    idle = max(now - r.last_used, 0.0)
    return min(1.0, rate * 60.0) / (1.0 + idle / 60.0)


def eviction_cost(r: Resident, now: float) -> float:
    """Tangram eq. 2: c = p_m · (s / b_m) · α, with s / b_m the measured reload time."""
    return reuse_likelihood(r, now) * r.reload_s * r.alpha


def choose_evictions(residents: Iterable[Resident], need_bytes: int, now: float) -> list[str]:
    """Idle residents to evict, cheapest per byte first, until `need_bytes` are freed.

    Returns [] when even evicting every idle resident would not free enough: evicting then
    would cost reloads and still not make room.
    """
    if need_bytes <= 0:
        return []
    idle = [r for r in residents if r.users == 0]
    idle.sort(key=lambda r: (eviction_cost(r, now) / max(r.nbytes, 1), r.last_used))
    chosen: list[str] = []
    freed = 0
    for r in idle:
        if freed >= need_bytes:
            break
        chosen.append(r.key)
        freed += r.nbytes
    return chosen if freed >= need_bytes else []


def over_budget(residents: Iterable[Resident], budget_bytes: int) -> int:
    """Bytes by which idle residents exceed the pool's budget (0 if within)."""
    return max(0, sum(r.nbytes for r in residents if r.users == 0) - budget_bytes)
