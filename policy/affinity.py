"""Affinity-aware start cost (Tangram §3.4, eq. 3).

Where a model's tensors are still resident (kept by the tensor pool after its instance scaled
to zero), a start loads only what is missing. Eq. 3 estimates the load time of a model on a
node as

    t_load = (S − S') / B,

S the model's size, S' the bytes of its tensors already resident there, B the bandwidth of
the slower medium on the way (store → host cache → device run overlapped, so only the slower
one counts). Placement ranks the nodes that could start a model by it
(`placement.start_order`: the node kind first, LLM-Mesh §4; then the least expected load
time, Tangram Alg. 2; then the tightest fit, §7.2 bin-packing).

Pure: sizes in, seconds out.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet


def load_time_s(model_bytes: int, reusable_bytes: int, bandwidth_bps: float) -> float:
    """Eq. 3: seconds to bring the model's missing tensors onto the node."""
    missing = max(model_bytes - reusable_bytes, 0)
    return missing / bandwidth_bps if missing else 0.0


def start_s_if_fits(
    free_bytes: int, reusable_bytes: int, model_bytes: int, need_bytes: int, bandwidth_bps: float, init_s: float = 0.0
) -> float | None:
    """The expected start on a node (init plus eq. 3), or None where the instance does not
    fit: resident tensors of the model count toward `need_bytes`, since they are reused."""
    if free_bytes + reusable_bytes < need_bytes:
        return None
    return init_s + load_time_s(model_bytes, reusable_bytes, bandwidth_bps)


def reusable_shares(
    idle: Mapping[str, AbstractSet[str]], artifacts: Mapping[str, Mapping[str, int]]
) -> dict[str, float]:
    """For each artifact (content hash → bytes of each of its tensors), the largest share of
    its bytes that one idle worker's arena holds (`idle`: worker → content hashes): what a start
    binding that worker does not read (`most_reused`). 1.0: all of it (the artifact counts as
    resident); artifacts sharing nothing with any idle worker are left out."""
    out: dict[str, float] = {}
    for aid, tensors in artifacts.items():
        total = sum(tensors.values())
        best = most_reused(idle, tensors) if total else None
        if best is not None:
            out[aid] = best[1] / total
    return out


def most_reused(candidates: Mapping[str, AbstractSet[str]], tensors: Mapping[str, int]) -> tuple[str, int] | None:
    """Tangram §3.1 within a node: of idle workers whose tensor arenas hold the tensors in
    `candidates` (worker → content hashes), the one that holds the most bytes of the model to
    start (`tensors`: content hash → bytes), and those bytes (S' of eq. 3, which a load there
    does not read). None where no candidate holds any of them. Ties go to the first name in
    sorted order, so the choice is deterministic."""
    best: tuple[str, int] | None = None
    for name in sorted(candidates):
        held = candidates[name]
        reused = sum(nbytes for digest, nbytes in tensors.items() if digest in held)
        if reused > 0 and (best is None or reused > best[1]):
            best = (name, reused)
    return best
