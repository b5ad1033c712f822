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


MADV_DONTNEED = 4


def drop_mapped_pages(path: str, maps: str = "/proc/self/maps") -> int:
    """Unmap this process's pages of the file `path` (they stay in the page cache or the host
    cache's tmpfs; a later touch faults them back) and return the bytes of the mappings let go.

    OpenVINO maps the IR's weights file and compiles from it; the CPU plugin repacks the weights
    into memory of its own on the first forward pass and reads the mapping no more (the
    embedding's few rows aside). Left mapped, those pages stay in the worker's RSS: the file
    once more beside its repacked copy (at 1.7B, 0.95 GB of 2.4 GB), which the node's budget
    then books as the model's (`policy.footprint.true_up`)."""
    libc = _libc()
    if libc is None:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    path, dropped = os.path.realpath(path), 0
    try:
        with open(maps) as f:
            lines = f.readlines()
    except OSError:
        return 0
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].rstrip("\n") == path:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if libc.madvise(start, end - start, MADV_DONTNEED) == 0:
                dropped += end - start
    return dropped


def trim_heap() -> None:
    """Give the heap's free pages back (`MALLOC_ENV` stops glibc from doing it on its own)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
