"""The simulator's base (`SimCore`): its state (the nodes, the models' profiles, the starts
under way, the stats) and the indexes placement reads instead of scanning the cluster, the
event queue, and what a node does between the other layers' actions.

What a node does. A node runs one iteration at a time (LLM-Mesh §5.1), prefill first: the
prefills of the requests placed on it run one after another in arrival order (a request whose
instance is still loading or whose KV cache is still growing joins the queue when it can,
ahead of later arrivals; the running prefill is never cut short), ahead of decode; whenever no
prefill is queued it runs decode rounds, one iteration of every instance with decoding
requests, so each decoding request gains one token per round, the round being the sum of the
instances' decode iterations (`PerfModel.decode_s` at the instance's batch and current mean
length). Decode is advanced as a fluid between events (a 1,000-node hour would be billions of
tokens), which is exact for this discipline at the events, where everything that changes the
round or stalls it happens. Validation takes every predicted time 10% longer; what it cannot
see (a request's own KV growth, lengths growing while they decode) is where admitted requests
still miss.

SLO accounting: request r meets its SLO if its first token comes within its TTFT SLO and its
eq. 1 headroom ST + TTFT_SLO + TPOT_SLO · k − t never goes negative while it decodes (k its
decode tokens so far; both SLOs its model's). Every decoding request on a node gains tokens at
the same rate, so its headroom is c_r + g(t) with c_r fixed per request and g(t) = TPOT_SLO ·
D(t) − t common to the node's requests of one TPOT SLO (D: the node's decode clock, tokens per
decoding request since the node started). g is linear between a node's events, so a heap of
c_r per node and TPOT SLO, checked at every event, finds every miss exactly, at O(log n) per
event instead of a scan of the node's requests. A testbed judged as `bench.cluster` judges
(`Testbed.mean_tpot`) asks instead, at completion, for the first token within the TTFT SLO
and the mean time per token after it within the TPOT SLO; eq. 1 still says what placement
reads (`Node.prefill_slack_s`), as the services' scheduler reads it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from typing import Any

from bench.sim.hardware import (
    DEFAULT_MEAN_OUTPUT,
    LLM_MESH,
    TYPICAL_LENGTH,
    Policy,
    Testbed,
    _profile,
    first_kv_bytes,
)
from bench.sim.state import Inst, Node, Req, Stats
from bench.trace import Trace
from policy import scheduling as sched
from policy.perf_model import PerfModel
from policy.placement import Profile
from policy.tensor_pool import Tensor
from shared.messages import TTFT_SLO_PER_TOKEN_S

PF_DONE, NODE_NEXT, OP_DONE, READY, KEEPALIVE, TICK, SAMPLE, LINE = range(8)


class _Loading:
    """A start's load in a node's prefill FIFO (`SimCore.occupy`): a later prefill is never
    queued ahead of it (arrival -inf), and it is no request (its seg matches no entry's)."""

    arrival = -math.inf
    seg = -1


LOADING = _Loading()


class SimCore:
    """The state every layer works on (all of it declared here), its indexes, the event queue,
    and the nodes' engines."""

    def __init__(self, trace: Trace, n_cpu: int, n_gpu: int, policy: Policy, testbed: Testbed = LLM_MESH) -> None:
        self.trace, self.policy, self.testbed = trace, policy, testbed
        self.kinds = (testbed.cpu, testbed.gpu)
        self.nodes: list[Node] = []
        if policy.use_cpu:
            self.nodes += [Node(self, i, testbed.cpu) for i in range(n_cpu)]
        self.nodes += [Node(self, len(self.nodes) + i, testbed.gpu) for i in range(n_gpu)]
        self.models = trace.models
        self.tensors = [(Tensor(f"w{i}", m.weight_bytes),) for i, m in enumerate(self.models)]
        self.perf: dict[tuple[float, str], PerfModel] = {}
        for p in sorted({m.params_b for m in self.models}):
            for hw in self.kinds:
                self.perf[(p, hw.kind)] = _profile(hw, p)
        self.insts: list[list[Inst]] = [[] for _ in self.models]
        self.iheap: list[dict[str, list[tuple[int, int, int, Inst]]]] = [{"cpu": [], "gpu": []} for _ in self.models]
        """Model → kind → its instances by batch, highest first (lazy: an entry is live while
        its stamp is the instance's), so placement never scans a hot model's instances."""
        self.hseq = 0
        self.names = [str(i) for i in range(len(self.models))]
        self.profiles = {self.names[i]: self._model_profile(i) for i in range(len(self.models))}
        self.starts: dict[str, sched.StartUnderWay] = {}
        """The start under way per model (`sched.place` orders one at a time per model)."""
        self.idle_at: list[set[int]] = [set() for _ in self.models]
        """Model → nodes whose tensor pool holds its weights idle (no instance of it)."""
        self.heaps: dict[str, list[tuple[int, int, int]]] = {"cpu": [], "gpu": []}
        """Per kind, nodes by available memory (lazy: stale entries skipped by stamp)."""
        for n in self.nodes:
            self._mem_changed(n)
        self.free_nodes: dict[str, list[int]] = {
            k: [n.nid for n in reversed(self.nodes) if n.kind == k] for k in ("cpu", "gpu")
        }
        self.events: list[tuple[float, int, int, Any, int]] = []
        self.seq = 0
        self.now = 0.0
        self.excl_queue: dict[int, deque[Req]] = {}
        self.line: deque[tuple[Req, float, set[int]]] = deque()
        """Tessera with `Policy.line`: requests no node had room for, first come first served,
        each with when its wait ends and the nodes it avoids (`services/scheduler/line.py`)."""
        self.op_seq = 0
        self.tick_pending = False
        self.out_sum = [0.0] * len(self.models)
        self.out_n = [0] * len(self.models)
        self.stats = Stats(policy.name)
        self.limit_cache: dict[tuple[int, str], int] = {}
        self.active_bytes = 0
        self.reqs: list[Req] = []
        self.placements = 0
        self.wid = 0

    def _model_profile(self, m: int) -> Profile:
        """What placement knows of model m: the sim's perf models are its measurements."""
        spec = self.models[m]
        by_kind = {hw.kind: self.perf[(spec.params_b, hw.kind)] for hw in self.kinds}
        kv0 = first_kv_bytes(spec, int(TYPICAL_LENGTH), DEFAULT_MEAN_OUTPUT)
        starts = {hw.kind: hw.init_s + spec.weight_bytes / hw.load_bps for hw in self.kinds}
        return Profile(
            by_kind["gpu"],
            spec.ttft_slo_s,
            spec.tpot_slo_s,
            f"w{m}",
            spec.weight_bytes,
            kv0,
            max(starts.values()),
            0.0,
            by_kind,
            starts,
            max(hw.init_s for hw in self.kinds),
            ttft_slo_per_token_s=TTFT_SLO_PER_TOKEN_S,
        )

    # -- events
    def push(self, t: float, kind: int, obj: Any, ver: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj, ver))

    # -- a node: prefill FIFO first, decode rounds in between (fluid between events)
    def advance(self, node: Node) -> None:
        """Bring the node's decode clock up to now and mark the requests that went negative."""
        t1 = self.now
        t0 = node.t
        if t1 <= t0:
            return
        windows = node.windows
        pause = 0.0
        for f, u in windows:
            if f >= t1:
                break
            if u > t0:
                pause += min(t1, u) - max(t0, f)
        while windows and windows[0][1] <= t1:
            windows.popleft()
        dec = t1 - t0 - pause
        if dec > 0 and node.round_s > 0:
            node.D += dec / node.round_s
        node.t = t1
        if node.dec_heaps:
            D = node.D
            for tpot, h in node.dec_heaps.items():
                g = tpot * D - t1
                while h and h[0][0] + g < -1e-7:
                    _, _, seg, r = heapq.heappop(h)
                    if r.done < 0 and r.seg == seg:
                        r.met = False

    def reschedule(self, node: Node) -> None:
        """Recompute the node's decode round and its next completion."""
        rs = 0.0
        D = node.D
        for inst in node.insts.values():
            nd = inst.nd
            if nd:
                rs += inst.perf.decode_s(nd, inst.s / nd + D)
        node.round_s = rs
        node.ver += 1
        h = node.done_heap
        while h and h[0][3].seg != h[0][2]:
            heapq.heappop(h)
        if h and rs > 0:
            # Decode time needed, laid into the gaps between queued prefills.
            t, need = node.t, max(h[0][0] - D, 0.0) * rs
            for f, u in node.windows:
                if f > t:
                    if need <= f - t:
                        break
                    need -= f - t
                t = max(t, u)
            self.push(t + need, NODE_NEXT, node, node.ver)

    def enqueue_prefill(self, r: Req) -> None:
        """r's instance is ready and its KV cache grown: its prefill joins the node's queue,
        in arrival order (one that waited for a load or a KV resize goes ahead of later
        arrivals; the prefill running is never cut short)."""
        inst = r.inst
        assert inst is not None and not r.queued and not r.dec
        node = inst.node
        self.advance(node)
        r.queued = True
        p = inst.perf.prefill_s(r.inp)
        fifo = node.fifo
        now = self.now
        if not fifo or fifo[-1][0].arrival <= r.arrival:
            start = max(node.pf_end, now)
            r.pf_start, r.pf_end = start, start + p
            node.pf_end = start + p
            node.windows.append((start, start + p))
            fifo.append([r, r.seg, start, start + p])
            if len(fifo) == 1:
                self.push(start + p, PF_DONE, node)
        else:
            i = len(fifo) - 1
            while i > 1 and fifo[i - 1][0].arrival > r.arrival:
                i -= 1
            fifo.insert(i, [r, r.seg, 0.0, p])
            t = fifo[i - 1][3]
            for e in itertools.islice(fifo, i, None):
                e[2], e[3] = t, t + (e[3] - e[2])
                t = e[3]
                if e[0].seg == e[1]:
                    e[0].pf_start, e[0].pf_end = e[2], e[3]
            node.pf_end = t
            node.windows = deque((e[2], e[3]) for e in fifo if e[3] > now)
        self.reschedule(node)

    def occupy(self, node: Node, at: float, seconds: float) -> float:
        """A start's load on the node's cores from `at` (behind the prefills queued by then,
        decode paused in it, as a prefill's): when it ends. No prefill queued later moves it."""
        self.advance(node)
        start = max(node.pf_end, at)
        node.pf_end = start + seconds
        node.windows.append((start, start + seconds))
        node.fifo.append([LOADING, 0, start, start + seconds])
        if len(node.fifo) == 1:
            self.push(start + seconds, PF_DONE, node)
        self.reschedule(node)
        return start + seconds

    def on_prefill_done(self, node: Node) -> None:
        self.advance(node)
        r, seg, _, _ = node.fifo.popleft()
        if node.fifo:
            self.push(node.fifo[0][3], PF_DONE, node)
        if r.seg != seg:
            return  # preempted while queued: the node ran its prefill for nothing
        inst = r.inst
        assert inst is not None
        inst.npend -= 1
        inst.pend_inp -= r.inp
        # Its next token's deadline (eq. 1): the first token's, plus TPOT for each it had
        # generated before a preemption.
        deadline = r.arrival + r.ttft + r.tpot * r.k0
        if r.first < 0:
            r.first = self.now
            self.stats.ttfts.append(self.now - r.arrival)
        if self.now > deadline + 1e-7:
            r.met = False
        r.d0 = node.D
        r.dec = True
        inst.nd += 1
        inst.s += r.inp - r.d0
        inst.inp_dec += r.inp
        if r.met:
            heap = node.dec_heaps.setdefault(r.tpot, [])
            heapq.heappush(heap, (deadline - r.tpot * r.d0, r.rid, seg, r))
        heapq.heappush(node.done_heap, (r.d0 + max(r.out - r.k0 - 1, 0), r.rid, seg, r))
        self.reschedule(node)

    def on_ready(self, inst: Inst) -> None:
        inst.ready = True
        inst.ready_at = self.now
        node = inst.node
        name = self.names[inst.model]
        start = self.starts.get(name)
        if start is not None and start.node_id == node.node_id:
            del self.starts[name]
        for r in [q for q in node.unq if q.inst is inst and not q.kv_wait]:
            node.unq.remove(r)
            self.enqueue_prefill(r)

    # -- indexes
    def _mem_changed(self, node: Node) -> None:
        node.mem_stamp += 1
        if node.kind == "cpu" and not self.policy.use_cpu:
            return
        heap = self.heaps[node.kind]
        heapq.heappush(heap, (-node.pool.available_bytes(), node.nid, node.mem_stamp))
        if len(heap) > 8 * len(self.nodes) + 64:
            fresh = [(-n.pool.available_bytes(), n.nid, n.mem_stamp) for n in self.nodes if n.kind == node.kind]
            heapq.heapify(fresh)
            self.heaps[node.kind] = fresh

    def top_free(self, kind: str, k: int, without: int = -1) -> list[Node]:
        """The k nodes of `kind` with the most available memory that hold no instance of
        model `without`, from the index."""
        heap = self.heaps[kind]
        nodes = self.nodes
        out: list[tuple[int, int, int]] = []
        took: list[tuple[int, int, int]] = []
        while heap and len(out) < k and len(took) < 8 * k:
            e = heapq.heappop(heap)
            n = nodes[e[1]]
            if n.mem_stamp == e[2]:
                took.append(e)
                if without not in n.insts:
                    out.append(e)
        for e in took:
            heapq.heappush(heap, e)
        return [nodes[e[1]] for e in out]

    def _evicted(self, node: Node, fingerprints: Sequence[str]) -> None:
        for fp in fingerprints:
            self.idle_at[int(fp[1:])].discard(node.nid)
            node.resident.discard(fp)

    def _indexed(self, inst: Inst) -> None:
        """Its batch changed: a fresh entry in the model's instance index."""
        inst.hst += 1
        self.hseq += 1
        heap = self.iheap[inst.model][inst.node.hw.kind]
        heapq.heappush(heap, (-inst.batch, inst.hst, self.hseq, inst))
        if len(heap) > 4 * len(self.insts[inst.model]) + 16:
            live = [
                (-i.batch, i.hst, k, i)
                for k, i in enumerate(self.insts[inst.model])
                if i.node.hw.kind == inst.node.hw.kind
            ]
            heapq.heapify(live)
            self.iheap[inst.model][inst.node.hw.kind] = live

    def top_instances(self, m: int, kind: str, k: int) -> list[Inst]:
        """Up to k live instances of model m on `kind` nodes, highest batch first."""
        heap = self.iheap[m][kind]
        if len(heap) <= k:  # the usual case: look, rather than pop and push back
            return [e[3] for e in sorted(heap) if e[3].alive and e[3].hst == e[1]]
        out: list[tuple[int, int, int, Inst]] = []
        while heap and len(out) < k:
            e = heapq.heappop(heap)
            if e[3].alive and e[3].hst == e[1]:
                out.append(e)
        for e in out:
            heapq.heappush(heap, e)
        return [e[3] for e in out]

    # -- refusals and ticks
    def reject(self, r: Req, reason: str) -> None:
        r.outcome = "rejected"
        r.met = False
        self.stats.reject_reasons[reason] = self.stats.reject_reasons.get(reason, 0) + 1

    def schedule_tick(self, delay: float) -> None:
        if not self.tick_pending:
            self.tick_pending = True
            self.push(self.now + delay, TICK, None)

    # -- results
    def sample(self) -> None:
        if self.policy.shared:
            held = float(self.active_bytes)
            idle = float(sum(n.pool.idle_bytes for n in self.nodes))
        else:
            # vLLM-style engines reserve the whole device for the instance's KV cache
            # (Tangram obs. 2), so an exclusive instance holds its node's memory.
            held = float(sum(n.hw.memory_bytes for n in self.nodes if n.insts))
            idle = 0.0
        self.stats.mem_samples.append((self.now, held, idle))
        busy_cpu = sum(1 for n in self.nodes if n.insts and n.kind == "cpu")
        busy_gpu = sum(1 for n in self.nodes if n.insts and n.kind == "gpu")
        self.stats.busy_samples.append((busy_cpu, busy_gpu))

    def finish(self) -> None:
        s = self.stats
        for r in self.reqs:
            if not r.outcome:
                r.outcome = "unfinished"
                r.met = False
        counted = [r for r in self.reqs if r.arrival >= self.testbed.count_from_s]
        s.requests = len(counted)
        outcomes = [r.outcome for r in counted]
        s.met = outcomes.count("met")
        s.late = outcomes.count("late")
        s.rejected = outcomes.count("rejected")
        s.unfinished = outcomes.count("unfinished")
        s.expired = 0
