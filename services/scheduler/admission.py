"""Admission when no instance can take a request now: queue it with a deadline, or reject it
early with the reason (ARCHITECTURE: the life of a request, step 2).

A queued request is worth keeping only while its first token can still meet the TTFT SLO:
its deadline is the arrival plus the SLO, less the time its prefill (and a start, if one is
needed) will take. Past that it is rejected with a reason the client can read, rather than
served late: a late answer costs the node the same compute and still misses the SLO.

Pure: numbers and a clock in, a decision out.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from shared.messages import ErrorCode, Rejected

T = TypeVar("T")


@dataclass(frozen=True)
class Queue:
    """Hold the request; place it again when capacity frees, until `deadline`."""

    deadline: float


def admit(
    now: float,
    arrival: float,
    ttft_slo: float,
    service_s: float,
    queued: int,
    max_queued: int,
) -> Queue | Rejected:
    """Queue or reject a request that found no place now.

    `service_s`: the least time from placement to its first token (prefill, plus a start if
    none is running). `queued`: requests already waiting for this model.
    """
    deadline = arrival + ttft_slo - service_s
    if deadline <= now:
        return Rejected(
            code=ErrorCode.NO_CAPACITY,
            message=f"no instance can give the first token within the {ttft_slo:.1f}s "
            "TTFT SLO; retry later",
            retry_after_s=max(1.0, service_s),
        )
    if queued >= max_queued:
        return Rejected(
            code=ErrorCode.OVERLOADED,
            message=f"{queued} requests are already waiting for this model",
            retry_after_s=1.0,
        )
    return Queue(deadline)


def expired_rejection(ttft_slo: float) -> Rejected:
    """Why a request left the queue unserved."""
    return Rejected(
        code=ErrorCode.TIMEOUT,
        message=f"no capacity freed within the {ttft_slo:.1f}s TTFT SLO",
        retry_after_s=1.0,
    )


@dataclass(order=True)
class _Entry(Generic[T]):
    deadline: float
    seq: int
    item: T = field(compare=False)


@dataclass
class DeadlineQueue(Generic[T]):
    """Waiting requests in arrival order, each with a deadline. Expired ones are taken out
    in deadline order; placement looks at them in arrival order."""

    _by_deadline: list[_Entry[T]] = field(default_factory=list)
    _live: dict[int, _Entry[T]] = field(default_factory=dict)
    _seq: int = 0

    def __len__(self) -> int:
        return len(self._live)

    def push(self, item: T, deadline: float) -> int:
        self._seq += 1
        e = _Entry(deadline, self._seq, item)
        heapq.heappush(self._by_deadline, e)
        self._live[e.seq] = e
        return e.seq

    def remove(self, ticket: int) -> None:
        self._live.pop(ticket, None)

    def waiting(self) -> list[tuple[int, T]]:
        """(ticket, item) in arrival order."""
        return [(s, e.item) for s, e in self._live.items()]

    def expire(self, now: float) -> list[T]:
        """Remove and return the items whose deadline has passed."""
        out: list[T] = []
        while self._by_deadline and self._by_deadline[0].deadline <= now:
            e = heapq.heappop(self._by_deadline)
            if self._live.pop(e.seq, None) is not None:
                out.append(e.item)
        return out

    def next_deadline(self) -> float | None:
        while self._by_deadline and self._by_deadline[0].seq not in self._live:
            heapq.heappop(self._by_deadline)
        return self._by_deadline[0].deadline if self._by_deadline else None
