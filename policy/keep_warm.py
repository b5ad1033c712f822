"""Keep warm (issue 35, part 1): models pinned with `min_instances`, kept first by `priority`.

A pinned model (or a model whose pinned adapter keeps it: `with_adapter_pins`) is started at
registration and again whenever the nodes run it on fewer nodes than its `min_instances` (a node restarted, a worker died): `restore`. Whether the nodes can
hold every pinned model at once is `fit`, asked before a registration or a pin is stored, so
that a set that does not fit is refused rather than left to evict itself in turn. The keep-alive
side (never scaled below `min_instances`) is `scheduling.idle_instances`; the eviction and
preemption order (priority before Tangram's cost, pinned models only for a higher priority) is
`eviction.may_take` and its callers.

Pure: records, the cluster view and a clock in, decisions out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import msgspec

from policy.kv_watermark import floor_tokens
from policy.placement import NodeState, Profile
from policy.scheduling import scale_out_nodes
from shared.messages import ModelRecord

RETRY_S = 5.0
"""After a start of a pinned model failed (no room, a node going away), the next try waits
this long: a pass runs every quarter second."""


def pinned(records: Iterable[ModelRecord]) -> list[ModelRecord]:
    """The pinned records, the highest priority first (then by name: a stable order)."""
    return sorted((r for r in records if r.min_instances > 0), key=lambda r: (-r.priority, r.name))


class AdapterPin(Protocol):
    """What keep-warm reads of an adapter (`shared.adapters.AdapterRecord` has it)."""

    @property
    def base(self) -> str: ...
    @property
    def min_instances(self) -> int: ...
    @property
    def priority(self) -> int: ...


def with_adapter_pins(records: Iterable[ModelRecord], adapters: Iterable[AdapterPin]) -> list[ModelRecord]:
    """Each base as its pinned adapters keep it: an adapter runs on its base's instances, so an
    adapter pinned with `min_instances` keeps that many of its base warm, and the base is kept at
    the highest of its own and its adapters' priorities (a pinned adapter stays loaded there:
    `shared.adapters.adapter_ref`)."""
    pins: dict[str, tuple[int, int]] = {}
    for a in adapters:
        k, p = pins.get(a.base, (0, a.priority))
        pins[a.base] = (max(k, a.min_instances), max(p, a.priority))
    out = []
    for r in records:
        if r.name in pins:
            k, p = pins[r.name]
            r = msgspec.structs.replace(r, min_instances=max(r.min_instances, k), priority=max(r.priority, p))
        out.append(r)
    return out


def restore(
    records: Iterable[ModelRecord],
    nodes: Sequence[NodeState],
    profiles: Mapping[str, Profile],
    now: float,
    failed_at: Mapping[str, float],
    retry_s: float = RETRY_S,
) -> list[tuple[str, str]]:
    """The starts, (model, node), that bring each pinned model up to its `min_instances`: on
    the nodes that neither run nor start it (`nodes`: the live ones, with the starts under way
    as `scheduling.with_starts` adds them), the best first as a scale-out orders them, the
    highest priority first. A model whose last start failed less than `retry_s` before `now`
    waits. Fewer where fewer nodes can take it."""
    view = list(nodes)
    starts: list[tuple[str, str]] = []
    for r in pinned(records):
        if now - failed_at.get(r.name, float("-inf")) < retry_s:
            continue
        for node_id in scale_out_nodes(r.name, view, profiles, r.min_instances):
            starts.append((r.name, node_id))
            # The next model's choice sees this start (starts share a node's cores).
            view = [replace(n, starting=n.starting | {r.name}) if n.node_id == node_id else n for n in view]  # type: ignore[type-var]
    return starts


@dataclass(frozen=True)
class Need:
    """What one pinned model holds on every node that keeps it warm."""

    name: str
    artifact_id: str
    weight_bytes: int
    """Shared by every name on its artifact on one node."""
    kv_bytes: int
    """What a start reserves for its KV cache (the L_min floor)."""
    instances: int
    adapter_bytes: int = 0
    """Its pinned adapters', loaded on each of its instances."""
    kv_on_demand_bytes: int = 0
    """The floor on a node whose cache grows as its rows fill (`kv_watermark.floor_tokens`):
    only an operator's `TESSERA_KV_MIN_TOKENS`."""


def need_of(record: ModelRecord, kv_min_tokens: int, adapter_bytes: int = 0) -> Need:
    """A record's footprint as the scheduler estimates a start's (`PerfBook.profiles`): its
    weights and the KV cache of its L_min floor; `adapter_bytes`: of its pinned adapters."""
    a = record.artifact
    kv, on_demand = (
        a.kv_bytes_per_token * floor_tokens(kv_min_tokens, a.context_length, on_demand) for on_demand in (False, True)
    )
    return Need(record.name, a.artifact_id, a.weight_bytes, kv, record.min_instances, adapter_bytes, on_demand)


@dataclass(frozen=True)
class Fit:
    ok: bool
    needed_bytes: int
    """What the pinned models hold in all (each artifact's weights once per node it is on)."""
    available_bytes: int
    """The nodes' memory budgets, summed."""


def fit(needs: Iterable[Need], budgets: Sequence[int], on_demand: Sequence[bool] = ()) -> Fit:
    """Whether nodes of these memory `budgets` hold every pinned model's instances at once, each
    instance of a model on a node of its own (first fit, the biggest first; names sharing an
    artifact share its weights on a node). `on_demand[i]`: node i's cache grows as its rows fill
    (no KV floor booked there unless an operator set one); none given: no node's does."""
    needs = [n for n in needs if n.instances > 0]
    flags = list(on_demand) or [False] * len(budgets)
    everywhere = bool(flags) and all(flags)  # what the total counts, for the message
    copies: dict[str, int] = {}
    for n in needs:
        copies[n.artifact_id] = max(copies.get(n.artifact_id, 0), n.instances)
    weights = {n.artifact_id: n.weight_bytes for n in needs}
    needed = sum(weights[a] * k for a, k in copies.items()) + sum(_own(n, everywhere) * n.instances for n in needs)
    nodes = [_Node(room, flag) for room, flag in zip(budgets, flags, strict=True)]
    ok = True
    for n in sorted(needs, key=lambda n: (-(n.weight_bytes + _own(n, everywhere)), n.name)):
        for _ in range(n.instances):
            ok = ok and any(node.take(n) for node in nodes)
    return Fit(ok, needed, sum(budgets))


def _own(n: Need, on_demand: bool) -> int:
    """What each instance holds beside the weights it shares."""
    return (n.kv_on_demand_bytes if on_demand else n.kv_bytes) + n.adapter_bytes


@dataclass
class _Node:
    free: int
    on_demand: bool = False
    names: set[str] = field(default_factory=set)
    artifacts: set[str] = field(default_factory=set)
    """The artifacts whose weights are counted here already."""

    def take(self, n: Need) -> bool:
        """Hold an instance of `n` here if it fits (one instance of a model per node)."""
        cost = _own(n, self.on_demand) + (0 if n.artifact_id in self.artifacts else n.weight_bytes)
        if n.name in self.names or cost > self.free:
            return False
        self.free -= cost
        self.names.add(n.name)
        self.artifacts.add(n.artifact_id)
        return True
