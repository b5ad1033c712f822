"""Placement and keep-alive: pure functions of the cluster view and a clock.

With a demand and the models' profiles, `place` runs shadow validation and affinity
(`placement.py`: LLM-Mesh §5.3, §7.2; Tangram §3.4); without them (no measurement yet) it
falls back to the least busy instance, or the least loaded node for a start.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import TypeVar

from policy import defrag, placement
from policy.eviction import may_take
from policy.placement import Demand, NodeState, Profile
from policy.slo import ttft_slo
from shared.messages import ErrorCode, InstanceView, NodeStatus, Rejected, Tier


@dataclass(frozen=True)
class NodeView:
    node_id: str
    seen_at: float
    instances: Mapping[str, InstanceView] = field(default_factory=dict)
    starting: frozenset[str] = frozenset()
    kind: str = "cpu"
    resident: frozenset[str] = frozenset()
    """Artifacts whose weights this node keeps loaded with no instance."""
    memory_budget_bytes: int = 0
    memory_used_bytes: int = 0
    max_batch: int = 1
    """Requests one worker here decodes together."""
    join_recompute_tokens: int = 0
    """A request joins a running batch here while its rows hold at most this many tokens."""
    prewarmed: int = 0
    """Idle worker processes here: a start loads into one rather than spawn one."""
    continuous_batching: bool = False
    """Its engine adds a request to the running batch after that request's own prefill,
    prefills first (vLLM's scheduler, LLM-Mesh's engine), rather than batch as `max_batch` and
    `join_recompute_tokens` say (this project's OpenVINO engine)."""
    core_build_s: float = 0.0
    """Seconds a new instance here builds its engine core beside the neighbours (0: none)."""
    kv_on_demand: bool = False
    """A start here books no L_min floor for its KV cache (`NodeStatus.kv_on_demand`)."""
    prefill_slack_s: float = math.inf
    """How long one more prefill may hold up the requests there (a continuous-batching engine
    runs it ahead of their next tokens): the least eq. 1 headroom among them once the prefills
    already queued have run, as of `seen_at`, where the engine reports it (inf: not reported)."""
    reusable: Mapping[str, float] = field(default_factory=dict)
    """Artifacts part of whose weights this node keeps (the share of their bytes)."""

    @classmethod
    def from_status(cls, status: NodeStatus) -> NodeView:
        return cls(
            node_id=status.node_id,
            seen_at=status.sent_at,
            instances={i.model: i for i in status.instances},
            starting=frozenset(status.starting),
            kind=status.kind,
            resident=frozenset(status.resident),
            reusable=dict(status.reusable),
            memory_budget_bytes=status.memory_budget_bytes,
            memory_used_bytes=status.memory_used_bytes,
            max_batch=max(1, status.max_batch),
            join_recompute_tokens=status.join_recompute_tokens,
            prewarmed=status.prewarmed,
            continuous_batching=status.continuous_batching,
            core_build_s=status.core_build_s,
            kv_on_demand=status.kv_on_demand,
        )


@dataclass(frozen=True)
class UseNode:
    """An instance of the model runs there: send the request to it."""

    node_id: str
    scale_out_to: str | None = None
    """Also start another instance there, not waiting for it: no running instance validates
    this request, a start would not serve it sooner, and the next ones need the room."""
    preempt: tuple[str, ...] = ()
    """First preempt these neighbours there (LLM-Mesh §7.1): with them gone, it validates."""
    why: str = field(default="", compare=False)


@dataclass(frozen=True)
class StartUnderWay:
    """A start of a model this scheduler ordered and is waiting for."""

    node_id: str
    since: float = 0.0
    waiting: int = 0
    """Requests waiting for it."""


@dataclass(frozen=True)
class AwaitStart:
    """A start of the model is already under way there: wait for it, do not start another."""

    node_id: str


@dataclass(frozen=True)
class StartOn:
    """No instance anywhere: cold-start one on this node."""

    node_id: str
    why: str = field(default="", compare=False)
    """For a scale-out: why no running instance took the request (the operator's log)."""


@dataclass(frozen=True)
class NoRoom:
    """Every node the request could go to would break the SLOs of requests already there (or
    hold none of its KV), and no start would serve it: it waits for room (the scheduler's
    line, woken as requests end) for as long as it may, and then `otherwise`."""

    otherwise: UseNode | Rejected
    """With admission on (`reject_over_slo`), a refusal; else the least busy instance, where it
    queues whatever the others' decode rounds become."""


Decision = UseNode | AwaitStart | StartOn | Rejected | NoRoom


@dataclass(frozen=True)
class StopOrder:
    node_id: str
    model: str
    idle_since: float


N = TypeVar("N", bound=NodeState)
"""A node as the caller holds it (the scheduler's `NodeView`, the simulator's nodes): the
filters below hand back what they are given."""


def live_nodes(nodes: Iterable[N], now: float, node_timeout_s: float) -> list[N]:
    return [n for n in nodes if now - n.seen_at <= node_timeout_s]


def with_starts(nodes: Iterable[N], starts: Iterable[tuple[str, str]]) -> list[N]:
    """The views with the starts this scheduler has ordered, (model, node) pairs, where no
    heartbeat shows them yet: a burst of first requests for several models is placed within
    milliseconds, and would all land on the node that looked emptiest (measured: three
    starts at once on one 2/3-core node took 11 s each)."""
    by_node: dict[str, set[str]] = {}
    for m, node_id in starts:
        by_node.setdefault(node_id, set()).add(m)
    out = []
    for n in nodes:
        unseen = by_node.get(n.node_id)
        if unseen and (unseen := unseen - n.starting - n.instances.keys()):
            n = replace(n, starting=n.starting | unseen)  # type: ignore[type-var]
        out.append(n)
    return out


def place(
    model: str,
    nodes: Iterable[NodeState],
    starts_in_flight: Mapping[str, StartUnderWay],
    now: float,
    *,
    node_timeout_s: float,
    max_active_per_instance: int,
    demand: Demand | None = None,
    profiles: Mapping[str, Profile] | None = None,
    exclusive: bool = False,
    reject_over_slo: float | None = None,
    joins: Joins | None = None,
    priorities: Mapping[str, int] | None = None,
    pinned: AbstractSet[str] = frozenset(),
) -> Decision:
    """Where a request for `model` goes. `starts_in_flight`: the starts under way, by model
    (the latest, where a model has several).

    `reject_over_slo`: refuse (429, Retry-After) a request whose predicted first token is more
    than this many TTFT SLOs away, or that no node takes without breaking the SLOs of requests
    already there, rather than queue it (None: always queue).

    `joins`: what `first_join` found over the nodes running the model, where the caller asked
    it first (`nodes` must hold those nodes too).

    `priorities`, `pinned` (issue 35, keep warm): a preemption for this request takes the
    lowest priorities first (0 where not named), and a pinned model only where this request's
    model has a higher priority.

    `exclusive`: the baseline the papers compare with (Knative, ServerlessLLM): an instance
    has its node to itself, requests queue on the model's one instance, and a model with no
    instance starts only on a node running nothing."""
    live = with_starts(live_nodes(nodes, now, node_timeout_s), ((m, s.node_id) for m, s in starts_in_flight.items()))
    start = starts_in_flight.get(model)
    profiles = profiles or {}
    measured = demand is not None and model in profiles
    if start is not None and not (measured and any(model in n.instances for n in live)):
        return AwaitStart(start.node_id)  # a first start: nothing else serves the model yet
    if not live:
        return Rejected(code=ErrorCode.UNAVAILABLE, message="no engine node is alive", retry_after_s=2.0)
    if exclusive:
        return _place_exclusive(model, live, max_active_per_instance, {s.node_id for s in starts_in_flight.values()})
    if demand is not None and model in profiles:
        ranks = Ranks(priorities or {}, pinned)
        return _place_validated(
            model, live, start, now, max_active_per_instance, demand, profiles, reject_over_slo, joins, ranks
        )
    return _fallback(model, live, max_active_per_instance, profiles.get(model))


def _place_validated(
    model: str,
    live: list[NodeState],
    start: StartUnderWay | None,
    now: float,
    max_active_per_instance: int,
    demand: Demand,
    profiles: Mapping[str, Profile],
    reject_over_slo: float | None,
    joins: Joins | None,
    ranks: Ranks,
) -> Decision:
    # Shadow validation: join the first instance where nobody would miss an SLO...
    if joins is None:
        joins = _join(model, live, max_active_per_instance, demand, profiles)
    if joins.joined is not None:
        return joins.joined
    why = "; ".join(joins.refusals)
    options: list[tuple[float, bool, Decision]] = [(t, False, d) for t, d in joins.late]
    crowded = joins.crowded
    # ... else make room in an instance whose neighbours' decode rounds are in its way,
    # preempting smaller ones that validate elsewhere (§7.1: a bigger instance rather than a
    # new fragment) ...
    for n in crowded:
        others = [o for o in live if o.node_id != n.node_id]
        moves = functools.partial(_preemptible, model=model, ranks=ranks, others=others, profiles=profiles)
        victims = placement.preemption_for(n, model, demand, profiles, moves, ranks.priorities)
        if victims:
            return UseNode(n.node_id, preempt=victims, why=why)
    spare: NodeState | None = None
    if start is not None:
        # ... else the start under way, if it serves it in time ...
        at = next((n for n in live if n.node_id == start.node_id), None)
        if at is not None:
            v = placement.validate(
                at, model, demand, profiles, start_elapsed_s=now - start.since, start_waiting=start.waiting
            )
            if v.ok:
                return AwaitStart(start.node_id)
            if v.failure is placement.Failure.NEW_LATE:
                options.append((v.ttft_s, True, AwaitStart(start.node_id)))
    if not _scale_out_warming(model, live):
        # ... else scale out (another start, if the one under way cannot serve it in time)
        # where the model can start soonest and validates: this request waits for the start
        # if that is its soonest first token, else the new instance starts for the requests
        # after it.
        for n in placement.start_order(
            [n for n in live if model not in n.instances and model not in n.starting], profiles[model], profiles
        ):
            v = placement.validate(n, model, demand, profiles)
            if v.ok:
                return StartOn(n.node_id, why)
            if v.failure is placement.Failure.NEW_LATE:
                options.append((v.ttft_s, True, StartOn(n.node_id, why)))
                if spare is None and placement.validate(n, model, demand, profiles, start_elapsed_s=float("inf")).ok:
                    spare = n
    # ... else this request misses its TTFT wherever it goes: the soonest first token wins,
    # a queue or a new instance, as long as it keeps the node's decode rounds within every
    # TPOT SLO.
    if not options:
        # Every node it could go to would break the SLOs of requests already there (or hold
        # none of its KV): it waits for room rather than make them late, and then, with
        # admission on, is refused.
        if reject_over_slo is not None:
            return NoRoom(
                Rejected(
                    code=ErrorCode.OVERLOADED,
                    message=f"no node can take a request for {model!r} without breaking the SLOs of "
                    "requests already there; retry shortly",
                    retry_after_s=1.0,
                )
            )
        queued = _fallback(model, live, max_active_per_instance, profiles[model])
        return NoRoom(queued) if isinstance(queued, UseNode | Rejected) else queued
    ttft, _, decision = min(options, key=lambda o: (o[0], o[1]))
    if reject_over_slo is not None and ttft > reject_over_slo * demand.ttft_slo_s:
        # Admission: so far past its SLO that queueing it only delays the requests that can
        # still make theirs. Say so now, with when to come back.
        return Rejected(
            code=ErrorCode.OVERLOADED,
            message=f"model {model!r} would answer in about {ttft:.1f} s, past its "
            f"{demand.ttft_slo_s:.3g} s TTFT SLO for {demand.prompt_tokens} prompt tokens; retry shortly",
            retry_after_s=max(1.0, ttft - demand.ttft_slo_s),
        )
    if isinstance(decision, UseNode) and spare is not None:
        return UseNode(decision.node_id, scale_out_to=spare.node_id, why=why)
    return decision


@dataclass(frozen=True)
class Ranks:
    """Models' priorities and the pinned ones among them (issue 35): whom a preemption takes."""

    priorities: Mapping[str, int] = field(default_factory=dict)
    pinned: AbstractSet[str] = frozenset()

    def may_preempt(self, victim: str, for_model: str) -> bool:
        p = self.priorities.get
        return may_take(p(victim, 0), victim in self.pinned, p(for_model, 0))


@dataclass(frozen=True)
class Joins:
    """Shadow validation of a request against the model's running instances."""

    joined: UseNode | None
    """The first instance that validates it."""
    refusals: tuple[str, ...] = ()
    """Else why each refused (the operator's log)."""
    late: tuple[tuple[float, UseNode], ...] = ()
    """The ones that would only be late for it, with its predicted first token there."""
    crowded: tuple[NodeState, ...] = ()
    """The ones whose neighbours' decode rounds are in its way (§7.1 may preempt them)."""


def _join(
    model: str, live: Iterable[NodeState], max_active_per_instance: int, demand: Demand, profiles: Mapping[str, Profile]
) -> Joins:
    late: list[tuple[float, UseNode]] = []
    refusals: list[str] = []
    crowded: list[NodeState] = []
    for n in placement.join_order(live, model):
        if n.instances[model].active >= max_active_per_instance:
            refusals.append(f"{n.node_id}: at its limit of {max_active_per_instance}")
            continue
        v = placement.validate(n, model, demand, profiles)
        if v.ok:
            return Joins(UseNode(n.node_id))
        refusals.append(f"{n.node_id}: {v.failure} (ttft {v.ttft_s:.2f} s, round {v.round_s:.3f} s)")
        if v.failure is placement.Failure.NEW_LATE:
            late.append((v.ttft_s, UseNode(n.node_id)))
        elif v.failure is placement.Failure.ROUND_TOO_LONG:
            crowded.append(n)
    return Joins(None, tuple(refusals), tuple(late), tuple(crowded))


def first_join(
    model: str,
    running: Iterable[NodeState],
    *,
    max_active_per_instance: int,
    demand: Demand,
    profiles: Mapping[str, Profile],
) -> Joins | None:
    """What `place` decides first, from the nodes running the model alone: `Joins.joined` is
    the first of their instances that validates the request. A caller with many nodes to
    gather tries this first, and gathers them (for a start) only when none does, passing
    this to `place` as `joins`. None: the model was never measured (`place` falls back)."""
    if model not in profiles:
        return None
    return _join(model, running, max_active_per_instance, demand, profiles)


def scale_out_nodes(
    model: str, nodes: Iterable[NodeState], profiles: Mapping[str, Profile], instances: int
) -> list[str]:
    """The nodes a scale-out of `model` to `instances` instances in all starts it on: as many
    as are missing, best first by `placement.start_order` (the node kind, then where its
    weights, or part of them, are resident), among the nodes neither running nor starting it
    (`nodes` as `with_starts` makes them). Fewer where fewer nodes have room for it."""
    nodes = list(nodes)
    have = [n for n in nodes if model in n.instances or model in n.starting]
    others = [n for n in nodes if not (model in n.instances or model in n.starting)]
    order = placement.start_order(others, profiles.get(model), profiles)
    return [n.node_id for n in order][: max(0, instances - len(have))]


def relocatable(model: str, others: Iterable[NodeState], profiles: Mapping[str, Profile]) -> bool:
    """Whether a typical request of `model` validates on one of `others` (joining its instance
    there or a new one): LLM-Mesh §7.1 preempts an instance only if its requests can go on
    elsewhere within their SLOs."""
    p = profiles.get(model)
    if p is None:
        return False  # never measured: nothing to validate with
    prompt = defrag.TYPICAL_PROMPT_TOKENS
    typical = Demand(prompt, placement.TYPICAL_COMPLETION_TOKENS, ttft_slo(p, prompt), p.tpot_slo_s)
    return any(placement.validate(o, model, typical, profiles).ok for o in others)


def _preemptible(
    victim: str, *, model: str, ranks: Ranks, others: Iterable[NodeState], profiles: Mapping[str, Profile]
) -> bool:
    """§7.1's condition (`relocatable`), and that its priority lets `model` take it."""
    return ranks.may_preempt(victim, model) and relocatable(victim, others, profiles)


def _scale_out_warming(model: str, live: list[NodeState]) -> bool:
    """Whether the model was scaled out and an instance of it still serves its START tier:
    not the time for another. It is about to tier up (faster), the compile shares its node's
    cores, and predictions made meanwhile run long (measured on 2/3-core nodes: a second
    scale-out 5 s after the first, then the neighbours it crowded scaled out in turn)."""
    running = [n.instances[model] for n in live if model in n.instances]
    return len(running) > 1 and any(i.tier == Tier.START for i in running)


def _least_busy(model: str, live: list[NodeState], max_active_per_instance: int) -> UseNode | Rejected | None:
    """The model's least busy instance, or OVERLOADED where even that one is at its limit;
    None where the model runs nowhere."""
    running = [(n, n.instances[model]) for n in live if model in n.instances]
    if not running:
        return None
    node, inst = min(running, key=lambda pair: (pair[1].active, pair[0].node_id))
    if inst.active >= max_active_per_instance:
        return Rejected(
            code=ErrorCode.OVERLOADED,
            message=f"model {model!r} is at its limit of {max_active_per_instance} "
            "concurrent requests per instance; retry shortly",
            retry_after_s=1.0,
        )
    return UseNode(node.node_id)


def _fallback(model: str, live: list[NodeState], max_active_per_instance: int, profile: Profile | None) -> Decision:
    """Placement without a measurement to go by (none yet, or every candidate would break a
    neighbour's TPOT): the least busy instance, else a start where the model can start
    soonest (its weights resident), else spread."""
    least = _least_busy(model, live, max_active_per_instance)
    if least is not None:
        return least
    order = placement.start_order(live, profile)
    target = order[0] if order else min(live, key=lambda n: (len(n.instances) + len(n.starting), n.node_id))
    return StartOn(target.node_id)


def _place_exclusive(
    model: str, live: list[NodeState], max_active_per_instance: int, starting_on: set[str]
) -> Decision:
    least = _least_busy(model, live, max_active_per_instance)
    if least is not None:
        return least
    # A node a start is under way on is taken, though no heartbeat may say so yet.
    free = [n for n in live if not n.instances and not n.starting and n.node_id not in starting_on]
    if not free:
        return Rejected(
            code=ErrorCode.NO_CAPACITY,
            message="every node is taken by another model's instance (exclusive placement); retry shortly",
            retry_after_s=1.0,
        )
    return StartOn(min(free, key=lambda n: n.node_id).node_id)


def idle_instances(
    nodes: Iterable[NodeState],
    keep_alive_s: Mapping[str, float],
    last_placed: Mapping[tuple[str, str], float],
    now: float,
    min_instances: Mapping[str, int] | None = None,
) -> list[StopOrder]:
    """Instances idle past their model's keep-alive (or of a model no longer registered), but
    for a model kept warm (`min_instances`, issue 35) none that would leave it fewer than that:
    only its idlest instances beyond them."""
    nodes = list(nodes)
    orders = _past_keep_alive(nodes, keep_alive_s, last_placed, now)
    floors = {m: k for m, k in (min_instances or {}).items() if k > 0}
    if not floors:
        return orders
    running = Counter(m for n in nodes for m in n.instances)
    kept: list[StopOrder] = []
    for order in sorted(orders, key=lambda o: (o.idle_since, o.node_id)):  # the idlest first
        if running[order.model] > floors.get(order.model, 0):
            running[order.model] -= 1
            kept.append(order)
    return kept


def _past_keep_alive(
    nodes: Iterable[NodeState],
    keep_alive_s: Mapping[str, float],
    last_placed: Mapping[tuple[str, str], float],
    now: float,
) -> list[StopOrder]:
    orders = []
    for node in nodes:
        for model, inst in node.instances.items():
            if inst.active > 0:
                continue
            last = max(inst.last_used, last_placed.get((node.node_id, model), 0.0))
            keep = keep_alive_s.get(model)
            if keep is None or now - last >= keep:
                orders.append(StopOrder(node.node_id, model, last))
    return orders
