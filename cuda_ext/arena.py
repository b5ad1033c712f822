"""The tensor arena: one allocation per device, sub-allocated into typed tensor views (Tangram §4).

A node keeps one arena per device: the process that owns it (the engine's) holds the memory and
its book (`cuda_ext.ledger`) and hands the memory to each engine worker (`share` / `attach`: CUDA
IPC, or a shared mapping on the host), so weights outlive the worker that loaded them. An arena
made in one process for itself (the benchmark's, a test's) keeps its book too. Weights are loaded
into it by content: every tensor has a digest (`cuda_ext.digest`), a digest already resident is
not copied again, and what is missing is copied in one batched transfer (`cuda_ext.copies`). A
model scaled to zero releases its tensors; they stay resident, idle, so starting it or any model
sharing its tensors again copies only the rest (§3.1). What to reuse and what to evict is
policy's, not the arena's: the node's tensor pool (`policy.tensor_pool`, the one the simulator
runs) decides it, and when a load needs room it evicts idle tensors the cheapest first by
Tangram's eq. 2 cost (§3.2.2). The KV cache is not in the arena: the torch engine's is the paged
cache of transformers' continuous batching (§3.3's on-demand KV from the pool would need an
attention kernel over the pool's addresses; the simulator's nodes model it). The arena carries
those decisions out on addresses. Without CUDA the arena is host memory and copies are plain
copies: the same API, so the engine and its tests run anywhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from cuda_ext.allocator import ArenaFull, Block, align_up
from cuda_ext.copies import CopyEngine, Event, Span, byte_view
from cuda_ext.host import HostImage, TensorSpec
from cuda_ext.ledger import RELOAD_BPS, ArenaLedger, Placement
from cuda_ext.memory import ArenaHandle, SharedMemory, attach
from policy.tensor_pool import TensorPool

# 256 bytes: what cudaMalloc guarantees, and a multiple of every dtype's size and of the 16-byte
# alignment that vectorized kernels want.
ALIGNMENT = 256


def default_device() -> torch.device:
    """The first CUDA device where one is present, else the host."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@dataclass
class Resident:
    """A digest's range in the arena (who holds it, and since when, is the pool's)."""

    digest: str
    block: Block
    nbytes: int
    pending: list[Event] = field(default_factory=list)
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
    waits: list[list[Event]]
    """Per group, the events to wait on before its tensors are read (empty on the host)."""
    released: bool = False

    def wait(self, group: int) -> None:
        """Make the current CUDA stream wait, on the device, until `group`'s tensors are in."""
        for event in self.waits[group]:
            event.wait(torch.cuda.current_stream())

    def synchronize(self) -> None:
        """Block until every tensor is in."""
        for group in self.waits:
            for event in group:
                event.synchronize()


class TensorArena:
    """One allocation of `capacity_bytes` on `device` (default: CUDA where present, else host);
    `shared` makes it one that other processes can `attach` (`share()` gives the handle)."""

    def __init__(
        self,
        capacity_bytes: int,
        device: torch.device | str | None = None,
        alignment: int = ALIGNMENT,
        streams: int = 4,
        reload_bps: float = RELOAD_BPS,
        clock: Callable[[], float] = time.monotonic,
        shared: bool = False,
    ) -> None:
        device = torch.device(device) if device is not None else default_device()
        ledger = ArenaLedger(capacity_bytes, alignment, reload_bps, clock)
        capacity = ledger.allocator.capacity
        memory = SharedMemory(capacity, _name(device)) if shared else None
        storage = memory.view() if memory else torch.empty(capacity, dtype=torch.uint8, device=device)
        self._setup(device, ledger, memory, storage, alignment, streams)

    @classmethod
    def attach(cls, handle: ArenaHandle, alignment: int = ALIGNMENT, streams: int = 4) -> TensorArena:
        """The arena another process owns (`share()`), mapped here. Its loads take the owner's
        `Placement`; what is resident, and eviction, are the owner's."""
        arena = cls.__new__(cls)
        arena._setup(torch.device(handle.device), None, None, attach(handle), alignment, streams)
        return arena

    def _setup(
        self,
        device: torch.device,
        ledger: ArenaLedger | None,
        memory: SharedMemory | None,
        storage: torch.Tensor,
        alignment: int,
        streams: int,
    ) -> None:
        self.device = device
        self.ledger = ledger
        """The book of what is where; None in a worker attached to another process's arena,
        whose loads come with their placement."""
        self.memory = memory
        self.storage = storage
        self.alignment = alignment
        self.capacity_bytes = storage.numel()
        self._copier = CopyEngine(device, streams)
        self._pending: dict[str, list[Event]] = {}
        """Events of the copy that fills a digest this process copied, for a load that reuses
        it while it is still copying."""

    def share(self) -> ArenaHandle:
        if self.memory is None:
            raise ValueError("not a shared arena: make it with shared=True")
        return self.memory.handle

    def _book(self) -> ArenaLedger:
        if self.ledger is None:
            raise ValueError("an attached arena's book is its owner's: pass the owner's placement")
        return self.ledger

    @property
    def pool(self) -> TensorPool:
        return self._book().pool

    @property
    def used_bytes(self) -> int:
        return self._book().allocator.used_bytes

    @property
    def free_bytes(self) -> int:
        return self._book().allocator.free_bytes

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
        book = self._book()
        block = book.blocks.get(digest)
        if block is None:
            return None
        return Resident(digest, block, book.sizes[digest], self._pending.get(digest, []))

    def digests(self) -> frozenset[str]:
        """Every tensor resident (in use or idle), by content hash."""
        return self._book().digests()

    def resident_bytes(self) -> int:
        return self._book().resident_bytes()

    def idle(self) -> list[Resident]:
        """Residents no load holds: what a model scaled to zero left behind."""
        return [r for d in self._book().idle() if (r := self.resident(d)) is not None]

    def evict(self, digest: str) -> None:
        """Free an idle resident's range (the caller's choice; loads evict by cost themselves)."""
        self._book().evict(digest)
        self._settle([digest])

    def make_room(self, nbytes: int) -> tuple[str, ...]:
        """Evict idle tensors, the cheapest first by eq. 2, until `nbytes` are free (for memory
        the arena does not hand out: a worker's own); raises ArenaFull where evicting every
        idle one would not do."""
        evicted = self._book().make_room(nbytes)
        self._settle(evicted)
        return evicted

    def _settle(self, digests: Iterable[str]) -> None:
        """Ranges about to be reused: wait for copies still filling them."""
        for digest in digests:
            for event in self._pending.pop(digest, []):
                event.synchronize()

    def missing_bytes(self, specs: Iterable[TensorSpec]) -> int:
        """Bytes a load of `specs` would copy (each distinct digest that is not resident, once)."""
        return self._book().missing_bytes((s.digest, s.nbytes) for s in specs)

    def place(self, groups: Sequence[Sequence[TensorSpec]]) -> Placement:
        """Hold ranges for a load of `groups` (see `ArenaLedger.place`)."""
        return self._book().place([(s.digest, s.nbytes) for group in groups for s in group])

    def load(
        self,
        groups: Sequence[Sequence[TensorSpec]],
        source: HostImage | Mapping[str, torch.Tensor],
        placement: Placement | None = None,
    ) -> Loaded:
        """Bind every spec, group by group in access order: a resident digest is reused, the rest
        is allocated (back to back where it fits) and copied from `source`; where room is short
        the pool evicts idle tensors, the cheapest first (eq. 2). All or nothing: on `ArenaFull`
        nothing was allocated (though what was evicted for it stays evicted). An attached arena
        takes its owner's `placement` (which `source` needs to hold only the copied digests of)."""
        if placement is None:
            placement = self.place(groups)
        self._settle(placement.evicted)
        copied: set[str] = set()
        spans: list[list[Span]] = []
        for group in groups:
            group_spans: list[Span] = []
            for spec in group:
                if spec.digest not in placement.copy or spec.digest in copied:
                    continue
                copied.add(spec.digest)
                offset = placement.offsets[spec.digest]
                if isinstance(source, HostImage) and source.alignment == self.alignment:
                    # Whole slots, padding included, so that back-to-back tensors coalesce.
                    src = source.slot(spec.name)
                    dst = self.storage[offset : offset + align_up(spec.nbytes, self.alignment)]
                else:
                    src = source.bytes_of(spec.name) if isinstance(source, HostImage) else byte_view(source[spec.name])
                    dst = self.storage[offset : offset + spec.nbytes]
                group_spans.append(Span(src, dst))
            spans.append(group_spans)
        transfer = self._copier.copy(spans)

        waits: list[list[Event]] = []
        tensors: dict[str, torch.Tensor] = {}
        filled: set[str] = set()
        reused: dict[str, int] = {}
        for g, group in enumerate(groups):
            group_waits = list(transfer.events[g])
            for spec in group:
                if spec.digest in placement.copy:
                    if spec.digest not in filled:
                        filled.add(spec.digest)
                        self._pending[spec.digest] = list(transfer.events[g])
                else:
                    if spec.digest not in placement.filled:
                        reused[spec.digest] = spec.nbytes
                    group_waits.extend(self._pending.get(spec.digest, []))
                block = Block(placement.offsets[spec.digest], align_up(spec.nbytes, self.alignment))
                tensors[spec.name] = self.view(block, spec.dtype, spec.shape)
            waits.append(group_waits)
        digests = tuple(placement.offsets)
        return Loaded(
            tensors, placement.owner, digests, sum(reused.values()), transfer.nbytes, transfer.transfers, waits
        )

    def release(self, loaded: Loaded) -> None:
        """The model is gone (scaled to zero): its tensors stay resident, idle, until evicted.
        On an attached arena the owner's book releases it (`ArenaLedger.release`)."""
        if loaded.released:
            raise ValueError("released twice")
        loaded.released = True
        if self.ledger is not None:
            self.ledger.release(loaded.owner)


def _name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
    return device.type


__all__ = ["ArenaFull", "ArenaHandle", "Block", "Loaded", "Placement", "Resident", "TensorArena", "default_device"]
