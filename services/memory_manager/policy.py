"""A node's memory budget: who holds how many bytes, and whether one more fits.

Pure: no I/O, no clock. The reservation station of LLM-Mesh §6.3 grows from here.
Owners are names such as `model` or `model:kv`; releasing `model` releases both, `*` all.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Budget:
    budget_bytes: int
    held: dict[str, int] = field(default_factory=dict)

    @property
    def used_bytes(self) -> int:
        return sum(self.held.values())

    def reserve(self, owner: str, nbytes: int) -> bool:
        """Grant if it fits; a second reservation by the same owner replaces the first."""
        if nbytes < 0:
            return False
        others = self.used_bytes - self.held.get(owner, 0)
        if others + nbytes > self.budget_bytes:
            return False
        self.held[owner] = nbytes
        return True

    def release(self, owner: str) -> int:
        """Free everything `owner` holds (and its `owner:*` parts); returns bytes freed."""
        gone = [o for o in self.held if owner == "*" or o == owner or o.startswith(owner + ":")]
        return sum(self.held.pop(o) for o in gone)
