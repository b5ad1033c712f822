"""A worker's share of the node's cores, with no runtime imported (the OpenVINO worker and the
torch worker, whose process loads no OpenVINO, both use it)."""

from __future__ import annotations

import os


def pin_all_threads(cores: set[int]) -> None:
    """Set the CPU affinity of every thread of this process (sched_setaffinity on pid 0 moves
    only the calling thread; the runtime's pool threads would keep every core)."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), cores)
        except OSError:
            pass  # a thread that just ended
