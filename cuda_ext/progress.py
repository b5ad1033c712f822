"""A fill's progress, shared by the process that copies a model's tensors into the node's arena
(the engine) and the one that computes with them (its worker): TIDAL §5's streaming across
processes. The worker is admitted a request once the first `M_prefetch` bytes are in (Eq. 1,
`policy.prefetch`); each unit of its first forward pass waits for its own tensors, which the
engine copies in access order behind it.

The progress is two 64-bit words in a memfd the engine keeps open and the worker maps through
the engine's /proc/<pid>/fd entry (as the host arena is mapped, `cuda_ext.memory`): the load it
counts, and how many of that load's copied tensors are in, in the order `FillSignal.digests`
gives (or `FAILED`). On the host the engine writes it with `pwrite` after each batch's copy;
on CUDA the extension stores the count itself (a release store, through the engine's own
mapping, `done_address`) once each span's last chunk is known landed. Either way a count is
only ever seen after the bytes it counts. No torch.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

FAILED = -1
"""The count of a fill that failed: what it was to copy will not all arrive."""
_WORDS = struct.Struct("<qq")
_POLL_S = 0.0002
"""How long a waiting unit sleeps between looks: a batch of copies takes milliseconds."""


class FillFailed(RuntimeError):
    """The tensors a forward pass waits for will not arrive (their copy failed, or took longer
    than the worker waits)."""


@dataclass(frozen=True)
class FillSignal:
    """What a worker needs to follow one load's fill: where the progress is, which load it
    counts, and the copied digests in the order they arrive."""

    path: str
    load: int
    digests: tuple[str, ...]


class FillProgress:
    """The engine's side: one per worker, reused by its loads (each numbered by `begin`)."""

    def __init__(self) -> None:
        self._fd = os.memfd_create("tessera-fill", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, _WORDS.size)
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
        self._map: Any = mmap.mmap(self._fd, _WORDS.size, mmap.MAP_SHARED)
        self._word = ctypes.c_int64.from_buffer(self._map, 8)
        self.done_address = ctypes.addressof(self._word)
        """Where the count lives in this process: the CUDA extension stores it there itself as
        a copy's spans land (`Native.copy_pageable(progress=)`)."""
        weakref.finalize(self, os.close, self._fd)
        self._loads = 0

    def begin(self) -> int:
        """A new load: its number, its count at 0 (before the worker hears of it)."""
        self._loads += 1
        self._write(self._loads, 0)
        return self._loads

    def advance(self, load: int, done: int) -> None:
        self._write(load, done)

    def done(self, load: int) -> int:
        return _count(self._map, load)

    def fail(self, load: int) -> None:
        self._write(load, FAILED)

    def _write(self, load: int, done: int) -> None:
        # One syscall: the copy's bytes (written before it) are in memory first.
        os.pwrite(self._fd, _WORDS.pack(load, done), 0)


class FillWaiter:
    """The worker's side of one load: `wait(g)` blocks until unit `g`'s copied tensors are in."""

    def __init__(self, signal: FillSignal, units: Sequence[Sequence[str]], timeout_s: float = 120.0) -> None:
        """`units`: each unit's digests, in the order the forward pass reads the units."""
        fd = os.open(signal.path, os.O_RDONLY)
        try:
            self._map: Any = mmap.mmap(fd, _WORDS.size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.load = signal.load
        self.total = len(signal.digests)
        self.timeout_s = timeout_s
        rank = {d: i + 1 for i, d in enumerate(signal.digests)}
        # A unit may run once every copied tensor of it, and of the units before it, is in.
        self.needed: list[int] = []
        need = 0
        for digests in units:
            need = max([need, *(rank.get(d, 0) for d in digests)])
            self.needed.append(need)
        self.complete = self.total == 0
        self.around: Callable[[Callable[[], None]], None] | None = None
        """What a wait that must block runs inside: the batch steps out of the node's headroom
        gate (`EngineSampling.aside`), so that other instances step while this one waits for
        its copy rather than compute."""

    def done(self) -> int:
        return _count(self._map, self.load)

    def wait(self, unit: int) -> None:
        if self.complete or self._arrived(self.needed[unit]):
            return
        if self.around is not None:
            self.around(lambda: self._block(unit))
        else:
            self._block(unit)

    def _arrived(self, need: int) -> bool:
        done = self.done()
        if done == FAILED:
            raise FillFailed(f"the copy of this model's tensors failed (load {self.load})")
        if done >= self.total:
            self.complete = True  # later units and steps look no more
        return done >= need

    def _block(self, unit: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._arrived(self.needed[unit]):
            if time.monotonic() > deadline:
                raise FillFailed(f"unit {unit}'s tensors did not arrive in {self.timeout_s:.0f} s")
            time.sleep(_POLL_S)


def _count(words: Any, load: int) -> int:
    """The count of `load` in a mapping of the progress (0 while another load's is there)."""
    current, done = _WORDS.unpack(words[: _WORDS.size])
    return int(done) if current == load else 0
