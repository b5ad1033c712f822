"""Which adapter's requests an engine runs, and which loaded adapters it drops (issue 34). Pure:
state and a clock in, a decision out (the engine's continuous-batching core and the node's
instances act on them: `services/engine/core.py`, `services/engine/adapters.py`).

OpenVINO GenAI's continuous-batching pipeline applies one adapter set to every request of a
step (its `step()` ignores a request's own `GenerationConfig.adapters`; the set is switched
only by a `generate` call, between batches): an OpenVINO engine batches by adapter. A group is
an adapter's name ("" for the base alone). The group in the pipeline runs until it drains; as
soon as another group waits, newcomers of the running group wait too, and the next group is the
one whose oldest request has waited longest: no group starves, however busy another is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

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


@dataclass(frozen=True)
class AdapterUse:
    """An adapter loaded on an instance: what its keep-alive is judged by."""

    keep_alive_s: float
    last_used: float
    """time.monotonic() its last request ended (or began, while it has some)."""
    active: int = 0
    """Its requests in flight."""


def idle_adapters(loaded: Mapping[str, AdapterUse], now: float) -> list[str]:
    """The loaded adapters to drop: no request in flight, and idle their keep-alive. The base
    is not judged here (it keeps its own keep-alive)."""
    return sorted(n for n, u in loaded.items() if u.active == 0 and now - u.last_used >= u.keep_alive_s)
