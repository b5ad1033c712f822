"""Which adapter's requests an engine runs, and which loaded adapters it drops (issue 34). Pure:
state and a clock in, a decision out (the engine's continuous-batching core and the node's
instances act on them: `services/engine/core.py`, `services/engine/adapters.py`). An idle
loaded adapter leaves at its keep-alive, or sooner under memory pressure, by Tangram's cost
beside idle models (`adapter_residents`).

OpenVINO GenAI's continuous-batching pipeline applies one adapter set to every request of a
step (its `step()` ignores a request's own `GenerationConfig.adapters`; the set is switched
only by a `generate` call, between batches): an OpenVINO engine batches by adapter. A group is
an adapter's name ("" for the base alone). The group in the pipeline runs until it drains; as
soon as another group waits, newcomers of the running group wait too, and the next group is the
one whose oldest request has waited longest: no group starves, however busy another is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from policy.eviction import Resident

BASE = ""
"""The group of requests for the base model itself."""


def joins_now(group: str, running: str | None, waiting: Iterable[str]) -> bool:
    """Whether a new request of `group` joins the pipeline's batch at once: its group is the
    one applied (`running`; None: none applied yet) and no other group waits for its turn."""
    return group == running and all(g == running for g in waiting)


def next_group(oldest: Mapping[str, float]) -> str:
    """The group that runs next, of those waiting (`oldest`: each group's oldest request's
    arrival): the longest waiting, first come first served between groups."""
    return min(oldest, key=lambda g: (oldest[g], g))


ADAPTER_RELOAD_S = 0.05
"""An adapter's reload time until its own is measured: reading a few megabytes and applying them
(`bench/results/adapters.json`: a cold adapter's first token 0.02-0.03 s after a warm base's)."""


@dataclass(frozen=True)
class AdapterUse:
    """An adapter loaded on an instance: what its keep-alive and its eviction are judged by."""

    keep_alive_s: float
    last_used: float
    """time.monotonic() its last request ended (or began, while it has some)."""
    active: int = 0
    """Its requests in flight."""
    nbytes: int = 0
    """What its loading booked (`AdapterRef.nbytes`)."""
    first_used: float = 0.0
    """time.monotonic() of its load."""
    uses: int = 1
    reload_s: float = ADAPTER_RELOAD_S
    """Its load's measured seconds (read and applied): what evicting it costs its next request."""


def adapter_residents(
    loaded: Mapping[str, AdapterUse], now: float, wall_now: float, key: Callable[[str], str], priority: int = 0
) -> list[Resident]:
    """The loaded adapters no request uses, as Tangram residents (`policy.eviction`), so that
    memory pressure evicts them by eq. 2's cost beside idle models' weights: the likelier its
    reuse and the dearer its reload, the later it goes. `now`: time.monotonic(), the clock of
    `loaded`; the residents are on the wall clock (`wall_now`) of `policy.eviction`'s callers. A pinned
    adapter (an infinite keep-alive, issue 35) is pinned there too; `key` names each (the
    memory manager's owner of its bytes)."""
    wall = wall_now - now
    return [
        Resident(
            key(name),
            u.nbytes,
            u.reload_s,
            first_used=wall + u.first_used,
            last_used=wall + u.last_used,
            uses=u.uses,
            priority=priority,
            pinned=math.isinf(u.keep_alive_s),
        )
        for name, u in sorted(loaded.items())
        if u.active == 0
    ]


def idle_adapters(loaded: Mapping[str, AdapterUse], now: float) -> list[str]:
    """The loaded adapters to drop: no request in flight, and idle their keep-alive. The base
    is not judged here (it keeps its own keep-alive)."""
    return sorted(n for n, u in loaded.items() if u.active == 0 and now - u.last_used >= u.keep_alive_s)
