"""The tensor arena: one allocation per device, sub-allocated into typed tensor views (Tangram §4).

An engine process makes one `TensorArena` per device at start-up (a pre-warmed worker makes it
before any model is bound, TIDAL §5). Weights are loaded into it by content: every tensor has a
digest (`cuda_ext.digest`), a digest already resident is not copied again, and what is missing
is copied in one batched transfer (`cuda_ext.copies`). A model scaled to zero releases its
tensors; they stay resident, idle, so starting it or any model sharing its tensors again copies
only the rest (§3.1). What to reuse and what to evict is policy's, not the arena's: the node's
tensor pool (`policy.tensor_pool`, the one the simulator runs) decides it, and when a load or a
KV range needs room it evicts idle tensors the cheapest first by Tangram's eq. 2 cost (§3.2.2,
§3.3: KV allocated on demand, from the same memory). The arena carries those decisions out on
addresses. Without CUDA the arena is host memory and copies are plain copies: the same API, so
the engine and its tests run anywhere.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from cuda_ext.allocator import ArenaFull, Block, RangeAllocator, align_up
from cuda_ext.copies import CopyEngine, Span, byte_view
from cuda_ext.host import HostImage, TensorSpec
from policy.tensor_pool import Tensor, TensorPool

# 256 bytes: what cudaMalloc guarantees, and a multiple of every dtype's size and of the 16-byte
# alignment that vectorized kernels want.
ALIGNMENT = 256
RELOAD_BPS = 25e9
"""Bytes per second a reload of an evicted tensor is priced at (eq. 2's s / b_m) where the
caller has measured nothing: about pinned PCIe 4 host-to-device (the H200 measured 55 GB/s:
`bench/results/gpu_coldstart.json`); pass the node's measured bandwidth instead."""


def default_device() -> torch.device:
    """The first CUDA device where one is present, else the host."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class Resident:
    """A digest's range in the arena (who holds it, and since when, is the pool's)."""

    digest: str
    block: Block
    nbytes: int
    pending: list[torch.cuda.Event] = field(default_factory=list)
    """Events of the copy that fills it, for a load that reuses it while it is still copying."""


@dataclass
class Loaded:
    """A model's tensors bound to the arena, as views; hold it while the model is in use."""

    tensors: dict[str, torch.Tensor]
    owner: str
    """Its name in the arena's tensor pool."""
    digests: tuple[str, ...]
    """The distinct digests this load holds a reference on."""
    reused_bytes: int
    """Bytes found resident (S' of Tangram eq. 3): not copied."""
    copied_bytes: int
    transfers: int
    """Copies issued for `copied_bytes`, after coalescing and chunking."""
    waits: list[list[torch.cuda.Event]]
    """Per group, the events to wait on before its tensors are read (empty on the host)."""
    released: bool = False

    def wait(self, group: int) -> None:
        """Make the current CUDA stream wait, on the device, until `group`'s tensors are in."""
        for event in self.waits[group]:
            torch.cuda.current_stream().wait_event(event)

    def synchronize(self) -> None:
        """Block until every tensor is in."""
        for group in self.waits:
            for event in group:
                event.synchronize()


class TensorArena:
    """One allocation of `capacity_bytes` on `device` (default: CUDA where present, else host)."""

    def __init__(
        self,
        capacity_bytes: int,
        device: torch.device | str | None = None,
        alignment: int = ALIGNMENT,
        streams: int = 4,
        reload_bps: float = RELOAD_BPS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.device = torch.device(device) if device is not None else default_device()
        self._allocator = RangeAllocator(capacity_bytes, alignment)
        self.storage = torch.empty(self._allocator.capacity, dtype=torch.uint8, device=self.device)
        self._copier = CopyEngine(self.device, streams)
        self._residents: dict[str, Resident] = {}
        self.pool = TensorPool(self._allocator.capacity, reload_bps)
        """The policy: who holds which tensor, and what goes when room is needed."""
        self._clock = clock
        self._loads = itertools.count()

    @property
    def capacity_bytes(self) -> int:
        return self._allocator.capacity

    @property
    def used_bytes(self) -> int:
        return self._allocator.used_bytes

    @property
    def free_bytes(self) -> int:
        return self._allocator.free_bytes

    @property
    def alignment(self) -> int:
        return self._allocator.alignment

    # Raw ranges: KV cache blocks and scratch, outside the content index.

    def allocate(self, nbytes: int, owner: str = "kv") -> Block:
        """A raw range for `owner` (a KV cache: allocated on demand, §3.3), idle tensors evicted
        by cost to make room for it."""
        size = align_up(nbytes, self.alignment)
        evicted = self.pool.grow_kv(owner, size, self._clock())
        if evicted is None:
            raise ArenaFull(f"{nbytes} bytes do not fit beside the tensors in use")
        self._drop(evicted)
        try:
            return self._allocator.allocate(nbytes)
        except ArenaFull:
            self.pool.shrink_kv(owner, size)
            raise

    def free(self, block: Block, owner: str = "kv") -> None:
        self._allocator.free(block)
        self.pool.shrink_kv(owner, block.nbytes)

    def view(self, block: Block, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        """A typed tensor over the start of `block` (the arena's memory: no copy)."""
        n = dtype.itemsize
        for d in shape:
            n *= d
        if n > block.nbytes:
            raise ValueError(f"{n} bytes of {dtype}{tuple(shape)} do not fit {block}")
        return self.storage[block.offset : block.offset + n].view(dtype).view(tuple(shape))

    # Content-addressed weights.

    def resident(self, digest: str) -> Resident | None:
        return self._residents.get(digest)

    def digests(self) -> frozenset[str]:
        """Every tensor resident (in use or idle), by content hash."""
        return frozenset(self._residents)

    def resident_bytes(self) -> int:
        return sum(r.nbytes for r in self._residents.values())

    def idle(self) -> list[Resident]:
        """Residents no load holds: what a model scaled to zero left behind."""
        return [r for d, r in self._residents.items() if self.pool.residents[d].users == 0]

    def evict(self, digest: str) -> None:
        """Free an idle resident's range (the caller's choice; loads evict by cost themselves)."""
        self.pool.drop(digest)  # refuses one in use
        self._drop([digest])

    def make_room(self, nbytes: int) -> tuple[str, ...]:
        """Evict idle tensors, the cheapest first by eq. 2, until `nbytes` are free (for memory
        the arena does not hand out: a worker's own); raises ArenaFull where evicting every
        idle one would not do."""
        evicted = self.pool.make_room(nbytes, self._clock())
        if evicted is None:
            raise ArenaFull(f"{nbytes} bytes cannot be freed: too little is idle")
        self._drop(evicted)
        return evicted

    def _drop(self, digests: Iterable[str]) -> None:
        """Free the ranges of residents the pool no longer holds."""
        for digest in digests:
            resident = self._residents.pop(digest)
            for event in resident.pending:
                event.synchronize()
            self._allocator.free(resident.block)

    def missing_bytes(self, specs: Iterable[TensorSpec]) -> int:
        """Bytes a load of `specs` would copy (each distinct digest that is not resident, once)."""
        seen: dict[str, int] = {}
        for spec in specs:
            if spec.digest not in self._residents:
                seen.setdefault(spec.digest, spec.nbytes)
        return sum(seen.values())

    def load(
        self,
        groups: Sequence[Sequence[TensorSpec]],
        source: HostImage | Mapping[str, torch.Tensor],
    ) -> Loaded:
        """Bind every spec, group by group in access order: a resident digest is reused, the rest
        is allocated (back to back where it fits) and copied from `source`; where room is short
        the pool evicts idle tensors, the cheapest first (eq. 2). All or nothing: on `ArenaFull`
        nothing was allocated (though what was evicted for it stays evicted)."""
        owner = f"load-{next(self._loads)}"
        sizes: dict[str, int] = {}
        misses: dict[str, TensorSpec] = {}
        for group in groups:
            for spec in group:
                sizes.setdefault(spec.digest, align_up(spec.nbytes, self.alignment))
                if spec.digest not in self._residents:
                    misses.setdefault(spec.digest, spec)
        acquired = self.pool.acquire(owner, [Tensor(d, n) for d, n in sizes.items()], self._clock())
        if acquired is None:
            raise ArenaFull(f"{sum(sizes[d] for d in misses)} bytes do not fit beside the tensors in use")
        self._drop(acquired.evicted)
        try:
            blocks = self._allocator.allocate_many([s.nbytes for s in misses.values()])
        except ArenaFull:  # the bytes fit, but no range is long enough
            self.pool.abandon(owner, misses)
            raise
        new = {d: Resident(d, b, s.nbytes) for (d, s), b in zip(misses.items(), blocks, strict=True)}
        self._residents.update(new)

        spans: list[list[Span]] = []
        for group in groups:
            group_spans: list[Span] = []
            for spec in group:
                resident = new.get(spec.digest)
                if resident is not None and misses[spec.digest] is spec:
                    block = resident.block
                    if isinstance(source, HostImage) and source.alignment == self.alignment:
                        # Whole slots, padding included, so that back-to-back tensors coalesce.
                        src = source.slot(spec.name)
                        dst = self.storage[block.offset : block.end]
                    else:
                        src = (
                            source.bytes_of(spec.name)
                            if isinstance(source, HostImage)
                            else byte_view(source[spec.name])
                        )
                        dst = self.storage[block.offset : block.offset + spec.nbytes]
                    group_spans.append(Span(src, dst))
            spans.append(group_spans)
        transfer = self._copier.copy(spans)

        waits: list[list[torch.cuda.Event]] = []
        tensors: dict[str, torch.Tensor] = {}
        for g, group in enumerate(groups):
            group_waits = list(transfer.events[g])
            for spec in group:
                resident = self._residents[spec.digest]
                if spec.digest in new:
                    if misses[spec.digest] is spec:
                        resident.pending = list(transfer.events[g])
                elif resident.pending:
                    group_waits.extend(resident.pending)
                tensors[spec.name] = self.view(resident.block, spec.dtype, spec.shape)
            waits.append(group_waits)

        digests = tuple(sizes)
        reused = sum(self._residents[d].nbytes for d in digests if d not in new)
        return Loaded(tensors, owner, digests, reused, transfer.nbytes, transfer.transfers, waits)

    def release(self, loaded: Loaded) -> None:
        """The model is gone (scaled to zero): its tensors stay resident, idle, until evicted."""
        if loaded.released:
            raise ValueError("released twice")
        loaded.released = True
        self.pool.release(loaded.owner, self._clock())


__all__ = ["ArenaFull", "Block", "Loaded", "Resident", "TensorArena", "default_device"]
