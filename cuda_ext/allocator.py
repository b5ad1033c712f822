"""Byte ranges of one allocation: first-fit sub-allocation with coalescing free ranges.

Pure bookkeeping over offsets, no memory of its own, so it is the same for the device arena and
the host fallback. First fit over an address-ordered free list keeps a fresh arena's
allocations contiguous in the order they were asked for, which is what lets a model loaded in
access order be copied in a few large transfers (Tangram §3.2.2 packs a model's tensors
contiguously for the same reason).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


class ArenaFull(MemoryError):
    """No free range is large enough: the caller evicts idle tensors (by its policy) and retries."""


@dataclass(frozen=True, order=True)
class Block:
    """An allocated byte range of the arena."""

    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


class RangeAllocator:
    """Hands out aligned byte ranges of a region of `capacity` bytes."""

    def __init__(self, capacity: int, alignment: int = 256) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, not {alignment}")
        self.capacity = capacity - capacity % alignment
        self.alignment = alignment
        self._free_offsets: list[int] = [0] if self.capacity else []
        self._free_sizes: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self._allocated: dict[int, int] = {}

    @property
    def used_bytes(self) -> int:
        return sum(self._allocated.values())

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        return max(self._free_sizes.values(), default=0)

    def allocate(self, nbytes: int) -> Block:
        """One range of at least `nbytes` (rounded up to the alignment; a zero-byte tensor still
        gets a range of its own, so that every block has a distinct offset)."""
        size = align_up(max(nbytes, 1), self.alignment)
        for offset in self._free_offsets:
            if self._free_sizes[offset] >= size:
                self._take(offset, size)
                return Block(offset, size)
        raise ArenaFull(f"no free range of {size} bytes (free {self.free_bytes}, largest {self.largest_free})")

    def allocate_many(self, sizes: Sequence[int]) -> list[Block]:
        """Ranges for every size, back to back in one free range where one is large enough (so
        that their copy coalesces), else one by one; all or none."""
        if not sizes:
            return []
        aligned = [align_up(max(n, 1), self.alignment) for n in sizes]
        total = sum(aligned)
        for offset in self._free_offsets:
            if self._free_sizes[offset] >= total:
                self._take(offset, total)
                del self._allocated[offset]
                blocks: list[Block] = []
                at = offset
                for size in aligned:
                    blocks.append(Block(at, size))
                    self._allocated[at] = size
                    at += size
                return blocks
        done: list[Block] = []
        try:
            for n in sizes:
                done.append(self.allocate(n))
        except ArenaFull:
            for block in done:
                self.free(block)
            raise
        return done

    def free(self, block: Block) -> None:
        if self._allocated.get(block.offset) != block.nbytes:
            raise ValueError(f"{block} is not allocated")
        del self._allocated[block.offset]
        offset, size = block.offset, block.nbytes
        i = bisect.bisect_left(self._free_offsets, offset)
        # Coalesce with the free range after, then the one before, so free space never fragments
        # into neighbours that could have been one range.
        if i < len(self._free_offsets) and self._free_offsets[i] == offset + size:
            size += self._free_sizes.pop(self._free_offsets.pop(i))
        if i > 0:
            prev = self._free_offsets[i - 1]
            if prev + self._free_sizes[prev] == offset:
                self._free_sizes[prev] += size
                return
        self._free_offsets.insert(i, offset)
        self._free_sizes[offset] = size

    def _take(self, offset: int, size: int) -> None:
        free = self._free_sizes.pop(offset)
        i = bisect.bisect_left(self._free_offsets, offset)
        self._free_offsets.pop(i)
        if free > size:
            self._free_offsets.insert(i, offset + size)
            self._free_sizes[offset + size] = free - size
        self._allocated[offset] = size
