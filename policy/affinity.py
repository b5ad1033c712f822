"""Affinity-aware node choice for a start (Tangram §3.4, Algorithm 2).

Where a model's tensors are still resident (kept by the tensor pool after its instance scaled
to zero), a start loads only what is missing. Eq. 3 estimates the load time of a model on a
node as

    t_load = (S − S') / B,

S the model's size, S' the bytes of its tensors already resident there, B the bandwidth of
the slower medium on the way (store → host cache → device run overlapped, so only the slower
one counts). Among the nodes of the preferred kind that can take the model (CPU first,
LLM-Mesh §4), the one with the least expected load time wins; ties go to the node the
instance fills best (§7.2 bin-packing).

Pure: offers in, a choice out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def load_time_s(model_bytes: int, reusable_bytes: int, bandwidth_bps: float) -> float:
    """Eq. 3: seconds to bring the model's missing tensors onto the node."""
    missing = max(model_bytes - reusable_bytes, 0)
    return missing / bandwidth_bps if missing else 0.0


def slowest_bandwidth(*bandwidths_bps: float) -> float:
    """The pipelined path's bandwidth: the slowest of its overlapped transfers (§3.4)."""
    return min(bandwidths_bps)


@dataclass(frozen=True)
class Offer:
    """A node that could start the model, with what it already holds of it."""

    node_id: str
    kind: str
    free_bytes: int
    """Bytes it can give the instance, counting idle resident tensors it may evict."""
    reusable_bytes: int
    """S': bytes of this model's tensors resident on the node."""
    bandwidth_bps: float
    init_s: float = 0.0
    """Fixed start cost on this node besides loading (runtime, profile)."""


@dataclass(frozen=True)
class Choice:
    node_id: str
    load_s: float
    """Expected seconds until the instance can serve: init plus eq. 3."""


def start_s_if_fits(
    free_bytes: int, reusable_bytes: int, model_bytes: int, need_bytes: int, bandwidth_bps: float, init_s: float = 0.0
) -> float | None:
    """The expected start on a node (init plus eq. 3), or None where the instance does not
    fit: resident tensors of the model count toward `need_bytes`, since they are reused."""
    if free_bytes + reusable_bytes < need_bytes:
        return None
    return init_s + load_time_s(model_bytes, reusable_bytes, bandwidth_bps)


def rank_nodes(
    model_bytes: int,
    need_bytes: int,
    offers: Iterable[Offer],
    kind_order: Sequence[str] = ("cpu", "gpu"),
) -> list[Choice]:
    """Every offer that can take the model, best first.

    `need_bytes` is what the instance needs in all (weights and its first KV cache);
    resident tensors of the model count toward it, since they are reused, not copied.
    The kind order comes first (LLM-Mesh §4: the GPU is the scarce resource, so a start goes
    to a CPU node whenever one validates); within a kind, the least expected load time
    (Tangram Alg. 2); then the tightest fit (§7.2 bin-packing).
    """
    rank = {k: i for i, k in enumerate(kind_order)}
    keyed = []
    for o in offers:
        t = start_s_if_fits(o.free_bytes, o.reusable_bytes, model_bytes, need_bytes, o.bandwidth_bps, o.init_s)
        if t is None:
            continue
        free_after = o.free_bytes + o.reusable_bytes - need_bytes
        keyed.append(((rank.get(o.kind, len(rank)), round(t, 3), free_after, o.node_id), Choice(o.node_id, t)))
    keyed.sort(key=lambda kc: kc[0])
    return [c for _, c in keyed]


def choose_node(
    model_bytes: int,
    need_bytes: int,
    offers: Iterable[Offer],
    kind_order: Sequence[str] = ("cpu", "gpu"),
) -> Choice | None:
    """The best node to start the model on (see `rank_nodes`), or None if none can take it."""
    ranked = rank_nodes(model_bytes, need_bytes, offers, kind_order)
    return ranked[0] if ranked else None


def schedule_starts(
    models: Sequence[tuple[str, int, int]],
    offers: Sequence[Offer],
    reusable: dict[tuple[str, str], int],
    kind_order: Sequence[str] = ("gpu",),
) -> dict[str, Choice | None]:
    """Algorithm 2: for each (model, model_bytes, need_bytes) in order, the best node; a node
    chosen once leaves the pool of offers. `reusable[(model, node_id)]` is S' per pair.

    A model with no feasible node maps to None (it stays queued for a later round).
    """
    left = {o.node_id: o for o in offers}
    out: dict[str, Choice | None] = {}
    for model, model_bytes, need in models:
        cands = [
            Offer(o.node_id, o.kind, o.free_bytes, reusable.get((model, o.node_id), 0), o.bandwidth_bps, o.init_s)
            for o in left.values()
        ]
        choice = choose_node(model_bytes, need, cands, kind_order)
        out[model] = choice
        if choice is not None:
            del left[choice.node_id]
    return out
