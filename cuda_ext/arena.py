"""The tensor arena: one allocation per device, sub-allocated into typed tensor views (Tangram §4).

An engine process makes one `TensorArena` per device at start-up (a pre-warmed worker makes it
before any model is bound, TIDAL §5). Weights are loaded into it by content: every tensor has a
digest (`cuda_ext.digest`), a digest already resident is not copied again, and what is missing
is copied in one batched transfer (`cuda_ext.copies`). A model scaled to zero releases its
tensors; they stay resident, idle, until the caller evicts them (by Tangram's eq. 2 cost, which
is policy's business, not the arena's), so starting it or any model sharing its tensors again
copies only the rest (§3.1). Without CUDA the arena is host memory and copies are plain copies:
the same API, so the engine and its tests run anywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from cuda_ext.allocator import ArenaFull, Block, RangeAllocator
from cuda_ext.copies import CopyEngine, Span, byte_view
from cuda_ext.host import HostImage, TensorSpec

# 256 bytes: what cudaMalloc guarantees, and a multiple of every dtype's size and of the 16-byte
# alignment that vectorized kernels want.
ALIGNMENT = 256


def default_device() -> torch.device:
    """The first CUDA device where one is present, else the host."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class Resident:
    """A digest's range in the arena and how many loads hold it now (0: idle, evictable)."""

    digest: str
    block: Block
    nbytes: int
    refs: int = 0
    pending: list[torch.cuda.Event] = field(default_factory=list)
    """Events of the copy that fills it, for a load that reuses it while it is still copying."""


@dataclass
class Loaded:
    """A model's tensors bound to the arena, as views; hold it while the model is in use."""

    tensors: dict[str, torch.Tensor]
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
    ) -> None:
        self.device = torch.device(device) if device is not None else default_device()
        self._allocator = RangeAllocator(capacity_bytes, alignment)
        self.storage = torch.empty(self._allocator.capacity, dtype=torch.uint8, device=self.device)
        self._copier = CopyEngine(self.device, streams)
        self._residents: dict[str, Resident] = {}

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

    def allocate(self, nbytes: int) -> Block:
        return self._allocator.allocate(nbytes)

    def free(self, block: Block) -> None:
        self._allocator.free(block)

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

    def resident_bytes(self) -> int:
        return sum(r.nbytes for r in self._residents.values())

    def idle(self) -> list[Resident]:
        """Residents no load holds: what a model scaled to zero left behind."""
        return [r for r in self._residents.values() if r.refs == 0]

    def evict(self, digest: str) -> None:
        """Free an idle resident's range."""
        resident = self._residents[digest]
        if resident.refs:
            raise ValueError(f"{digest[:12]} is held by {resident.refs} loads")
        for event in resident.pending:
            event.synchronize()
        del self._residents[digest]
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
        is allocated (back to back where it fits) and copied from `source`. All or nothing: on
        `ArenaFull` nothing was allocated."""
        misses: dict[str, TensorSpec] = {}
        for group in groups:
            for spec in group:
                if spec.digest not in self._residents:
                    misses.setdefault(spec.digest, spec)
        blocks = self._allocator.allocate_many([s.nbytes for s in misses.values()])
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

        digests = tuple(dict.fromkeys(s.digest for group in groups for s in group))
        for digest in digests:
            self._residents[digest].refs += 1
        reused = sum(self._residents[d].nbytes for d in digests if d not in new)
        return Loaded(tensors, digests, reused, transfer.nbytes, transfer.transfers, waits)

    def release(self, loaded: Loaded) -> None:
        """The model is gone (scaled to zero): its tensors stay resident, idle, until evicted."""
        if loaded.released:
            raise ValueError("released twice")
        loaded.released = True
        for digest in loaded.digests:
            self._residents[digest].refs -= 1


__all__ = ["ArenaFull", "Block", "Loaded", "Resident", "TensorArena", "default_device"]
