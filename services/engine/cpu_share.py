"""A worker process's share of its host, with no runtime imported (the engine's main process
reads it, and a torch node may hold no OpenVINO): its threads pinned to its cores, and a heap
touched before a start needs it and trimmed after (TIDAL §5: the pre-warm takes what a start
would otherwise pay for)."""

from __future__ import annotations

import ctypes
import os

# glibc reads these at process start, so they are set in the environment the OpenVINO worker
# is spawned with. One arena and no trimming keep the pages that `prefault_heap` touched in the
# heap for the start's allocations to reuse; blocks from 32 MiB up still get their own mappings
# (a large block would otherwise pin the heap's top).
MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 40),
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
}


def pin_all_threads(cores: set[int]) -> None:
    """Set the CPU affinity of every thread of this process (sched_setaffinity on pid 0 moves
    only the calling thread; the runtime's pool threads would keep every core)."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except OSError:
            pass  # a thread that just ended


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def prefault_heap(nbytes: int) -> None:
    """TIDAL §5: a start's ≈ 200 MB of allocations took ≈ 54 000 page faults, 0.06 s of a
    0.28 s load + first pass; touched here and freed into the heap (kept by `MALLOC_ENV`),
    those pages are reused without faulting."""
    libc = _libc()
    if libc is None or nbytes <= 0:
        return
    chunk = 1 << 20
    ptrs = []
    for _ in range(nbytes // chunk):
        ptr = libc.malloc(chunk)
        if not ptr:
            break
        ctypes.memset(ptr, 0, chunk)
        ptrs.append(ptr)
    for ptr in reversed(ptrs):
        libc.free(ptr)


def trim_heap() -> None:
    """Give the heap's free pages back (`MALLOC_ENV` stops glibc from doing it on its own)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
