"""What a worker process is given on the host, with no runtime imported (the engine's main
process reads it, and a torch node may hold no OpenVINO): its share of the node's cores, and
the OpenVINO worker's malloc environment."""

from __future__ import annotations

import os

# glibc reads these at process start, so they are set in the environment the OpenVINO worker
# is spawned with. One arena and no trimming keep the pages that `worker_os.prefault_heap`
# touched in the heap for the start's allocations to reuse; blocks from 32 MiB up still get
# their own mappings (a large block would otherwise pin the heap's top).
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
