"""A torch node's one tensor arena per device (Tangram §4), owned by the engine's main process.

The engine makes the memory (`cuda_ext.memory`) and keeps its book (`cuda_ext.ledger`); every
torch worker maps it at its pre-warm (CUDA IPC on a GPU) and binds models where the book places
them. So a stopped worker's weights stay resident, idle, until evicted by cost, and a start of
any model sharing its tensors copies only what is missing (§3.1). No torch imported here.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path

from cuda_ext.allocator import Block
from cuda_ext.ledger import ArenaLedger, Placement
from cuda_ext.memory import ArenaHandle, SharedMemory
from cuda_ext.native import CudaError, NativeUnavailable
from cuda_ext.progress import FillProgress
from services.engine.metrics import ARENA_LOADS, ARENA_STREAMED
from shared.artifact import TORCH_MANIFEST, TORCH_WEIGHTS, safetensors_header

log = logging.getLogger(__name__)
_owners = itertools.count()
FILL_BATCH_BYTES = 32 << 20
"""What a fill copies between two counts of its progress (a small model's layer is a few MiB)."""
_WATCH_S = 0.0005
"""How often a CUDA fill's admission watcher reads the count the extension stores."""


def _fill_owner(owner: str) -> str:
    return f"{owner}/fill"


def arena_device(device: str) -> str:
    """The arena's device for a node's `TESSERA_DEVICE` (CUDA, CUDA:1, or a CPU's)."""
    name = device.lower()
    if name == "cuda":
        return "cuda:0"
    return name if name.startswith("cuda:") else "cpu"


class NodeArena:
    def __init__(self, capacity_bytes: int, device: str) -> None:
        self.ledger = ArenaLedger(capacity_bytes)
        self.memory = SharedMemory(self.ledger.allocator.capacity, arena_device(device))
        self._lock = threading.Lock()  # a worker's death is reported on its reader thread
        self._copied: dict[str, frozenset[str]] = {}
        """Per owner, the digests its last placement had it copy (what a reload discards)."""
        self._filling: dict[str, Future[bool]] = {}
        """Digests being copied in, each by its fill (whether it ends with every tensor in): a
        load that finds one resident waits for it; its range is held until the copy ends."""
        self._broken: set[str] = set()
        """Digests whose copy failed: never reused, evicted once nobody holds them."""
        self.fill_bps = 0.0
        """Bytes per second the last fills copied at (0: none yet): TIDAL Eq. 1's B_h2d, measured."""

    @classmethod
    def make(cls, capacity_bytes: int, device: str) -> NodeArena | None:
        """The node's arena, or None (each worker makes its own) where this machine cannot
        share one (a CUDA node without the extension built, or a refused allocation)."""
        try:
            return cls(capacity_bytes, device)
        except (NativeUnavailable, CudaError) as e:
            log.warning("no shared tensor arena on this node (%s): each torch worker makes its own", e)
            return None

    @property
    def handle(self) -> ArenaHandle:
        return self.memory.handle

    @staticmethod
    def owner() -> str:
        """A new name for a worker's holdings in the book."""
        return f"worker-{next(_owners)}"

    def place(self, owner: str, tensors: Mapping[str, int], discard: bool = False) -> Placement:
        """Where a worker's next model goes (its tensors as digest → bytes, in access order),
        `owner`'s last released first. `discard`: what its last placement copied is evicted
        first where nobody else holds it (that copy failed its check)."""
        with self._lock:
            self._release(owner)
            if discard:
                self._evict_idle(self._copied.pop(owner, frozenset()))
            blocks = dict(self.ledger.blocks)
            try:
                placement = self.ledger.place(list(tensors.items()), owner)
            finally:
                # What it evicted (even for a failed placement) gives its pages back now.
                self._discard([b for d, b in blocks.items() if d not in self.ledger.blocks])
            self._copied[owner] = placement.copy
            self._broken -= placement.copy  # evicted meanwhile, and copied afresh now
        ARENA_LOADS.labels("reused").inc(sum(n for d, n in tensors.items() if d not in placement.copy))
        return placement

    def begin_fill(self, placement: Placement) -> None:
        """What `placement` copies is held by its fill until `fill` ends, whatever becomes of the
        worker (no eviction hands its ranges to another load mid-copy)."""
        if not placement.copy:
            return
        with self._lock:
            if self.ledger.holds(_fill_owner(placement.owner)):
                raise RuntimeError(f"{placement.owner}'s last fill has not ended")  # its hold is one name
            self.ledger.place([(d, self.ledger.sizes[d]) for d in placement.copy], _fill_owner(placement.owner))
            fill: Future[bool] = Future()
            for digest in placement.copy:
                self._filling[digest] = fill

    def pending(self, placement: Placement) -> list[Future[bool]]:
        """The fills of other loads still copying tensors `placement` found resident."""
        with self._lock:
            fills = {id(f): f for d in placement.offsets if d not in placement.copy and (f := self._filling.get(d))}
            broken = bool(self._broken & (set(placement.offsets) - placement.copy))
        if broken:  # held by a load whose copy failed, not evicted yet: never to be read
            failed: Future[bool] = Future()
            failed.set_result(False)
            return [failed]
        return list(fills.values())

    def fill(
        self,
        placement: Placement,
        checkpoint: Path,
        order: Sequence[str] = (),
        progress: FillProgress | None = None,
        load: int = 0,
        admit_bytes: int | None = None,
        on_admit: Callable[[], None] | None = None,
    ) -> Placement:
        """Copy what `placement` says to copy from the checkpoint into the arena, here (on CUDA
        through the extension's pinned staging, at the link's speed). In `order` (access order;
        by offset otherwise), each counted on `progress` once in (the worker's forward pass
        waits there), and `on_admit()` called once `admit_bytes` are in (TIDAL §5: the first
        request runs while the rest streams in). The placement to send the worker."""
        if not placement.copy:
            return placement
        ok = False
        try:
            names = {t["digest"]: t["name"] for t in json.loads((checkpoint / TORCH_MANIFEST).read_text())["tensors"]}
            base, header = safetensors_header(checkpoint / TORCH_WEIGHTS)
            with self._lock:
                sizes = {d: self.ledger.sizes[d] for d in placement.copy}
            digests = list(order) or sorted(placement.copy, key=placement.offsets.__getitem__)
            if set(digests) != placement.copy:
                raise ValueError("a fill's order names other digests than its placement copies")
            spans = []
            for digest in digests:
                start, end = header[names[digest]]["data_offsets"]
                if end - start != sizes[digest]:
                    raise ValueError(
                        f"{names[digest]} is {end - start} bytes in {checkpoint}, {sizes[digest]} in its manifest"
                    )
                spans.append((base + start, placement.offsets[digest], end - start))
            t0 = time.monotonic()
            if self.memory.counts_progress and progress is not None:
                streamed = self._fill_counted(checkpoint, spans, progress, load, admit_bytes, on_admit)
            elif progress is None and admit_bytes is None:  # nobody follows it: one call
                self.memory.copy_from_file(checkpoint / TORCH_WEIGHTS, spans)
                streamed = 0
            else:
                streamed = self._fill_in_batches(checkpoint, spans, progress, load, admit_bytes, on_admit)
            elapsed = time.monotonic() - t0
            total = sum(n for _, _, n in spans)
            if total >= FILL_BATCH_BYTES and elapsed > 0:
                self.fill_bps = total / elapsed
            ARENA_LOADS.labels("copied").inc(total)
            ARENA_STREAMED.inc(streamed)
            ok = True
        finally:
            if not ok and progress is not None:
                progress.fail(load)
            with self._lock:
                fill = self._filling.get(next(iter(placement.copy)))
                for digest in placement.copy:
                    self._filling.pop(digest, None)
                if not ok:
                    self._broken |= placement.copy
                self._release(_fill_owner(placement.owner))
            if fill is not None:
                fill.set_result(ok)
        return replace(placement, copy=frozenset(), filled=placement.copy)

    def _fill_in_batches(
        self,
        checkpoint: Path,
        spans: list[tuple[int, int, int]],
        progress: FillProgress | None,
        load: int,
        admit_bytes: int | None,
        on_admit: Callable[[], None] | None,
    ) -> int:
        """The host's fill: a batch of spans at a time (at least FILL_BATCH_BYTES but the last),
        each counted once copied; admitted before the first batch that starts at or past
        `admit_bytes`. The bytes copied after."""
        done_bytes, streamed_from, first, batch_bytes = 0, None, 0, 0
        for last, (_, _, n) in enumerate(spans, 1):
            batch_bytes += n
            if batch_bytes < FILL_BATCH_BYTES and last < len(spans):
                continue
            if admit_bytes is not None and streamed_from is None and done_bytes >= admit_bytes:
                streamed_from = done_bytes
                if on_admit is not None:
                    on_admit()
            self.memory.copy_from_file(checkpoint / TORCH_WEIGHTS, spans[first:last])
            done_bytes, first, batch_bytes = done_bytes + batch_bytes, last, 0
            if progress is not None:
                progress.advance(load, last)
        return 0 if streamed_from is None else done_bytes - streamed_from

    def _fill_counted(
        self,
        checkpoint: Path,
        spans: list[tuple[int, int, int]],
        progress: FillProgress,
        load: int,
        admit_bytes: int | None,
        on_admit: Callable[[], None] | None,
    ) -> int:
        """CUDA's fill: one call to the extension, which counts spans on `progress` as they land;
        admitted from a watcher thread once `admit_bytes` are in. The bytes copied after."""
        need, ahead = 0, 0
        if admit_bytes is not None:
            while need < len(spans) and ahead < admit_bytes:
                ahead += spans[need][2]
                need += 1
        finished = threading.Event()
        admitted = threading.Event()

        def watch() -> None:
            while not finished.is_set() and progress.done(load) < need:
                finished.wait(_WATCH_S)
            if not finished.is_set():
                admitted.set()
                if on_admit is not None:
                    on_admit()

        watcher = threading.Thread(target=watch, name="tessera-fill-admit", daemon=True)
        if admit_bytes is not None:
            watcher.start()
        try:
            self.memory.copy_from_file(checkpoint / TORCH_WEIGHTS, spans, progress=progress.done_address)
        finally:
            finished.set()
            if watcher.is_alive():
                watcher.join()
        return sum(n for _, _, n in spans) - ahead if admitted.is_set() else 0

    def release(self, owner: str) -> None:
        """The worker's model is gone (it stopped, died, or was bound to another): its tensors
        stay resident, idle."""
        with self._lock:
            self._release(owner)

    def _release(self, owner: str) -> None:
        if self.ledger.holds(owner):
            self.ledger.release(owner)
        # Tensors whose copy failed go as soon as nobody holds them: no load may find them.
        self._evict_idle(self._broken)
        self._broken &= self.ledger.digests()

    def evict_idle(self, tensors: Mapping[str, int]) -> int:
        """Evict those of `tensors` that nobody holds, giving their memory back; the bytes freed."""
        with self._lock:
            return self._evict_idle(tensors)

    def evict_cheapest(self, nbytes: int, keep: AbstractSet[str] = frozenset()) -> int:
        """Evict idle tensors but `keep`, the cheapest to reload first (Tangram eq. 2), until
        `nbytes` are freed for the node's budget; the bytes freed (0 where it cannot)."""
        with self._lock:
            blocks = dict(self.ledger.blocks)
            return self._discard([blocks[d] for d in self.ledger.evict_cheapest(nbytes, keep)])

    def _evict_idle(self, digests: Iterable[str]) -> int:
        """Evict those of `digests` nobody holds, giving their pages back; the bytes freed."""
        gone = set(digests) & set(self.ledger.idle())
        blocks = [self.ledger.blocks[d] for d in gone]
        for digest in gone:
            self.ledger.evict(digest)
        return self._discard(blocks)

    def _discard(self, blocks: list[Block]) -> int:
        for block in blocks:
            self.memory.discard(block.offset, block.nbytes)
        return sum(b.nbytes for b in blocks)

    def committed_bytes(self, wanted: Mapping[str, int] | None = None) -> int:
        """The node memory the arena takes, with the `wanted` tensors not in it yet: on CUDA its
        whole allocation (made at once); on the host the pages its tensors fill."""
        capacity = self.ledger.allocator.capacity
        if self.handle.cuda:
            return capacity
        with self._lock:
            blocks = self.ledger.blocks
            coming = sum(n for d, n in (wanted or {}).items() if d not in blocks)
            return min(capacity, sum(b.nbytes for b in blocks.values()) + coming)

    def room_bytes(self, tensors: Mapping[str, int]) -> int:
        """Bytes a load of `tensors` could copy in: all but what loads hold and its own resident
        tensors (others' idle ones are evicted for it)."""
        held, idle = self.held_bytes(tensors)
        return self.ledger.allocator.capacity - held - idle

    def held_bytes(self, among: Mapping[str, int] | None = None) -> tuple[int, int]:
        """Bytes of tensors some worker holds, and of idle ones (`among` these only)."""
        with self._lock:
            idle = set(self.ledger.idle())
            held = sum(n for d, n in self.ledger.sizes.items() if d not in idle)
            return held, sum(self.ledger.sizes[d] for d in idle if among is None or d in among)

    def digests(self) -> frozenset[str]:
        with self._lock:
            return self.ledger.digests()

    def missing_bytes(self, tensors: Mapping[str, int]) -> int:
        with self._lock:
            return self.ledger.missing_bytes(tensors.items())

    def close(self) -> None:
        self.memory.close()
