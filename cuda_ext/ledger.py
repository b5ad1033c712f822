"""The arena's book: which content hash lives at which range, who holds it, what goes when room
is short. No torch and no memory: the process that owns a node's arena keeps it (the engine's
own, which hands workers the memory by CUDA IPC) and answers each load with a `Placement`; the
worker that copies and computes only follows it. A `TensorArena` in one process keeps one too.

What to reuse and what to evict is the node's tensor pool's (`policy.tensor_pool`, the one the
simulator runs: Tangram eq. 2 cost, §3.1-3.3); the ledger carries those decisions out on byte
ranges (`RangeAllocator`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from cuda_ext.allocator import ArenaFull, Block, RangeAllocator, align_up
from policy.eviction import choose_evictions
from policy.tensor_pool import Tensor, TensorPool

RELOAD_BPS = 25e9
"""Bytes per second a reload of an evicted tensor is priced at (eq. 2's s / b_m) where the
caller has measured nothing: about pinned PCIe 4 host-to-device (the H200 measured 55 GB/s:
`bench/results/gpu_coldstart.json`); pass the node's measured bandwidth instead."""


@dataclass(frozen=True)
class Placement:
    """Where one load's tensors go: every digest's offset in the arena, and which of them the
    load copies (new ranges; the others are resident already)."""

    owner: str
    """The load's name in the tensor pool: what `release` takes."""
    offsets: dict[str, int]
    copy: frozenset[str]
    evicted: tuple[str, ...]
    """Idle digests evicted to make room (their ranges may now be part of this load's)."""
    filled: frozenset[str] = frozenset()
    """Digests the arena's owner has already copied in for this load (from the host cache's
    file): the worker reads none of them."""


class ArenaLedger:
    def __init__(
        self,
        capacity_bytes: int,
        alignment: int = 256,
        reload_bps: float = RELOAD_BPS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.allocator = RangeAllocator(capacity_bytes, alignment)
        self.pool = TensorPool(self.allocator.capacity, reload_bps)
        self.blocks: dict[str, Block] = {}
        """Every resident digest's range, in use or idle."""
        self.sizes: dict[str, int] = {}
        """Every resident digest's own bytes (its range is aligned up)."""
        self._clock = clock
        self._loads = itertools.count()

    @property
    def alignment(self) -> int:
        return self.allocator.alignment

    def digests(self) -> frozenset[str]:
        return frozenset(self.blocks)

    def resident_bytes(self) -> int:
        return sum(self.sizes.values())

    def idle(self) -> list[str]:
        """Digests no load holds: what a model scaled to zero left behind."""
        return [d for d in self.blocks if self.pool.residents[d].users == 0]

    def missing_bytes(self, tensors: Iterable[tuple[str, int]]) -> int:
        """Bytes a load of (digest, bytes) pairs would copy: each distinct missing digest once."""
        seen: dict[str, int] = {}
        for digest, nbytes in tensors:
            if digest not in self.blocks:
                seen.setdefault(digest, nbytes)
        return sum(seen.values())

    def place(self, tensors: Sequence[tuple[str, int]], owner: str | None = None) -> Placement:
        """Hold every (digest, bytes) pair for a new load, in access order: a resident digest is
        reused, the rest get ranges (back to back where they fit), idle tensors evicted the
        cheapest first where room is short. All or nothing: on `ArenaFull` no range was taken
        (though what was evicted for it stays evicted; see `Placement.evicted` otherwise)."""
        owner = owner or f"load-{next(self._loads)}"
        sizes: dict[str, int] = {}
        misses: dict[str, int] = {}
        for digest, nbytes in tensors:
            sizes.setdefault(digest, align_up(nbytes, self.alignment))
            if digest not in self.blocks:
                misses.setdefault(digest, nbytes)
        acquired = self.pool.acquire(owner, [Tensor(d, n) for d, n in sizes.items()], self._clock())
        if acquired is None:
            raise ArenaFull(f"{sum(sizes[d] for d in misses)} bytes do not fit beside the tensors in use")
        self._drop(acquired.evicted)
        try:
            blocks = self.allocator.allocate_many(list(misses.values()))
        except ArenaFull:  # the bytes fit, but no range is long enough
            self.pool.abandon(owner, misses)
            raise
        for (digest, nbytes), block in zip(misses.items(), blocks, strict=True):
            self.blocks[digest] = block
            self.sizes[digest] = nbytes
        offsets = {d: self.blocks[d].offset for d in sizes}
        return Placement(owner, offsets, frozenset(misses), acquired.evicted)

    def release(self, owner: str) -> None:
        """The load is gone (scaled to zero, or its worker ended): its tensors stay, idle."""
        self.pool.release(owner, self._clock())

    def holds(self, owner: str) -> bool:
        return owner in self.pool.active

    def evict(self, digest: str) -> None:
        """Free an idle resident's range (refused for one in use)."""
        self.pool.drop(digest)
        self._drop([digest])

    def evict_cheapest(self, nbytes: int, keep: AbstractSet[str] = frozenset()) -> tuple[str, ...]:
        """Evict idle tensors but `keep`, the cheapest first by eq. 2, until they free `nbytes`
        of the memory the arena has taken (for a budget this ledger does not keep: the node's
        memory manager's). () where evicting every such one would not free that much."""
        candidates = [r for d, r in self.pool.residents.items() if d not in keep]
        chosen = choose_evictions(candidates, nbytes, self._clock())
        for digest in chosen:
            self.evict(digest)
        return tuple(chosen)

    def make_room(self, nbytes: int) -> tuple[str, ...]:
        """Evict idle tensors, the cheapest first by eq. 2, until `nbytes` are free."""
        evicted = self.pool.make_room(nbytes, self._clock())
        if evicted is None:
            raise ArenaFull(f"{nbytes} bytes cannot be freed: too little is idle")
        self._drop(evicted)
        return evicted

    def _drop(self, digests: Iterable[str]) -> None:
        for digest in digests:
            self.allocator.free(self.blocks.pop(digest))
            del self.sizes[digest]
