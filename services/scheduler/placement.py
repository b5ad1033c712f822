"""SLO-aware placement: shadow validation (LLM-Mesh §5.3) for the engine as it runs, and
affinity for scale-out (Tangram §3.4).

The engine runs an instance's requests in batches (a worker process decodes up to the node's
`max_batch` together; requests that arrive meanwhile join it or wait for the next batch), and
the instances of a node take turns on its cores, one iteration at a time, the least headroom
first (the engine's gate, `services/engine/step_gate.py`). So, for a request joining an
instance:

1. it waits for the batches ahead of it on that instance to finish, then prefills with the
   batch it joins: that must fit in its TTFT SLO (LLM-Mesh's case 1, "the new request misses");
2. while it decodes, every instance decoding on the node takes one iteration (of its batch)
   per round on shared cores: the round must fit in the tightest TPOT SLO among them (case 3,
   "a decode round exceeds the TPOT"; it is also what protects the requests already there,
   case 2).

Every predicted time is taken 10 % longer (§5.3's overestimate). Times come from a
performance model per model fitted from the engine's measurements (§5.2, `perf_model.py`).
Candidates are tried CPU nodes first, then the busiest instance first (§7.2: bin-packing
lets small instances drain, and scale-in can take them). When none validates, a scale-out
goes to the node that can start the model soonest: the one that still holds its weights
(Tangram's reusable tensors), else the one with the most room.

Pure: the cluster view, the model profiles and a demand in; a decision out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler.affinity import Offer, rank_nodes
from services.scheduler.perf_model import PerfModel
from services.scheduler.shadow import OVERESTIMATE, Failure

if TYPE_CHECKING:
    from services.scheduler.policy import NodeView

TYPICAL_COMPLETION_TOKENS = 128
"""What a request ahead in the queue is assumed to generate when nothing better is known:
`max_tokens` defaults to the whole context, which would make every queue look endless."""
LOAD_BANDWIDTH_BPS = 1e9
"""Bytes per second a start reads weights at (store or host cache): only ranks nodes."""
KIND_ORDER = ("cpu", "gpu")
RESIDENT_START_S = 0.1
"""A start whose weights are still loaded in an idle worker (measured ≈ 0.08 s)."""


@dataclass(frozen=True)
class Demand:
    prompt_tokens: int
    max_tokens: int
    ttft_slo_s: float
    tpot_slo_s: float


@dataclass(frozen=True)
class Profile:
    """What placement knows of a model: its performance, SLOs and footprint."""

    perf: PerfModel
    ttft_slo_s: float
    tpot_slo_s: float
    artifact_id: str = ""
    weight_bytes: int = 0
    kv_bytes: int = 0
    start_s: float = 1.0
    """Expected seconds for a start that must load the weights (measured starts' median)."""


@dataclass(frozen=True)
class Verdict:
    ok: bool
    failure: Failure | None = None
    ttft_s: float = 0.0
    round_s: float = 0.0


def _tokens(max_tokens: int) -> int:
    return max(1, min(max_tokens, TYPICAL_COMPLETION_TOKENS))


def service_s(perf: PerfModel, prompt_tokens: int, tokens: int, batch: int = 1) -> float:
    """A batch of `batch` such requests from prefill to its last token, alone on its instance."""
    return (perf.prefill_s(prompt_tokens * batch)
            + max(tokens - 1, 0) * perf.decode_s(batch, prompt_tokens + tokens / 2))


def validate(
    node: NodeView,
    model: str,
    demand: Demand,
    profiles: Mapping[str, Profile],
    overestimate: float = OVERESTIMATE,
) -> Verdict:
    """Whether a request for `model` may join its instance on `node` (or a new instance there,
    if it has none) without anyone on the node missing an SLO."""
    own = profiles.get(model)
    if own is None:
        return Verdict(False)  # never measured: nothing to validate with
    perf = own.perf
    tokens = _tokens(demand.max_tokens)
    inst = node.instances.get(model)
    # Names on one artifact share a worker: every request on that worker is ahead, whichever
    # name it came for. Taken as running or queued in full batches ahead of this one (the
    # request may find the worker idle, or join a batch that is still forming: this errs long).
    ahead = 0
    if inst is not None:
        ahead = inst.active if not inst.worker_pid else sum(
            v.active for v in node.instances.values() if v.worker_pid == inst.worker_pid)
    width = max(1, node.max_batch)
    batches_ahead = -(-ahead // width)
    batch_ahead = min(ahead, width)
    # A new instance must start first: quickly where its weights are resident, else a load.
    ready_in = 0.0 if inst is not None else (RESIDENT_START_S if own.artifact_id in node.resident else own.start_s)
    ttft = overestimate * (ready_in + batches_ahead * service_s(perf, demand.prompt_tokens, tokens, batch_ahead)
                           + perf.prefill_s(demand.prompt_tokens))
    # The engine lets a request join the running batch (re-prefilling its rows with it) while
    # the rows hold few enough tokens: then it waits for no batch, only that prefill. The rows
    # are taken as this request's size, halfway through their output (errs long for a burst).
    held = ahead * (demand.prompt_tokens + tokens / 2)
    if 0 < ahead < width and held <= node.join_recompute_tokens:
        ttft = min(ttft, overestimate * perf.prefill_s(int(held) + demand.prompt_tokens))
    if ttft > demand.ttft_slo_s:
        return Verdict(False, Failure.NEW_LATE, ttft)
    length = demand.prompt_tokens + tokens / 2
    round_s = perf.decode_s(min(ahead + 1, width), length)
    tightest = demand.tpot_slo_s
    # One decode iteration (of its batch) per busy worker per round.
    counted = {inst.worker_pid} if inst is not None and inst.worker_pid else set()
    for other, view in node.instances.items():
        if other == model or view.active == 0:
            continue
        p = profiles.get(other)
        if p is None:
            continue  # unknown to us (just registered, never measured): nothing to weigh
        tightest = min(tightest, p.tpot_slo_s)
        if view.worker_pid and view.worker_pid in counted:
            continue
        counted.add(view.worker_pid)
        busy = view.active if not view.worker_pid else sum(
            v.active for v in node.instances.values() if v.worker_pid == view.worker_pid)
        round_s += p.perf.decode_s(min(busy, width), length)
    round_s *= overestimate
    if round_s > tightest:
        return Verdict(False, Failure.ROUND_TOO_LONG, ttft, round_s)
    return Verdict(True, None, ttft, round_s)


def kind_rank(kind: str) -> int:
    return KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)


def join_order(nodes: Iterable[NodeView], model: str) -> list[NodeView]:
    """Nodes running `model`, in the order shadow validation tries them: CPU first, then the
    busiest instance first."""
    running = [n for n in nodes if model in n.instances]
    return sorted(running, key=lambda n: (kind_rank(n.kind), -n.instances[model].active, n.node_id))


def start_order(nodes: Iterable[NodeView], profile: Profile | None) -> list[NodeView]:
    """Nodes that could start the model, best first: CPU first, then the soonest start (its
    weights still resident there: Tangram's affinity), then the fewest instances (they share
    the node's cores), then the tightest fit. A node whose memory is known to be too small is
    left out."""
    nodes = list(nodes)
    if profile is None:
        return sorted(nodes, key=lambda n: (kind_rank(n.kind), len(n.instances) + len(n.starting), n.node_id))
    offers = []
    for n in nodes:
        free = n.memory_budget_bytes - n.memory_used_bytes if n.memory_budget_bytes else 1 << 62
        reusable = profile.weight_bytes if profile.artifact_id in n.resident else 0
        offers.append(Offer(n.node_id, n.kind, max(free, 0), reusable, LOAD_BANDWIDTH_BPS))
    fits = {c.node_id: c for c in rank_nodes(profile.weight_bytes, profile.weight_bytes + profile.kv_bytes, offers)}
    by_id = {o.node_id: o for o in offers}
    feasible = [n for n in nodes if n.node_id in fits]
    return sorted(feasible, key=lambda n: (
        kind_rank(n.kind), round(fits[n.node_id].load_s, 3), -by_id[n.node_id].reusable_bytes,
        len(n.instances) + len(n.starting), by_id[n.node_id].free_bytes, n.node_id))
