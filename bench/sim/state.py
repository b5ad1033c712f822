"""The simulator's state: requests (`Req`), instances (`Inst`) and nodes (`Node`), as
placement sees them (`placement.InstanceState`, `placement.NodeState`) and as they run; and
what a run counts (`Stats`).

A node tells placement what an engine's heartbeat would, as of now: per instance its
requests, decoding rows, the tokens they hold, the prompt tokens queued and when it can run a
newcomer (`Inst.ready_in_s`: a load, a KV resize); per node its `prefill_slack_s`, the least
eq. 1 headroom its requests keep once the queued prefills ran (LLM-Mesh §5.1).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from bench.sim.hardware import GB, Hardware
from policy.perf_model import PerfModel
from policy.station import Station
from policy.tensor_pool import TensorPool
from shared.messages import Tier

if TYPE_CHECKING:
    from bench.sim.core import SimCore
    from bench.sim.memory import SimMemory


class Req:
    __slots__ = (
        "arrival",
        "cold",
        "d0",
        "dec",
        "done",
        "eligible_at",
        "first",
        "inp",
        "inst",
        "k0",
        "kv_wait",
        "met",
        "model",
        "moves",
        "out",
        "outcome",
        "pf_end",
        "pf_start",
        "queued",
        "rid",
        "seg",
        "tpot",
        "ttft",
    )

    def __init__(self, rid: int, model: int, arrival: float, inp: int, out: int, ttft: float, tpot: float) -> None:
        self.rid, self.model, self.arrival, self.inp, self.out = rid, model, arrival, inp, out
        self.ttft = ttft
        """Its TTFT SLO (its model's, grown to its prompt)."""
        self.tpot = tpot
        """Its TPOT SLO (its model's)."""
        self.first = -1.0
        self.done = -1.0
        self.d0 = 0.0  # the node's decode clock at its first token
        self.inst: Inst | None = None
        self.met = True
        self.outcome = ""
        self.k0 = 0
        """Tokens it had generated when it was last preempted (its prefill then includes them)."""
        self.seg = 0
        """Bumped when it is preempted: entries of its earlier placement are stale."""
        self.moves = 0
        self.cold = False
        self.queued = False  # in its node's prefill FIFO, or past it
        self.dec = False  # decoding
        self.kv_wait = False  # waiting for its instance's KV cache to grow
        self.eligible_at = 0.0  # predicted time it can enter the FIFO
        self.pf_start = 0.0
        self.pf_end = 0.0


class Inst:
    """An instance, as placement sees one (`placement.InstanceState`) and as it runs."""

    __slots__ = (
        "alive",
        "hst",
        "idle_ver",
        "inp_dec",
        "kv",
        "kv_free_at",
        "last_used",
        "load_s",
        "model",
        "nd",
        "node",
        "npend",
        "pend_inp",
        "perf",
        "ready",
        "ready_at",
        "reqs",
        "s",
        "sim",
        "weights",
    )

    worker_pid = 0
    """Each has a worker of its own (no names sharing an artifact's worker)."""
    tier = Tier.STEADY.value

    def __init__(
        self, sim: SimMemory, model: int, node: Node, perf: PerfModel, load_s: float, now: float, weights: int
    ) -> None:
        self.sim = sim
        self.model, self.node, self.perf, self.load_s = model, node, perf, load_s
        self.ready = False
        self.ready_at = now + load_s  # expected, until the load completes
        self.kv = 0
        self.kv_free_at = now
        self.alive = True
        self.idle_ver = 0
        self.weights = weights
        self.nd = 0  # decoding requests
        self.s = 0.0  # Σ (input − d0) over decoding requests: mean length = s/nd + node.D
        self.inp_dec = 0  # Σ input over decoding requests
        self.npend = 0  # placed, first token not yet
        self.pend_inp = 0
        self.hst = 0  # stamp of its current entry in the model's instance index
        self.last_used = now
        self.reqs: set[Req] = set()

    @property
    def batch(self) -> int:
        return self.nd + self.npend

    active = batch

    @property
    def running(self) -> int:
        return self.nd

    @property
    def held_tokens(self) -> int:
        return int(self.s + self.nd * self.node.D)

    @property
    def queued_tokens(self) -> int:
        return self.pend_inp

    @property
    def ready_in_s(self) -> float:
        """Until its weights are loaded and its KV cache has room for one more request: a
        resize under way, or the one a newcomer of typical length would need (§6.2)."""
        t = self.node.t
        return max(t if self.ready else self.ready_at, self.kv_free_at) - t + self.sim.growth_s(self)


class Node:
    """A node, as placement sees one (`placement.NodeState`) and as it runs: a continuous-
    batching engine that prefills first."""

    __slots__ = (
        "D",
        "dec_heaps",
        "done_heap",
        "fifo",
        "hw",
        "instances",
        "insts",
        "mem_stamp",
        "nid",
        "node_id",
        "ops",
        "pf_end",
        "pool",
        "resident",
        "round_s",
        "sim",
        "starting",
        "station",
        "t",
        "unq",
        "ver",
        "windows",
    )

    seen_at = math.inf
    """The simulator sees its nodes as they are, not through heartbeats."""
    max_batch = 256
    join_recompute_tokens = 0
    prewarmed = 1
    """A start costs `Hardware.init_s` (a pre-warmed worker) plus its load."""
    continuous_batching = True
    reusable: ClassVar[Mapping[str, float]] = MappingProxyType({})
    """Its models share no tensors: each is resident whole or not at all."""
    core_build_s = 0.0
    """The simulated engines start on their serving engine: no core build beside neighbours."""
    kv_on_demand = False
    """A start books its KV cache's L_min floor, as LLM-Mesh's engine does."""

    def __init__(self, sim: SimCore, nid: int, hw: Hardware) -> None:
        self.sim = sim
        self.nid, self.hw = nid, hw
        self.node_id = str(nid)
        self.insts: dict[int, Inst] = {}
        self.instances: dict[str, Inst] = {}
        """Its instances by model name, loading ones too (`Inst.ready_in_s` says when they
        can run: the simulator sees what a heartbeat would not yet show)."""
        self.starting: set[str] = set()
        self.resident: set[str] = set()
        """Artifacts whose weights its pool holds with no instance."""
        self.t = 0.0
        self.D = 0.0
        self.round_s = 0.0
        self.windows: deque[tuple[float, float]] = deque()
        """(start, end) of the prefills queued or running, in order: decode stops in them."""
        self.pf_end = 0.0
        self.fifo: deque[list[Any]] = deque()
        """[request, its seg, start, end] of the prefills queued or running, in order."""
        self.unq: list[Req] = []
        """Placed requests not yet eligible for the FIFO (instance loading, KV growing)."""
        self.dec_heaps: dict[float, list[tuple[float, int, int, Req]]] = {}
        """TPOT SLO → (c_r, id, seg, r) of its decoding requests still within their SLO;
        headroom = c_r + g, g = TPOT SLO · D − t common to the heap (see `core`)."""
        self.done_heap: list[tuple[float, int, int, Req]] = []
        """(decode clock at which r finishes, id, seg, r)."""
        self.ver = 0
        self.station = Station(hw.memory_bytes)
        self.pool = TensorPool(hw.memory_bytes, hw.load_bps)
        self.ops: dict[int, tuple[Inst, list[Req]]] = {}
        self.mem_stamp = 0

    @property
    def kind(self) -> str:
        return self.hw.kind

    @property
    def memory_budget_bytes(self) -> int:
        return self.hw.memory_bytes

    @property
    def memory_used_bytes(self) -> int:
        return self.hw.memory_bytes - self.pool.available_bytes()

    @property
    def prefill_slack_s(self) -> float:
        """How long one more prefill may hold up its requests (`placement.NodeState`): the
        least eq. 1 headroom among them once the prefills queued have run. For a decoding
        request, its headroom now less every queued prefill; for a queued one, its headroom
        at its first token less the prefills queued after it."""
        # The prefills that run before one placed now: the queue's, then the ones waiting
        # for a load or a KV resize (they join the queue in arrival order, so ahead of it).
        end = max(self.pf_end, self.t)
        for r in self.unq:
            if r.inst is not None:
                end = max(end, r.eligible_at) + r.inst.perf.prefill_s(r.inp)
        least = math.inf
        for tpot, h in self.dec_heaps.items():
            while h and (h[0][3].done >= 0 or h[0][3].seg != h[0][2]):
                heapq.heappop(h)
            if h:
                least = min(least, h[0][0] + tpot * self.D - end)
        for r, seg, _, _ in self.fifo:
            if r.seg == seg and r.met:
                least = min(least, r.arrival + r.ttft + r.tpot * r.k0 - end)
        for r in self.unq:
            if r.met:
                least = min(least, r.arrival + r.ttft + r.tpot * r.k0 - end)
        return least


@dataclass
class Stats:
    policy: str
    requests: int = 0
    met: int = 0
    late: int = 0
    rejected: int = 0
    expired: int = 0
    cold_starts: int = 0
    reuse_starts: int = 0
    preemptions: int = 0
    lined: int = 0
    """Requests that waited in the line for room (`Policy.line`)."""
    ttfts: list[float] = field(default_factory=list)
    unfinished: int = 0
    late_on: dict[str, int] = field(default_factory=dict)
    """Late requests by the kind of node that served them."""
    mem_samples: list[tuple[float, float, float]] = field(default_factory=list)
    """(time, bytes held by instances (weights + KV), bytes of idle resident tensors)."""
    busy_samples: list[tuple[int, int]] = field(default_factory=list)
    """(CPU nodes, GPU nodes) running at least one instance."""
    reject_reasons: dict[str, int] = field(default_factory=dict)
    served_on: dict[str, int] = field(default_factory=dict)

    @property
    def attainment(self) -> float:
        return self.met / self.requests if self.requests else 1.0

    def summary(self) -> dict[str, Any]:
        ttfts = sorted(self.ttfts)

        def pct(q: float) -> float | None:
            return round(ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))], 3) if ttfts else None

        def mean(xs: Sequence[float]) -> float:
            return sum(xs) / len(xs) if xs else 0.0

        return {
            "requests": self.requests,
            "slo_attainment": round(self.attainment, 4),
            "met": self.met,
            "late": self.late,
            "late_by_node_kind": self.late_on,
            "served_by_node_kind": self.served_on,
            "rejected": self.rejected,
            "unfinished": self.unfinished,
            "reject_reasons": self.reject_reasons,
            "cold_starts": self.cold_starts,
            "starts_from_resident_tensors": self.reuse_starts,
            "preemptions": self.preemptions,
            "ttft_p50_s": pct(0.5),
            "ttft_p99_s": pct(0.99),
            "memory_held_gb_mean": round(mean([m[1] for m in self.mem_samples]) / GB, 2),
            "memory_held_gb_peak": round(max((m[1] for m in self.mem_samples), default=0) / GB, 2),
            "idle_resident_gb_mean": round(mean([m[2] for m in self.mem_samples]) / GB, 2),
            "busy_cpu_nodes_mean": round(mean([b[0] for b in self.busy_samples]), 2),
            "busy_gpu_nodes_mean": round(mean([b[1] for b in self.busy_samples]), 2),
        }
