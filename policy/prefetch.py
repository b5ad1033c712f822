"""How much of a model to copy before its first request is admitted (TIDAL §5, Eq. 1).

A cold start copies weights from host memory while the first forward pass runs: layers are
copied in the order the forward pass reads them (traced once at registration), and compute
waits only for the layer it needs next. What the link moves during one TTFT need not be copied
ahead, so only

    M_prefetch = max(M_model − T_TTFT × B_h2d, 0)

bytes must be resident before the request is admitted (TIDAL Eq. 1, with B_PCIe read as the
host-to-device bandwidth measured on the node, not the link's nominal figure). They are the
first ones in access order: the layers computed first have the least time to arrive.

Pure: sizes and measurements in, a plan out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def prefetch_bytes(model_bytes: int, ttft_s: float, h2d_bytes_per_s: float) -> int:
    """TIDAL Eq. 1: the bytes that cannot stream in behind the first token's compute."""
    if model_bytes < 0 or ttft_s < 0 or h2d_bytes_per_s < 0:
        raise ValueError("sizes, times and bandwidths are not negative")
    return max(model_bytes - int(ttft_s * h2d_bytes_per_s), 0)


def admission_bytes(copy_bytes: int, ttft_s: float | None, h2d_bytes_per_s: float, dma: bool) -> int | None:
    """Of the bytes a start copies into the node's arena, those to be in before its first
    request runs; None: all of them (nothing streams). Eq. 1 where the copy runs on a GPU's
    copy engines beside the compute. Not on the host, where the copy is a memcpy on the very
    cores the forward pass needs: streaming there only moves the copy into the forward pass
    (measured on 2 cores, SmolLM2-135M: start to first token 0.54 s streamed against 0.53 s
    admitted whole, `bench/results/gpu_arena_cpu.json`). Nor before the bandwidth and a TTFT
    have been measured on the node."""
    if not dma or ttft_s is None or h2d_bytes_per_s <= 0:
        return None
    return prefetch_bytes(copy_bytes, ttft_s, h2d_bytes_per_s)


@dataclass(frozen=True)
class Layer:
    """A unit the forward pass reads at once (a decoder layer, the embedding, the head)."""

    name: str
    nbytes: int


@dataclass(frozen=True)
class PrefetchPlan:
    before_admit: tuple[str, ...]
    """Layers copied before the first request is admitted: the shortest prefix, in access order,
    of at least `target_bytes`."""
    streamed: tuple[str, ...]
    """Layers copied behind it, in access order, each waited for by the compute that reads it."""
    target_bytes: int
    """M_prefetch of Eq. 1."""
    before_admit_bytes: int
    streamed_bytes: int


def plan_prefetch(layers: Sequence[Layer], ttft_s: float, h2d_bytes_per_s: float) -> PrefetchPlan:
    """Split `layers` (in access order) into what is copied before admission and what streams."""
    total = sum(layer.nbytes for layer in layers)
    target = prefetch_bytes(total, ttft_s, h2d_bytes_per_s)
    n = 0
    ahead = 0
    while ahead < target:
        ahead += layers[n].nbytes
        n += 1
    return PrefetchPlan(
        before_admit=tuple(layer.name for layer in layers[:n]),
        streamed=tuple(layer.name for layer in layers[n:]),
        target_bytes=target,
        before_admit_bytes=ahead,
        streamed_bytes=total - ahead,
    )
