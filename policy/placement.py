"""SLO-aware placement: shadow validation (LLM-Mesh §5.3) for the engine as it runs, and
affinity for scale-out (Tangram §3.4).

The engine runs an instance's requests in batches (a worker process decodes up to the node's
`max_batch` together; requests that arrive meanwhile join it or wait for the next batch), and
the instances of a node take turns on its cores, one iteration at a time, the least headroom
first (the engine's gate, `services/engine/step_gate.py`). So, for a request joining an
instance:

1. its first token must come within its TTFT SLO: it joins the running batch (the engine
   re-prefills the batch's rows with the newcomers while they hold few enough tokens), or
   waits for that batch and the queued ones to end (`first_token_wait_s`; engines report
   each instance's running rows and the tokens they hold). LLM-Mesh's case 1, "the new
   request misses";
2. while it decodes, every instance decoding on the node takes one iteration (of its batch)
   per round on shared cores: the round must fit in the tightest TPOT SLO among them (case 3,
   "a decode round exceeds the TPOT"; it is also what protects the requests already there,
   case 2).

A continuous-batching node (vLLM's scheduler, LLM-Mesh's own engine, the simulator's nodes)
prefills first: the request waits for every prompt queued on the node, and its prefill, run
ahead of everyone's next token, must fit in the slack the requests there have left
(`prefill_slack_s`: case 2, "an existing request misses"). This is the shadow validation the
scheduler and the simulator run; LLM-Mesh Fig. 6's cases are its tests.

Every predicted time is taken 10 % longer (§5.3's overestimate). Times come from a
performance model per model fitted from the engine's measurements (§5.2, `perf_model.py`).
Candidates are tried CPU nodes first, then the busiest instance first (§7.2: bin-packing
lets small instances drain, and scale-in can take them). When none validates, a scale-out
goes to the node that can start the model soonest: the one that still holds its weights
(Tangram's reusable tensors), else the one with the most room. When the start itself would
make the request late, the request takes the soonest first token it can get and the new
instance starts anyway for the requests after it (`scheduling.py`).

Pure: the cluster view, the model profiles and a demand in; a decision out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from policy.affinity import start_s_if_fits
from policy.perf_model import PerfModel
from shared.messages import TTFT_SLO_PER_TOKEN_S

OVERESTIMATE = 1.1
"""§5.3: each predicted iteration is taken 10% longer than the model says (runtime noise, and
sentence lengths that grow during decode)."""
TYPICAL_COMPLETION_TOKENS = 128
"""What a request ahead in the queue is assumed to generate when nothing better is known:
`max_tokens` defaults to the whole context, which would make every queue look endless."""
LOAD_BANDWIDTH_BPS = 1e9
"""Bytes per second a start reads weights at (store or host cache): only ranks nodes."""
KIND_ORDER = ("cpu", "gpu")
RESIDENT_START_S = 0.1
"""A start whose weights are still loaded in an idle worker (measured ≈ 0.08 s)."""
CORE_BUILD_SLOWDOWN = 2.0
"""How much longer the neighbours' decode rounds take while a new instance builds its engine
core on their node (`NodeState.core_build_s`: ≈ 2.4 core-seconds compiling): the build's
threads and theirs split the node's cores. On bench/cluster.py's 0.667-core nodes a build
took 8–12 s of wall time (its engines' logs), longer than a request's few seconds of decode,
so its neighbours' requests run beside it from first token to last."""


class Failure(StrEnum):
    """Why a request may not join (LLM-Mesh Fig. 6's three cases)."""

    NEW_LATE = "new_request_late"
    EXISTING_LATE = "existing_request_late"
    ROUND_TOO_LONG = "decode_round_exceeds_tpot"


class InstanceState(Protocol):
    """What placement reads of an instance (`shared.messages.InstanceView`; the simulator's
    instances, `bench/sim/`)."""

    @property
    def active(self) -> int: ...
    @property
    def running(self) -> int: ...
    @property
    def held_tokens(self) -> int: ...
    @property
    def queued_tokens(self) -> int: ...
    @property
    def worker_pid(self) -> int: ...
    @property
    def tier(self) -> str: ...
    @property
    def last_used(self) -> float: ...
    @property
    def ready_in_s(self) -> float: ...


class NodeState(Protocol):
    """What placement reads of a node (`policy.NodeView`, built from heartbeats; the
    simulator's nodes): one policy for both."""

    @property
    def node_id(self) -> str: ...
    @property
    def seen_at(self) -> float: ...
    @property
    def instances(self) -> Mapping[str, InstanceState]: ...
    @property
    def starting(self) -> AbstractSet[str]: ...
    @property
    def kind(self) -> str: ...
    @property
    def resident(self) -> AbstractSet[str]: ...
    @property
    def reusable(self) -> Mapping[str, float]: ...
    @property
    def memory_budget_bytes(self) -> int: ...
    @property
    def memory_used_bytes(self) -> int: ...
    @property
    def max_batch(self) -> int: ...
    @property
    def join_recompute_tokens(self) -> int: ...
    @property
    def prewarmed(self) -> int: ...
    @property
    def continuous_batching(self) -> bool: ...
    @property
    def prefill_slack_s(self) -> float: ...
    @property
    def core_build_s(self) -> float: ...
    @property
    def kv_on_demand(self) -> bool: ...


@dataclass(frozen=True)
class Demand:
    prompt_tokens: int
    max_tokens: int
    ttft_slo_s: float
    """This request's TTFT SLO: its model's grown to its prompt (`policy.slo.ttft_slo`)."""
    tpot_slo_s: float


@dataclass(frozen=True)
class Profile:
    """What placement knows of a model: its performance, SLOs and footprint."""

    perf: PerfModel
    ttft_slo_s: float
    """The floor of its TTFT SLO (`policy.slo.ttft_slo`): a short prompt's."""
    tpot_slo_s: float
    artifact_id: str = ""
    weight_bytes: int = 0
    kv_bytes: int = 0
    """What a start books for its KV cache: the L_min floor (`policy.kv_watermark.floor_tokens`)."""
    start_s: float = 1.0
    """Expected seconds for a start to load the weights into a worker (measured starts' median)."""
    spawn_s: float = 0.0
    """Expected seconds more where the node has no prewarmed worker to load them into."""
    perf_by_kind: Mapping[str, PerfModel] = field(default_factory=dict)
    """The model fitted per kind of node (§5.2: a GPU runs it faster than a CPU); `perf`
    where a kind has none."""
    start_s_by_kind: Mapping[str, float] = field(default_factory=dict)
    """`start_s` per kind of node, where known (a GPU loads over PCIe, a CPU copies)."""
    resident_start_s: float = RESIDENT_START_S
    ttft_slo_per_token_s: float = TTFT_SLO_PER_TOKEN_S
    """Its TTFT SLO's allowance per prompt token (`policy.slo.ttft_slo`)."""
    kv_on_demand_bytes: int = 0
    """`kv_bytes` on a node whose cache grows on demand (`NodeState.kv_on_demand`)."""

    def perf_on(self, kind: str) -> PerfModel:
        return self.perf_by_kind.get(kind, self.perf)

    def start_on(self, kind: str) -> float:
        return self.start_s_by_kind.get(kind, self.start_s)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    failure: Failure | None = None
    ttft_s: float = 0.0
    round_s: float = 0.0


def worker_mates(node: NodeState, view: InstanceState) -> list[InstanceState]:
    """The instances served by `view`'s worker: names on one artifact share a worker, and
    every request on it is in the same queue and batch, whichever name it came for."""
    if not view.worker_pid:
        return [view]
    return [v for v in node.instances.values() if v.worker_pid == view.worker_pid]


def _tokens(max_tokens: int) -> int:
    return max(1, min(max_tokens, TYPICAL_COMPLETION_TOKENS))


def service_s(perf: PerfModel, prompt_tokens: int, tokens: int, batch: int = 1) -> float:
    """A batch of `batch` such requests from prefill to its last token, alone on its instance."""
    return perf.prefill_s(prompt_tokens * batch) + max(tokens - 1, 0) * perf.decode_s(batch, prompt_tokens + tokens / 2)


def validate(
    node: NodeState,
    model: str,
    demand: Demand,
    profiles: Mapping[str, Profile],
    overestimate: float = OVERESTIMATE,
    *,
    start_elapsed_s: float = 0.0,
    start_waiting: int = 0,
    without: AbstractSet[str] = frozenset(),
) -> Verdict:
    """Whether a request for `model` may join its instance on `node` (or a new instance there,
    if it has none) without anyone on the node missing an SLO.

    For an instance whose start is under way there: `start_elapsed_s` since it began, with
    `start_waiting` requests already waiting for it. `without`: instances taken as gone (the
    neighbours a preemption would remove)."""
    own = profiles.get(model)
    if own is None:
        return Verdict(False)  # never measured: nothing to validate with
    perf = own.perf_on(node.kind)
    own_prefill = perf.prefill_s(demand.prompt_tokens)
    continuous = node.continuous_batching
    if continuous and node.prefill_slack_s < overestimate * own_prefill:
        # Its prefill would run ahead of the next token of requests there that cannot wait
        # that long (the cheapest refusal: checked first).
        return Verdict(False, Failure.EXISTING_LATE)
    tokens = _tokens(demand.max_tokens)
    instances = node.instances
    inst = instances.get(model)
    # A new instance (not one whose worker still holds its weights, and core) builds its
    # engine core beside the neighbours once it has served its first batch.
    builds_core = (
        inst is None
        and node.core_build_s > 0
        and own.artifact_id not in node.resident
        and own.artifact_id not in {profiles[m].artifact_id for m in instances if m in profiles}
    )
    if inst is None:
        ahead, running, held, queued_tokens = start_waiting, 0, 0, start_waiting * demand.prompt_tokens
        # A new instance must start first: quickly where its weights are resident, else a load.
        full = (
            own.resident_start_s
            if own.artifact_id in node.resident
            else own.start_on(node.kind) + (0.0 if node.prewarmed else own.spawn_s)
        )
        ready_in = max(0.0, full - start_elapsed_s)
    else:
        if inst.worker_pid:
            mates = worker_mates(node, inst)
            ahead = sum(v.active for v in mates)
            running = min(ahead, sum(v.running for v in mates))
            held = sum(v.held_tokens for v in mates)
            queued_tokens = sum(v.queued_tokens for v in mates)
        else:  # a worker of its own
            ahead, running, held, queued_tokens = inst.active, inst.running, inst.held_tokens, inst.queued_tokens
        ready_in = inst.ready_in_s
    width = max(1, node.max_batch)
    kind = node.kind
    length = demand.prompt_tokens + tokens / 2
    mine = (held + queued_tokens + demand.prompt_tokens) / (ahead + 1) if continuous else length
    round_s = perf.decode_s(min(ahead + 1, width), mine)
    # Continuous batching prefills first (vLLM's scheduler, LLM-Mesh's engine): every prompt
    # waiting on the node is prefilled, in arrival order, before decoding resumes; this one last.
    ahead_s = _prefill_s(perf, ahead - running, queued_tokens) if continuous else 0.0
    # A TPOT SLO the model misses here decoding alone is not one that sharing breaks: its own
    # requests batch as the engine allows (a 1.7B at 0.11 s a token against the default 0.1 s
    # held every request of a burst but one for five TTFT SLOs of room that never came, and
    # then batched them anyway). The neighbours' SLOs still bound the round. "Alone" is the
    # fastest either estimate gives: a batch of one costs no more than this batch does, but the
    # measured grid is noisy, and on a CPU the two are within a few per cent of each other.
    alone_s = min(perf.decode_s(1, length), round_s)
    tightest = demand.tpot_slo_s if overestimate * alone_s <= demand.tpot_slo_s else math.inf
    # One decode iteration (of its batch) per busy worker per round.
    counted = {inst.worker_pid} if inst is not None and inst.worker_pid else set()
    busy_neighbours = False
    for other, view in instances.items():
        busy = view.active
        if busy == 0 or other == model or other in without:
            continue
        p = profiles.get(other)
        if p is None:
            continue  # unknown to us (just registered, never measured): nothing to weigh
        busy_neighbours = True
        theirs_perf = p.perf_by_kind.get(kind, p.perf)
        if continuous and busy > view.running:
            ahead_s += _prefill_s(theirs_perf, busy - view.running, view.queued_tokens)
        tightest = min(tightest, p.tpot_slo_s)
        pid = view.worker_pid
        if pid:
            if pid in counted:
                continue
            counted.add(pid)
            mates = worker_mates(node, view)
            busy = sum(v.active for v in mates)
            theirs = sum(v.held_tokens + v.queued_tokens for v in mates) / busy if continuous else length
        else:  # a worker of its own
            theirs = (view.held_tokens + view.queued_tokens) / busy if continuous else length
        round_s += theirs_perf.decode_s(min(busy, width), theirs)
    if continuous:
        ttft = overestimate * (max(ready_in, ahead_s) + own_prefill)
    else:
        ttft = overestimate * (
            ready_in
            + first_token_wait_s(
                perf, demand.prompt_tokens, tokens, running, held, ahead - running, width, node.join_recompute_tokens
            )
        )
    round_s *= overestimate
    if builds_core and busy_neighbours:
        # Busy neighbours decode beside the new instance's core build: their rounds stretch
        # for its seconds, longer than any of their requests' few seconds of decode.
        round_s *= CORE_BUILD_SLOWDOWN
    # A round too long hurts everyone on the node: it rules the node out, a late first token
    # only this request (the fallback may still queue it there).
    if round_s > tightest:
        return Verdict(False, Failure.ROUND_TOO_LONG, ttft, round_s)
    if ttft > demand.ttft_slo_s:
        return Verdict(False, Failure.NEW_LATE, ttft, round_s)
    return Verdict(True, None, ttft, round_s)


def _prefill_s(perf: PerfModel, requests: int, tokens: int) -> float:
    """Seconds to prefill `requests` prompts of `tokens` in all, one after another."""
    return requests * perf.prefill_s(tokens / requests) if requests > 0 else 0.0


def first_token_wait_s(
    perf: PerfModel, prompt: int, tokens: int, running: int, held: int, queued: int, width: int, join_tokens: int
) -> float:
    """Seconds from a request reaching a worker to its first token, as the engine batches
    (`services/engine/worker_process.py`): `running` rows holding `held` context tokens decode, and
    `queued` requests (each taken as this one's size) wait.

    Requests join the running batch by re-prefilling its rows with theirs, while the rows hold
    at most `join_tokens` (0: the engine never joins) and the batch has room; a join waits for
    the current iteration to end and one more while requests are still arriving. Queued
    requests that can join are taken to join first, and this one after them, in a re-prefill
    of its own (a burst reaches the worker over several iterations: measured on a 2/3-core
    node, the fifth and sixth requests of a burst of six joined 1.4 s after the second to
    fourth). Otherwise it waits for the running batch to end (its rows taken as this request,
    as far along as what they hold says) and for the queued ones' batches."""
    if join_tokens > 0 and held <= join_tokens and running + queued < width and (running or queued):
        rows, holding = running + queued, held + queued * prompt
        pending = perf.prefill_s(holding) if queued else 0.0
        if holding <= join_tokens:
            return 2 * perf.decode_s(rows, prompt) + pending + perf.prefill_s(holding + prompt)
        running, held, queued = rows, holding, 0  # they join; this one waits for the batch
    left = 0.0
    if running:
        done = max(0.0, held / running - prompt)  # tokens its rows have generated, on average
        left = max(tokens - done, 1.0) * perf.decode_s(running, prompt + done)
    batches = -(-queued // width)
    return left + batches * service_s(perf, prompt, tokens, min(queued, width)) + perf.prefill_s(prompt)


def preemption_for(
    node: NodeState,
    model: str,
    demand: Demand,
    profiles: Mapping[str, Profile],
    relocatable: Callable[[str], bool],
    priorities: Mapping[str, int] | None = None,
) -> tuple[str, ...] | None:
    """LLM-Mesh §7.1: the instance of `model` on `node` cannot take the request because its
    neighbours' decode rounds would break a TPOT SLO. The neighbours to preempt so that it
    validates: only instances with a smaller batch than it would have (a big instance is not
    broken up for a small one), the smallest first, and only those whose requests `relocatable`
    says validate on another node. None when no such set makes the request validate. Before
    the batch, the priority (issue 35): the lowest of `priorities` (0 where not named) first."""
    inst = node.instances.get(model)
    if inst is None:
        return None
    mates = worker_mates(node, inst)
    own = sum(v.active for v in mates) + 1
    priorities = priorities or {}
    candidates = sorted(
        (priorities.get(m, 0), sum(w.active for w in worker_mates(node, v)), m)
        for m, v in node.instances.items()
        if v.active > 0 and v not in mates
    )
    victims: list[str] = []
    for _, batch, m in candidates:
        if batch >= own or not relocatable(m):
            continue
        victims.append(m)
        if validate(node, model, demand, profiles, without=frozenset(victims)).ok:
            return tuple(victims)
    return None


def kind_rank(kind: str) -> int:
    return KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)


def join_order(nodes: Iterable[NodeState], model: str) -> list[NodeState]:
    """Nodes running `model`, in the order shadow validation tries them: CPU first, then the
    busiest instance first (§7.2), and among equally busy ones the node whose neighbours are
    the least busy, then the one with the fewest neighbours. Without that tie-break, idle
    instances went by node name: a model scaled out beside a bursty neighbour kept its
    traffic there while its instance on a node of its own drained and scaled in, and the
    neighbours' bursts then met its load (bench/results/cluster.json, `assist` beside `chat`).
    Filling the quieter node first lets the crowded node's instance drain instead."""
    running = [n for n in nodes if model in n.instances]

    def neighbours(n: NodeState) -> tuple[int, int]:
        others = [v for m, v in n.instances.items() if m != model]
        return sum(v.active for v in others), len(others)

    return sorted(running, key=lambda n: (kind_rank(n.kind), -n.instances[model].active, *neighbours(n), n.node_id))


def start_order(
    nodes: Iterable[NodeState], profile: Profile | None, neighbours: Mapping[str, Profile] | None = None
) -> list[NodeState]:
    """Nodes that could start the model, best first: CPU first, then the soonest start (its
    weights, or part of them, still resident there: Tangram's affinity), then the fewest
    instances (they share the node's cores), then the neighbours with the laxest TTFT SLO (the
    new instance takes turns with them, and the tighter its headroom the sooner it goes:
    LLM-Mesh §5.1), then the tightest fit. A node whose memory is known to be too small is
    left out."""
    nodes = list(nodes)
    if profile is None:
        return sorted(nodes, key=lambda n: (kind_rank(n.kind), len(n.instances) + len(n.starting), n.node_id))
    neighbours = neighbours or {}

    def tightest_neighbour(n: NodeState) -> float:
        return min((neighbours[m].ttft_slo_s for m in n.instances if m in neighbours), default=float("inf"))

    weights = profile.weight_bytes
    keyed = []
    for n in nodes:
        need = weights + (profile.kv_on_demand_bytes if n.kv_on_demand else profile.kv_bytes)
        free = max(n.memory_budget_bytes - n.memory_used_bytes, 0) if n.memory_budget_bytes else 1 << 62
        # Eq. 3's S': all of the weights where they are resident, else the share of them an
        # idle worker's arena holds (the shared base of a fine-tune).
        share = 1.0 if profile.artifact_id in n.resident else n.reusable.get(profile.artifact_id, 0.0)
        reusable = int(weights * share)
        load_s = start_s_if_fits(free, reusable, weights, need, LOAD_BANDWIDTH_BPS)
        if load_s is not None:
            keyed.append(
                (
                    (
                        kind_rank(n.kind),
                        round(load_s, 3),
                        -reusable,
                        len(n.instances) + len(n.starting),
                        -tightest_neighbour(n),
                        free,
                        n.node_id,
                    ),
                    n,
                )
            )
    keyed.sort(key=lambda kn: kn[0])
    return [n for _, n in keyed]
