"""How long one iteration of a model takes on a kind of node (LLM-Mesh §5.2).

Prefill time is close to linear in the input length (LLM-Mesh Fig. 1), so it is a 1-D linear
interpolation over measured lengths. Decode time depends on both the batch size and the mean
sentence length (Fig. 2, 3), so it is a 2-D (bilinear) interpolation over a grid of measured
(batch, length) points. Samples are taken at powers of two, so a model with L_max = 4096 and
B_max = 256 needs only O(log L_max · log B_max) measurements.

Outside the measured range the nearest segment is extended linearly rather than clamped:
clamping would promise that a batch of 300 costs what a batch of 256 did, and shadow
validation would accept requests the node cannot serve.

Pure: measurements in, a model out; no clock, no I/O.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillSample:
    """One measured prefill: an input of `length` tokens took `seconds`."""

    length: int
    seconds: float


@dataclass(frozen=True)
class DecodeSample:
    """One measured decode iteration: `batch` requests of mean length `length` took `seconds`."""

    batch: int
    length: int
    seconds: float


def powers_of_two(upto: int) -> tuple[int, ...]:
    """1, 2, 4, … up to and including the first power of two ≥ `upto` (§5.2's sample points)."""
    out = [1]
    while out[-1] < upto:
        out.append(out[-1] * 2)
    return tuple(out)


def _segment(xs: Sequence[float], x: float) -> tuple[int, float]:
    """Index i and weight t with x ≈ xs[i]·(1-t) + xs[i+1]·t; t may fall outside [0, 1]."""
    if len(xs) == 1:
        return 0, 0.0
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


@dataclass(frozen=True)
class PerfModel:
    """Iteration times of one model on one kind of node, fitted from measurements."""

    prefill_lengths: tuple[float, ...]
    prefill_seconds: tuple[float, ...]
    decode_batches: tuple[float, ...]
    decode_lengths: tuple[float, ...]
    decode_seconds: tuple[tuple[float, ...], ...]
    """decode_seconds[i][j]: batch decode_batches[i], mean length decode_lengths[j]."""

    def prefill_s(self, length: float) -> float:
        """Seconds for the prefill iteration of one request of `length` input tokens."""
        xs, ys = self.prefill_lengths, self.prefill_seconds
        if len(xs) == 1:
            return ys[0] * max(length, 1.0) / xs[0]
        i, t = _segment(xs, length)
        return max(ys[i] + (ys[i + 1] - ys[i]) * t, 0.0)

    def decode_s(self, batch: float, mean_length: float) -> float:
        """Seconds for one decode iteration of `batch` requests of mean length `mean_length`."""
        if batch <= 0:
            return 0.0
        # `_segment` inlined on both axes: this is the simulator's and shadow validation's
        # innermost call.
        bs, ls, grid = self.decode_batches, self.decode_lengths, self.decode_seconds
        nb, nl = len(bs), len(ls)
        if nb > 1:
            i = bisect_right(bs, batch) - 1
            i = 0 if i < 0 else (min(i, nb - 2))
            u = (batch - bs[i]) / (bs[i + 1] - bs[i])
            i1 = i + 1
        else:
            i = i1 = 0
            u = 0.0
        if nl > 1:
            j = bisect_right(ls, mean_length) - 1
            j = 0 if j < 0 else (min(j, nl - 2))
            v = (mean_length - ls[j]) / (ls[j + 1] - ls[j])
            j1 = j + 1
        else:
            j = j1 = 0
            v = 0.0
        row0, row1 = grid[i], grid[i1]
        low = row0[j] + (row0[j1] - row0[j]) * v
        high = row1[j] + (row1[j1] - row1[j]) * v
        out = low + (high - low) * u
        return max(0.0, out)

    def max_batch(self, mean_length: float, tpot_s: float, limit: int = 1024) -> int:
        """The largest batch whose decode iteration alone stays within `tpot_s` (0 if none)."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.decode_s(mid, mean_length) <= tpot_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @classmethod
    def fit(cls, prefill: Iterable[PrefillSample], decode: Iterable[DecodeSample]) -> PerfModel:
        """A model from measurements; repeated points are averaged.

        The decode samples must cover a full grid (every measured batch at every measured
        length), which is how §5.2 collects them; a missing cell raises ValueError.
        """
        pre: dict[int, list[float]] = defaultdict(list)
        for p in prefill:
            pre[p.length].append(p.seconds)
        dec: dict[tuple[int, int], list[float]] = defaultdict(list)
        for d in decode:
            dec[(d.batch, d.length)].append(d.seconds)
        if not pre or not dec:
            raise ValueError("need at least one prefill and one decode sample")
        lengths = sorted(pre)
        batches = sorted({b for b, _ in dec})
        dlengths = sorted({ln for _, ln in dec})
        missing = [(b, ln) for b in batches for ln in dlengths if (b, ln) not in dec]
        if missing:
            raise ValueError(f"decode samples do not cover the grid; missing {missing[:4]}")
        return cls(
            prefill_lengths=tuple(float(x) for x in lengths),
            prefill_seconds=tuple(sum(pre[x]) / len(pre[x]) for x in lengths),
            decode_batches=tuple(float(b) for b in batches),
            decode_lengths=tuple(float(x) for x in dlengths),
            decode_seconds=tuple(tuple(sum(dec[(b, ln)]) / len(dec[(b, ln)]) for ln in dlengths) for b in batches),
        )


def profile(
    prefill_time: Callable[[int], float],
    decode_time: Callable[[int, int], float],
    *,
    max_length: int = 4096,
    max_batch: int = 256,
) -> PerfModel:
    """Fit a model by measuring `prefill_time(length)` and `decode_time(batch, length)` at the
    power-of-two grid of §5.2. The callables are the measurement (an engine, or the simulator's
    hardware); this function only chooses the points."""
    lengths = powers_of_two(max_length)
    batches = powers_of_two(max_batch)
    return PerfModel.fit(
        (PrefillSample(n, prefill_time(n)) for n in lengths),
        (DecodeSample(b, n, decode_time(b, n)) for b in batches for n in lengths),
    )
