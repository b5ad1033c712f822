"""What a bound worker's weights reservation should be: what the worker really holds.

An artifact's `weight_bytes` (its IR's weights) is what a start reserves first, but a worker
holds more: the runtime, the CPU plugin's repacked weights, the stateful START tier beside the
continuous-batching core, its heap. Measured here (SmolLM2-135M, OpenVINO 2026.4): 92 MB of
weights, a bound worker of ≈ 990 MB resident. A node budget counted in weights would let ten
times its memory be bound. The engine measures each bound worker (its RSS, less the KV cache
it has allocated, which its KV reservation counts) and trues the reservation up to it.

Pure: sizes in, a decision out.
"""

from __future__ import annotations

GROW_TOLERANCE = 0.05
"""Measured more than this above the reservation: grow it (a resize through the memory
manager's station; noise below this is not worth an operation)."""
SHRINK_TOLERANCE = 0.10
"""Measured more than this below: shrink it (a worker's RSS falls after a tier swap or a heap
trim, and rises a few per cent again with the next crowd: shrink only for a clear drop). Not
more: a worker lets go of its IR's mapped weights after its first pass (1.7B: 1.9 to 1.6 GB,
-16 %), and a tolerance of 20 % kept that drop booked for as long as the model ran."""


def true_up(reserved: int, weight_bytes: int, rss: int, kv_allocated: int) -> int | None:
    """The new reservation for a worker's weights, or None to keep `reserved`: its measured
    footprint (`rss` less `kv_allocated`), never below `weight_bytes`. An unreadable RSS (0)
    keeps the reservation."""
    if rss <= 0:
        return None
    target = max(weight_bytes, rss - kv_allocated)
    if target > reserved * (1 + GROW_TOLERANCE) or target < reserved * (1 - SHRINK_TOLERANCE):
        return target
    return None
