"""torch's intra-op thread pool held at one thread while a test runs a model in its own process.

The suite runs two pytest workers on a two-core machine beside the clusters' processes. torch's
default pool (a thread a core) then waits in OpenMP barriers for threads the other worker holds
descheduled: one 12-token greedy completion of the default model on the one-request path took
10-23 s at two threads and 0.9 s at one (the same tokens) with both cores busy. Within one
process every path then runs at the same count, so what tests compare stays comparable."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def one_torch_thread() -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
