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
