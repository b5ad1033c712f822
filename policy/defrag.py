"""Efficiency-oriented defragmentation (LLM-Mesh §7).

Proactive (§7.1): when neighbour instances on a node stop an instance from growing to take a
request, it may preempt them; their requests are rescheduled elsewhere. Only neighbours with
a lower batch than the preempting instance may be taken (taking a bigger one would break up an
instance that had grown large, the fragmentation this is meant to cure), the lowest batch
first, and only if every preempted request still validates somewhere else.

Reactive (§7.2) is placement's order of candidates: new requests go to a model's busiest
instance first, so the small (fragmented) ones drain and scale-in reclaims them
(`placement.join_order`); a new instance goes on the node it fills best among those that
validate, so whole nodes stay free for big instances (`placement.start_order`).

Pure: views in, a decision out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from policy.eviction import may_take

T = TypeVar("T")


@dataclass(frozen=True)
class Neighbour:
    """Another model's instance on the node that a preemption could take."""

    key: str
    batch: int
    nbytes: int
    """Bytes it would free: weights and KV cache."""
    relocatable: bool
    """Every request it runs validates on some other instance (the caller checked, §7.1)."""
    priority: int = 0
    """Its model's priority (issue 35): lower priorities are taken first."""
    pinned: bool = False
    """Its model is kept warm: taken only for a preemptor of higher priority."""


@dataclass(frozen=True)
class Preempt:
    victims: tuple[str, ...]
    freed_bytes: int


def choose_preemption(
    batch: int, need_bytes: int, neighbours: Iterable[Neighbour], for_priority: int = 0
) -> Preempt | None:
    """Neighbours to preempt so an instance of `batch` gains `need_bytes`, or None.

    Only lower-batch neighbours, lowest batch first (ties: the one freeing more first, so
    fewer are disturbed); an idle neighbour (batch 0) is always relocatable. None when even
    taking every eligible neighbour would not free enough. Priority comes first (issue 35):
    lower priorities are taken first, and a pinned neighbour only for a preemptor of higher
    priority than its own (`for_priority`).
    """
    if need_bytes <= 0:
        return Preempt((), 0)
    eligible = [
        n
        for n in neighbours
        if n.batch < batch and (n.relocatable or n.batch == 0) and may_take(n.priority, n.pinned, for_priority)
    ]
    eligible.sort(key=lambda n: (n.priority, n.batch, -n.nbytes, n.key))
    victims: list[str] = []
    freed = 0
    for n in eligible:
        if freed >= need_bytes:
            break
        victims.append(n.key)
        freed += n.nbytes
    return Preempt(tuple(victims), freed) if freed >= need_bytes else None


TYPICAL_PROMPT_TOKENS = 64
"""The request a relocation check validates for a preempted instance (its own requests'
sizes stay on its node)."""


def relocatable(models: Iterable[str], others: Sequence[T], validates: Callable[[T, str], bool]) -> tuple[str, ...]:
    """§7.1's condition for preempting an instance: its requests still validate on some other
    node (`others`: the live nodes but its own; `validates`: shadow validation of one of its
    requests there, on an instance it has or a new one)."""
    return tuple(m for m in models if any(validates(n, m) for n in others))
