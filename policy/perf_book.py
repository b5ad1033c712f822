"""The scheduler's book of measurements: what the engines report, and the performance models
fitted from it (LLM-Mesh §5.2), per artifact and kind of node.

Engines send their recent prefills and decode iterations with every heartbeat. Lengths are
grouped to the nearest power of two before fitting, as §5.2 samples them: measured lengths
are arbitrary, and interpolating between two close, noisy points would extrapolate wildly.
A model is refitted only when a report changes.

A report is a window of the node's latest iterations, so it need not cover what the fit
needs: under a crowd every recent decode ran in a wide batch, and none alone. The book keeps,
per node, each grid cell's samples from the latest report that had any, so a cell the
window no longer covers keeps its last measurement rather than leaving the model unfitted.
(Before, the latest report replaced everything: under load the model vanished, and with it
shadow validation and admission, exactly when they matter; a 200-client run then decoded at
6x the TPOT SLO.)
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable

from policy.kv_watermark import floor_tokens
from policy.perf_model import DecodeSample, PerfModel, PrefillSample
from policy.placement import Profile
from shared.messages import ModelRecord, PerfReport

SPAWNED_S = 0.5
"""A start that waited at least this long for its worker had none prewarmed: it spawned one."""


Cells = dict[tuple[int, ...], tuple[tuple[float, ...], ...]]
"""One node's samples of an artifact by grid cell: (length bucket,) for prefills, (batch,
length bucket) for decode iterations."""


def _bucket(length: float) -> int:
    return 1 << max(0, round(math.log2(max(length, 1.0))))


class PerfBook:
    def __init__(self) -> None:
        self._reports: dict[tuple[str, str], dict[str, Cells]] = {}
        """(artifact, node kind) → node → each grid cell's samples in the latest report that
        had any."""
        self._models: dict[tuple[str, str], PerfModel | None] = {}
        self._starts: dict[str, deque[float]] = {}
        """Artifact → seconds its recent starts that loaded weights (not resident) took to
        load them into a worker."""
        self._spawns: deque[float] = deque(maxlen=16)
        """Seconds recent starts waited for a worker process (none was prewarmed)."""
        self._sizes: dict[str, int] = {}
        """Artifact → bytes of its weights, where a start of it was measured."""

    def start(self, artifact_id: str, load_s: float, spawn_s: float = 0.0, weight_bytes: int = 0) -> None:
        """A start that loaded weights: `load_s` loading them, after `spawn_s` waiting for a
        worker process (about 0 where one was prewarmed)."""
        self._starts.setdefault(artifact_id, deque(maxlen=16)).append(load_s)
        if weight_bytes > 0:
            self._sizes[artifact_id] = weight_bytes
        if spawn_s >= SPAWNED_S:
            self._spawns.append(spawn_s)

    def load_s(self, artifact_id: str, weight_bytes: int = 0) -> float | None:
        """The load-time model of a start of the artifact: its measured starts' median, else
        (never started) its size at the median seconds per byte of the artifacts that were;
        None where no start of any size was measured."""
        own = self._starts.get(artifact_id)
        if own:
            return statistics.median(own)
        rates = [
            statistics.median(s) / self._sizes[aid] for aid, s in self._starts.items() if s and self._sizes.get(aid)
        ]
        return statistics.median(rates) * weight_bytes if rates and weight_bytes > 0 else None

    def spawn_s(self) -> float:
        return statistics.median(self._spawns) if self._spawns else 0.0

    def start_s(self, artifact_id: str, default: float = 1.0) -> float:
        starts = self._starts.get(artifact_id)
        return statistics.median(starts) if starts else default

    def report(self, node_id: str, kind: str, report: PerfReport) -> None:
        key = (report.artifact_id, kind)
        cells = self._reports.setdefault(key, {}).setdefault(node_id, {})
        fresh: dict[tuple[int, ...], list[tuple[float, ...]]] = {}
        for n, sec in report.prefill:
            fresh.setdefault((_bucket(n),), []).append((n, sec))
        for b, n, sec in report.decode:
            fresh.setdefault((b, _bucket(n)), []).append((b, n, sec))
        changed = False
        for cell, samples in fresh.items():
            if cells.get(cell) != (got := tuple(samples)):
                cells[cell] = got
                changed = True
        if changed:
            self._models.pop(key, None)

    def model(self, artifact_id: str, kind: str = "cpu") -> PerfModel | None:
        key = (artifact_id, kind)
        if key not in self._models:
            self._models[key] = self._fit(self._reports.get(key, {}).values())
        return self._models[key]

    @staticmethod
    def _fit(nodes: Iterable[Cells]) -> PerfModel | None:
        prefill: list[PrefillSample] = []
        decode: list[DecodeSample] = []
        batched: list[tuple[int, int, float]] = []
        for cells in nodes:
            for cell, samples in cells.items():
                if len(cell) == 1:
                    prefill += [PrefillSample(_bucket(n), s) for n, s in samples]
                elif cell[0] == 1:
                    decode += [DecodeSample(1, _bucket(n), s) for _, n, s in samples]
                else:
                    batched += [(_bucket(b), int(n), s) for b, n, s in samples]
        if not decode and batched:
            # Under a steady crowd no request runs alone, and a continuous-batching engine
            # reports every row with the batch it ran in: the narrowest batch measured stands
            # for a row alone. A row alone is no slower, so the estimate errs long, the safe way
            # (without it the model stayed unfitted, and placement then validated nothing: on
            # the three-node bench no model ever scaled out, however hot).
            narrowest = min(b for b, _, _ in batched)
            decode = [DecodeSample(1, _bucket(n), s) for b, n, s in batched if b == narrowest]
        if not prefill or not decode:
            return None
        alone = PerfModel.fit(prefill, decode)
        return _with_batches(alone, batched) if batched else alone

    def profiles(self, records: Iterable[ModelRecord], kind: str = "cpu", kv_min_tokens: int = 0) -> dict[str, Profile]:
        """A profile for every registered model whose artifact has been measured, with its
        performance per kind of node measured (`kind`'s where placement knows no better). Its
        KV bytes are what an engine reserves at a start: L_min tokens (`kv_min_tokens`; 0: the
        context length), the floor of LLM-Mesh's eq. 2."""
        kinds = sorted({k for _, k in self._reports}, key=lambda k: k != kind)
        out = {}
        for r in records:
            by_kind = {k: m for k in kinds if (m := self.model(r.artifact.artifact_id, k)) is not None}
            if by_kind:
                out[r.name] = Profile(
                    next(iter(by_kind.values())),
                    r.ttft_slo_s,
                    r.tpot_slo_s,
                    r.artifact.artifact_id,
                    r.artifact.weight_bytes,
                    r.artifact.kv_bytes_per_token * floor_tokens(kv_min_tokens, r.artifact.context_length),
                    self.start_s(r.artifact.artifact_id),
                    self.spawn_s(),
                    by_kind,
                    ttft_slo_per_token_s=r.ttft_slo_per_token_s,
                    kv_on_demand_bytes=r.artifact.kv_bytes_per_token
                    * floor_tokens(kv_min_tokens, r.artifact.context_length, on_demand=True),
                )
        return out


def _with_batches(alone: PerfModel, batched: list[tuple[int, int, float]]) -> PerfModel:
    """Batched iterations arrive at whatever lengths the batches had, never on a full grid:
    each batch size's row is the batch-of-one row scaled by its measured ratio (the median
    over its samples), kept non-decreasing in the batch (a wider batch never iterates faster)."""
    ratios: dict[int, list[float]] = {}
    for b, n, s in batched:
        base = alone.decode_s(1, n)
        if base > 0:
            ratios.setdefault(b, []).append(s / base)
    rows = [alone.decode_seconds[0]]
    batches = [1.0]
    floor = 1.0
    for b in sorted(ratios):
        floor = max(floor, statistics.median(ratios[b]))
        batches.append(float(b))
        rows.append(tuple(x * floor for x in alone.decode_seconds[0]))
    return PerfModel(alone.prefill_lengths, alone.prefill_seconds, tuple(batches), alone.decode_lengths, tuple(rows))
