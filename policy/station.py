"""The reservation station for a node's memory operations (LLM-Mesh §6.3, after Tomasulo).

Loads, unloads and KV-cache resizes take time, and several run on a node at once. Each is an
instruction with a read set and a write set over named memory regions (`model`,
`model:kv`, …) and a size change. Two budgets keep them safe:

- Optimistic: on issue, the budget already counts every accepted operation at its target
  size. A scale-down lowers it at once; a scale-up is refused if it would not fit. This is
  what the scheduler asks ("would this KV growth fit?") and it never over-commits.
- Pessimistic: what could be physically held right now. A shrinking region counts at its old
  size until the shrink completes; a growing one at its new size from the moment it starts.
  A scale-up starts only if this stays within the budget; otherwise it waits here until a
  scale-down completes (the hazard: a grow right after a shrink would OOM if both ran).

Data hazards are those of Tomasulo: an instruction waits for every earlier one that writes
what it reads or writes, or reads what it writes (RAW, WAW, WAR). Independent instructions
start out of order, so a KV grow of one model is not held up by a load waiting for memory;
but a grow passes an earlier waiting grow only if both fit, so the earlier one cannot starve.

Pure: no clock, no I/O; the caller starts what `dispatch` returns and reports `complete`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class OpKind(StrEnum):
    LOAD = "load"
    UNLOAD = "unload"
    RESIZE = "resize"


@dataclass(frozen=True)
class MemOp:
    """One memory instruction: region `region` goes from `old_bytes` to `new_bytes`."""

    op_id: int
    kind: OpKind
    region: str
    old_bytes: int
    new_bytes: int
    reads: frozenset[str] = frozenset()
    """Regions it needs intact while it runs (a KV resize reads its model's weights)."""

    @property
    def writes(self) -> frozenset[str]:
        return frozenset((self.region,))

    @property
    def delta(self) -> int:
        return self.new_bytes - self.old_bytes

    def conflicts(self, other: MemOp) -> bool:
        """RAW, WAR or WAW on any region: the two may not run at the same time."""
        return bool(self.writes & (other.writes | other.reads) or other.writes & self.reads)


def load(op_id: int, model: str, nbytes: int) -> MemOp:
    return MemOp(op_id, OpKind.LOAD, model, 0, nbytes)


def unload(op_id: int, model: str, nbytes: int) -> MemOp:
    return MemOp(op_id, OpKind.UNLOAD, model, nbytes, 0)


def resize_kv(op_id: int, model: str, old_bytes: int, new_bytes: int) -> MemOp:
    return MemOp(op_id, OpKind.RESIZE, f"{model}:kv", old_bytes, new_bytes, reads=frozenset((model,)))


class Refused(StrEnum):
    OVER_BUDGET = "over_budget"
    STALE_SIZE = "stale_size"
    """old_bytes is not the region's size after the operations already accepted."""


@dataclass
class Station:
    budget_bytes: int
    target: dict[str, int] = field(default_factory=dict)
    """Each region's size once every accepted operation completes (the optimistic view)."""
    physical: dict[str, int] = field(default_factory=dict)
    """Each region's size as completed operations left it."""
    waiting: list[MemOp] = field(default_factory=list)
    """Accepted, not started; in issue order."""
    running: dict[int, MemOp] = field(default_factory=dict)

    @property
    def optimistic_bytes(self) -> int:
        return sum(self.target.values())

    @property
    def pessimistic_bytes(self) -> int:
        """Bytes that could be held now: completed sizes, plus running grows at full size."""
        total = sum(self.physical.values())
        for op in self.running.values():
            if op.delta > 0:
                total += op.delta
        return total

    def size(self, region: str) -> int:
        return self.target.get(region, 0)

    def issue(self, op: MemOp) -> Refused | None:
        """Accept `op` into the station (None) or refuse it. Accepting commits the budget."""
        if self.target.get(op.region, 0) != op.old_bytes:
            return Refused.STALE_SIZE
        if op.delta > 0 and self.optimistic_bytes + op.delta > self.budget_bytes:
            return Refused.OVER_BUDGET
        self.target[op.region] = op.new_bytes
        if op.new_bytes == 0:
            self.target.pop(op.region)
        self.waiting.append(op)
        return None

    def dispatch(self) -> list[MemOp]:
        """The accepted operations that may start now; they move to running."""
        started: list[MemOp] = []
        pess = self.pessimistic_bytes
        blocked: list[MemOp] = []  # earlier ops still waiting: a conflicting later one waits too
        reserved = 0  # growth of earlier waiting ops: a later grow may pass them only beside it,
        # or it could take the memory they wait for and starve them
        still: list[MemOp] = []
        for op in self.waiting:
            hazard = any(op.conflicts(r) for r in self.running.values()) or any(op.conflicts(b) for b in blocked)
            fits = op.delta <= 0 or pess + reserved + op.delta <= self.budget_bytes
            if hazard or not fits:
                blocked.append(op)
                still.append(op)
                reserved += max(op.delta, 0)
                continue
            self.running[op.op_id] = op
            if op.delta > 0:
                pess += op.delta
            started.append(op)
        self.waiting = still
        return started

    def complete(self, op_id: int) -> MemOp:
        """The operation finished: its region now physically has its new size."""
        op = self.running.pop(op_id)
        if op.new_bytes:
            self.physical[op.region] = op.new_bytes
        else:
            self.physical.pop(op.region, None)
        return op

    def idle(self) -> bool:
        return not self.waiting and not self.running
