"""A node's reusable tensor pool (Tangram §3.1–3.3).

Tensors are the unit of reuse (§3.1): each has a fingerprint, and a model is the list of its
tensors, so fine-tunes sharing a base share those tensors. When an instance is released its
tensors stay resident (idle) instead of being freed; a later start of any model using them
loads only what is missing. When memory runs short, idle tensors are evicted the cheapest
first by Tangram's eq. 2 cost, with `policy.eviction` (the same rule the engine and loader use
for their tiers). KV cache is allocated on demand as requests need it (§3.3), from the same
memory, and in a pinch reclaims idle tensors the same way.

Contiguity (§3.2.2 stage 2, partitioned-gain packing) is not modelled: this pool counts
bytes, which is what placement and the simulator need. The tensor arena (`cuda_ext.arena`)
keeps one as its policy: it decides what a load reuses and what it evicts, and the arena
owns the addresses.

Pure: a clock passed in; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from policy.eviction import Resident, choose_evictions


@dataclass(frozen=True)
class Tensor:
    fingerprint: str
    nbytes: int


@dataclass(frozen=True)
class Acquired:
    reused_bytes: int
    """Bytes already resident: S' of Tangram eq. 3."""
    loaded_bytes: int
    """Bytes that must be loaded from the host cache or store."""
    evicted: tuple[str, ...]
    """Fingerprints of idle tensors evicted to make room."""


@dataclass
class TensorPool:
    capacity_bytes: int
    bandwidth_bps: float
    """Bytes per second a reload of an evicted tensor would take (for its eviction cost)."""
    residents: dict[str, Resident] = field(default_factory=dict)
    kv: dict[str, int] = field(default_factory=dict)
    active: dict[str, tuple[Tensor, ...]] = field(default_factory=dict)
    """Model instances using the pool now, with their tensors."""
    alpha: dict[str, float] = field(default_factory=dict)
    """Tangram's α_m per fingerprint (latency sensitivity, default 1)."""
    _used: int = 0
    _idle: int = 0

    @property
    def used_bytes(self) -> int:
        """Resident tensors (in use or idle) and KV cache."""
        return self._used

    @property
    def idle_bytes(self) -> int:
        """Resident tensors no instance uses: memory that eviction can give back."""
        return self._idle

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self._used

    def available_bytes(self) -> int:
        """Free memory plus what evicting every idle tensor would free."""
        return self.free_bytes + self._idle

    def reusable_bytes(self, tensors: Iterable[Tensor]) -> int:
        return sum(t.nbytes for t in tensors if t.fingerprint in self.residents)

    def _make_room(self, need: int, now: float, keep: frozenset[str]) -> tuple[str, ...] | None:
        short = need - self.free_bytes
        if short <= 0:
            return ()
        cands = [r for k, r in self.residents.items() if k not in keep]
        chosen = choose_evictions(cands, short, now)
        if not chosen:
            return None
        for k in chosen:
            r = self.residents.pop(k)
            self._used -= r.nbytes
            self._idle -= r.nbytes
        return tuple(chosen)

    def acquire(self, model: str, tensors: Sequence[Tensor], now: float, alpha: float = 1.0) -> Acquired | None:
        """Make `model`'s tensors resident and in use, evicting idle ones if needed.

        None when the missing tensors cannot fit even after evicting every idle tensor; the
        pool is then unchanged. A model acquired twice (two instances) is counted once.
        """
        if model in self.active:
            return Acquired(sum(t.nbytes for t in tensors), 0, ())
        fps = frozenset(t.fingerprint for t in tensors)
        missing = [t for t in tensors if t.fingerprint not in self.residents]
        evicted = self._make_room(sum(t.nbytes for t in missing), now, fps)
        if evicted is None:
            return None
        reused = 0
        for t in tensors:
            r = self.residents.get(t.fingerprint)
            if r is None:
                r = Resident(
                    t.fingerprint, t.nbytes, t.nbytes / self.bandwidth_bps, now, now, uses=1, users=0, alpha=alpha
                )
                self.residents[t.fingerprint] = r
                self._used += t.nbytes
            else:
                reused += t.nbytes
                r.uses += 1
                r.last_used = now
                if r.users == 0:
                    self._idle -= r.nbytes
            r.users += 1
        self.active[model] = tuple(tensors)
        return Acquired(reused, sum(t.nbytes for t in missing), evicted)

    def release(self, model: str, now: float) -> None:
        """The model's instance is gone; its tensors stay resident, idle once nobody uses them."""
        for t in self.active.pop(model, ()):
            r = self.residents.get(t.fingerprint)
            if r is None:
                continue
            r.users -= 1
            r.last_used = now
            if r.users == 0:
                self._idle += r.nbytes

    def grow_kv(self, owner: str, nbytes: int, now: float) -> tuple[str, ...] | None:
        """Allocate `nbytes` more KV cache to `owner` on demand (§3.3); evicts idle tensors
        if memory is short. Returns what was evicted, or None (nothing changed) if it
        cannot fit."""
        evicted = self._make_room(nbytes, now, frozenset())
        if evicted is None:
            return None
        self.kv[owner] = self.kv.get(owner, 0) + nbytes
        self._used += nbytes
        return evicted

    def shrink_kv(self, owner: str, nbytes: int) -> None:
        have = self.kv.get(owner, 0)
        nbytes = min(nbytes, have)
        self._used -= nbytes
        if have - nbytes:
            self.kv[owner] = have - nbytes
        else:
            self.kv.pop(owner, None)

    def abandon(self, model: str, fingerprints: Iterable[str]) -> None:
        """Undo `acquire` for a model whose load failed after it (its memory could not be laid
        out, say): it is not active, and `fingerprints`, never loaded, are not resident. What
        the acquire evicted stays evicted: the caller has freed it."""
        never = set(fingerprints)
        for t in self.active.pop(model, ()):
            r = self.residents.get(t.fingerprint)
            if r is None:
                continue
            r.users -= 1
            if t.fingerprint in never:
                del self.residents[t.fingerprint]
                self._used -= r.nbytes
            elif r.users == 0:
                self._idle += r.nbytes

    def drop(self, fingerprint: str) -> None:
        """Evict one idle tensor the caller chose (an operator's eviction, say)."""
        r = self.residents[fingerprint]
        if r.users:
            raise ValueError(f"{fingerprint} is in use by {r.users} models")
        del self.residents[fingerprint]
        self._used -= r.nbytes
        self._idle -= r.nbytes

    def make_room(self, nbytes: int, now: float) -> tuple[str, ...] | None:
        """Evict idle tensors until `nbytes` are free (for memory this pool does not account,
        e.g. a process's own overhead); None if impossible."""
        return self._make_room(nbytes, now, frozenset())
