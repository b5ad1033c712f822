"""The scheduler's book of measurements: what the engines report, and the performance models
fitted from it (LLM-Mesh §5.2), per artifact and kind of node.

Engines send their recent prefills and decode iterations with every heartbeat. Lengths are
grouped to the nearest power of two before fitting, as §5.2 samples them: measured lengths
are arbitrary, and interpolating between two close, noisy points would extrapolate wildly.
A model is refitted only when a report changes.
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


def _bucket(length: float) -> int:
    return 1 << max(0, round(math.log2(max(length, 1.0))))


class PerfBook:
    def __init__(self) -> None:
        self._reports: dict[tuple[str, str], dict[str, PerfReport]] = {}
        """(artifact, node kind) → node → its latest report."""
        self._models: dict[tuple[str, str], PerfModel | None] = {}
        self._starts: dict[str, deque[float]] = {}
        """Artifact → seconds its recent starts that loaded weights (not resident) took to
        load them into a worker."""
        self._spawns: deque[float] = deque(maxlen=16)
        """Seconds recent starts waited for a worker process (none was prewarmed)."""

    def start(self, artifact_id: str, load_s: float, spawn_s: float = 0.0) -> None:
        """A start that loaded weights: `load_s` loading them, after `spawn_s` waiting for a
        worker process (about 0 where one was prewarmed)."""
        self._starts.setdefault(artifact_id, deque(maxlen=16)).append(load_s)
        if spawn_s >= SPAWNED_S:
            self._spawns.append(spawn_s)

    def spawn_s(self) -> float:
        return statistics.median(self._spawns) if self._spawns else 0.0

    def start_s(self, artifact_id: str, default: float = 1.0) -> float:
        starts = self._starts.get(artifact_id)
        return statistics.median(starts) if starts else default

    def report(self, node_id: str, kind: str, report: PerfReport) -> None:
        key = (report.artifact_id, kind)
        by_node = self._reports.setdefault(key, {})
        if by_node.get(node_id) != report:
            by_node[node_id] = report
            self._models.pop(key, None)

    def model(self, artifact_id: str, kind: str = "cpu") -> PerfModel | None:
        key = (artifact_id, kind)
        if key not in self._models:
            self._models[key] = self._fit(self._reports.get(key, {}).values())
        return self._models[key]

    @staticmethod
    def _fit(reports: Iterable[PerfReport]) -> PerfModel | None:
        prefill: list[PrefillSample] = []
        decode: list[DecodeSample] = []
        batched: list[tuple[int, int, float]] = []
        for r in reports:
            prefill += [PrefillSample(_bucket(n), s) for n, s in r.prefill]
            decode += [DecodeSample(1, _bucket(n), s) for b, n, s in r.decode if b == 1]
            batched += [(_bucket(b), n, s) for b, n, s in r.decode if b > 1]
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
