"""Token-level interleaving of a node's instances by headroom (LLM-Mesh §5.1).

Each instance runs in its own worker process; left to the OS, instances sharing a node's cores
decode side by side and each is slowed by the others however urgent its requests are. The
gate makes the node run one iteration (a prefill, or one decode step of a batch) at a time
per `capacity` (the node's cores over the threads an instance uses), and when several
instances want the next one it goes to the one holding the most urgent request: the least
headroom, eq. 1 (`policy/headroom.py`). At a common moment, least headroom is
earliest deadline, ST + TTFT_SLO + TPOT_SLO · O, so a worker posts that deadline and the
earliest goes first.

The state is shared memory (two arrays under a lock, and a semaphore per worker to wake it)
created by the engine and handed to its workers when they are spawned. A worker claims a
slot; the engine frees the slot of a worker that ends, so a worker that dies mid-iteration
cannot block the node. The lock is only ever taken with a timeout: a process killed while
holding it would otherwise stop every other instance on the node; past the timeout a worker
runs ungated instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from multiprocessing.context import SpawnContext
from typing import Any, Protocol

SLOTS = 64
"""Workers a node's gate can hold (bound and pre-warmed); one without a slot runs ungated."""
WAIT_S = 0.05
"""Longest wait before a waiting worker looks again by itself (it is woken when its turn may
have come; this bounds any missed wake-up)."""
LOCK_S = 1.0
"""The lock guards a few array writes; not having it within this long means its holder died."""


def may_step(slot: int, deadlines: Sequence[float], holding: Sequence[int], capacity: int) -> bool:
    """Whether `slot`, waiting with deadline `deadlines[slot]`, runs its iteration now: fewer
    than `capacity` iterations are running and no other waiting worker is more urgent (ties
    go to the lower slot, so the choice is deterministic)."""
    if sum(holding) >= capacity:
        return False
    mine = deadlines[slot]
    for other, d in enumerate(deadlines):
        if other != slot and (d < mine or (d == mine and other < slot and not math.isinf(d))):
            return False
    return True


@dataclass
class Turn:
    """One iteration's turn at the gate (`StepGate.turn`)."""

    waited: float = 0.0
    """Seconds it waited for the turn."""
    then: float = math.inf
    """The deadline of the worker's next iteration, posted as it leaves (set it before the
    turn ends: a batch that goes on keeps its place, `leave`); inf: none."""


# --- a batch's side: the turns it takes around its forward passes ------------------------------


class Held(Protocol):
    """What a turn yields (a `Turn` at the node's gate): `then`, set before the turn ends, is the
    deadline of the batch's next pass, posted as it leaves so that the batch keeps its place
    between passes (inf: it has none)."""

    then: float


TakeTurn = Callable[[float], AbstractContextManager["Held | None"]]
"""take_turn(deadline): held around every forward pass of a batch (the node's step gate, entered
with the most urgent request's next-token deadline); tests pass `no_turn`."""


def no_turn(deadline: float) -> AbstractContextManager[None]:
    return nullcontext()


class Turns:
    """A batch's turns, and the seconds it spent waiting to enter them (`Batch.waited`).
    Itself a `TakeTurn`, so that batches inside another share its count."""

    def __init__(self, turn: TakeTurn) -> None:
        self._turn = turn
        self.waited = 0.0

    @contextmanager
    def __call__(self, deadline: float) -> Iterator[Held | None]:
        t0 = time.monotonic()
        with self._turn(deadline) as held:
            self.waited += time.monotonic() - t0
            yield held


def post(held: Held | None, deadlines: Iterable[float]) -> None:
    """End a turn posted with the most urgent of the deadlines of the batch's next pass."""
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
        """Waiting workers' deadlines (time.monotonic(), comparable across processes); inf: not waiting."""
        self._holding: Any = ctx.RawArray("b", SLOTS)
        """1 where that worker is running an iteration."""
        self._free = list(range(SLOTS - 1, -1, -1))  # the engine's side only

    def _wake_next(self) -> None:
        """Wake the most urgent waiter (under the lock): it checks `may_step` itself."""
        d = list(self._deadlines)
        for slot in range(SLOTS):
            if self._holding[slot]:
                d[slot] = math.inf  # posted for its next iteration while running this one
        nxt = min(range(SLOTS), key=d.__getitem__)
        if not math.isinf(d[nxt]):
            self._wake[nxt].release()

    # --- the engine's side ------------------------------------------------------------------

    def claim(self) -> int:
        """A slot for a new worker; -1 when all are taken (that worker runs ungated)."""
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

    # --- a worker's side --------------------------------------------------------------------

    def enter(self, slot: int, deadline: float) -> bool:
        """Wait until this worker's iteration may run (see `may_step`). False: it runs
        ungated (no slot, or the lock could not be had: call no `leave` then)."""
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
        """The iteration is over. A worker whose batch goes on stays posted with the deadline
        of its next iteration (`next_deadline`): the few hundred microseconds it spends
        sampling between iterations must not hand its turn to a less urgent instance."""
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
        """One iteration under the gate: waits for the turn (`enter`), leaves it as the block
        ends, posted with `Turn.then` (an iteration that raised posts nothing: inf)."""
        t0 = time.monotonic()
        entered = self.enter(slot, deadline)
        turn = Turn(waited=time.monotonic() - t0)
        failed = True
        try:
            yield turn
            failed = False
        finally:
            if entered:
                self.leave(slot, math.inf if failed else turn.then)

    def idle(self, slot: int) -> None:
        """This worker's batch is over: take its posting down, so the next instance goes."""
        self.leave(slot)
