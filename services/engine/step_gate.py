"""Token-level interleaving of a node's instances by headroom (LLM-Mesh §5.1).

Left to the OS, instances sharing a node's cores decode side by side, each slowed by the others
however urgent its requests. The gate runs `capacity` iterations (a prefill, or one decode step
of a batch) at a time, and the next goes to the worker holding the least headroom (eq. 1,
`policy/headroom.py`): the earliest deadline ST + TTFT_SLO + TPOT_SLO · O.

The state is shared memory (two arrays under a lock, a semaphore per worker) made by the engine
and handed to the workers it spawns. The engine frees the slot of a worker that ends; the lock
is only taken with a timeout, past which a worker runs ungated (its holder was killed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from multiprocessing.context import SpawnContext
from typing import Any

SLOTS = 64
"""Workers a node's gate can hold; one without a slot runs ungated."""
WAIT_S = 0.05
"""Longest a waiting worker sleeps before it looks again (bounds a missed wake-up)."""
LOCK_S = 1.0
"""The lock guards a few array writes: not having it within this long means its holder died."""


def may_step(slot: int, deadlines: Sequence[float], holding: Sequence[int], capacity: int) -> bool:
    """Whether `slot` runs now: fewer than `capacity` iterations run and no other waiting
    worker is more urgent (ties go to the lower slot)."""
    if sum(holding) >= capacity:
        return False
    mine = deadlines[slot]
    for other, d in enumerate(deadlines):
        if other != slot and (d < mine or (d == mine and other < slot and not math.isinf(d))):
            return False
    return True


@dataclass
class Turn:
    then: float = math.inf
    """The deadline of the batch's next iteration, posted as it leaves (a batch that goes on
    keeps its place between passes); inf: none."""


TakeTurn = Callable[[float], AbstractContextManager["Turn | None"]]
"""take_turn(deadline): held around every forward pass of a batch, with its most urgent
request's next-token deadline (`StepGate.turn`; tests pass `no_turn`)."""


def no_turn(deadline: float) -> AbstractContextManager[None]:
    return nullcontext()


class Turns:
    """A batch's turns and the seconds it waited for them (`Batch.waited`); itself a `TakeTurn`."""

    def __init__(self, turn: TakeTurn) -> None:
        self._turn = turn
        self.waited = 0.0

    @contextmanager
    def __call__(self, deadline: float) -> Iterator[Turn | None]:
        t0 = time.monotonic()
        with self._turn(deadline) as held:
            self.waited += time.monotonic() - t0
            yield held


def post(held: Turn | None, deadlines: Iterable[float]) -> None:
    """End a turn posted with the most urgent of the batch's next pass's deadlines."""
    if held is not None:
        held.then = most_urgent(deadlines)


def most_urgent(deadlines: Iterable[float]) -> float:
    return min(deadlines, default=math.inf)


class StepGate:
    """The node's gate: built by the engine, passed to each worker process it spawns."""

    def __init__(self, ctx: SpawnContext, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._lock = ctx.Lock()
        self._wake = [ctx.Semaphore(0) for _ in range(SLOTS)]
        self._deadlines: Any = ctx.RawArray("d", [math.inf] * SLOTS)
        """Waiting workers' deadlines (time.monotonic(), comparable across processes)."""
        self._holding: Any = ctx.RawArray("b", SLOTS)
        """1 where that worker is running an iteration."""
        self._free = list(range(SLOTS - 1, -1, -1))  # the engine's side only

    def _wake_next(self) -> None:
        """Wake the most urgent waiter (under the lock): it checks `may_step` itself."""
        d = [math.inf if self._holding[slot] else self._deadlines[slot] for slot in range(SLOTS)]
        nxt = min(range(SLOTS), key=d.__getitem__)
        if not math.isinf(d[nxt]):
            self._wake[nxt].release()

    def claim(self) -> int:
        """A slot for a new worker (the engine's side); -1: all taken, it runs ungated."""
        return self._free.pop() if self._free else -1

    def release(self, slot: int) -> None:
        """The worker in `slot` ended: whatever it held or waited for is gone."""
        if slot < 0:
            return
        if self._lock.acquire(timeout=LOCK_S):
            try:
                self._deadlines[slot] = math.inf
                self._holding[slot] = 0
                self._wake_next()
            finally:
                self._lock.release()
        if slot not in self._free:
            self._free.append(slot)

    def enter(self, slot: int, deadline: float) -> bool:
        """Wait until this worker's iteration may run. False: it runs ungated (call no `leave`)."""
        if slot < 0:
            return False
        while True:
            if not self._lock.acquire(timeout=LOCK_S):
                return False
            try:
                self._deadlines[slot] = deadline
                if may_step(slot, self._deadlines, self._holding, self.capacity):
                    self._deadlines[slot] = math.inf
                    self._holding[slot] = 1
                    return True
            finally:
                self._lock.release()
            self._wake[slot].acquire(timeout=WAIT_S)

    def leave(self, slot: int, next_deadline: float = math.inf) -> None:
        """The iteration is over. A batch that goes on stays posted with its next deadline: the
        few hundred microseconds it samples between iterations must not hand its turn to a
        less urgent instance."""
        if slot < 0 or not self._lock.acquire(timeout=LOCK_S):
            return
        try:
            self._holding[slot] = 0
            self._deadlines[slot] = next_deadline
            self._wake_next()
        finally:
            self._lock.release()

    @contextmanager
    def turn(self, slot: int, deadline: float) -> Iterator[Turn]:
        """One iteration under the gate, left posted with `Turn.then` (inf if it raised)."""
        entered = self.enter(slot, deadline)
        turn = Turn()
        failed = True
        try:
            yield turn
            failed = False
        finally:
            if entered:
                self.leave(slot, math.inf if failed else turn.then)

    def idle(self, slot: int) -> None:
        self.leave(slot)  # its batch is over: its posting comes down, the next instance goes
