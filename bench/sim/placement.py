"""Where requests go and where instances start and stop (`SimPlacement`), under each policy.

Tessera: every placement is the scheduler's (`sched.first_join`, then `sched.place`: shadow
validation by `placement.validate`, compute preemption, starts by affinity, the early reject
that is its admission), over the candidates the base's indexes give; a request joins an
instance if its KV cache can grow for it (§6.2), preempting idle neighbours for memory where
it cannot (LLM-Mesh §7.1, defrag's choice); a request a node cannot hold is placed again
elsewhere, as the gateway does on `no_capacity`. A start loads what the node's tensor pool
lacks (Tangram eq. 3); a retired instance leaves its weights resident (Tangram §3.1).

The exclusive baseline (LLM-Mesh §8.1's sllm+cpu): one model per instance and one instance
per node, a new instance when every instance of the model is at its concurrency limit (tuned
per model size and node kind, LLM-Mesh §8.1), requests waiting FIFO for a slot.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import replace
from typing import Any

from bench.sim.core import KEEPALIVE, LINE, READY
from bench.sim.hardware import RESIZE_FIXED_S, TYPICAL_LENGTH, first_kv_bytes
from bench.sim.memory import SimMemory
from bench.sim.state import Inst, Node, Req
from policy import defrag
from policy import kv_watermark as kvw
from policy import scheduling as sched
from policy.perf_model import PerfModel
from policy.placement import Demand
from policy.station import load, resize_kv, unload
from shared.messages import Rejected


class SimPlacement(SimMemory):
    """Placement, starts and stops: Tessera's, then the exclusive baseline's."""

    # -- placement (Tessera): the scheduler's policy, `sched.place`
    def running_on(self, m: int, avoid: set[int]) -> dict[int, Node]:
        """The nodes of model m's busiest instances per kind and of its start under way, from
        the index, brought up to now."""
        k = self.policy.candidates_per_kind
        kinds = ("cpu", "gpu") if self.policy.use_cpu else ("gpu",)
        out: dict[int, Node] = {}
        now = self.now
        insts = [i for kind in kinds for i in self.top_instances(m, kind, k)]
        start = self.starts.get(self.names[m])
        if start is not None:
            insts.append(self.nodes[int(start.node_id)].insts[m])
        for inst in insts:
            n = inst.node
            if n.nid not in avoid:
                out[n.nid] = n
                if n.t < now:
                    self.advance(n)  # what placement reads of them, as of now
        return out

    def candidates(self, m: int, avoid: set[int], out: dict[int, Node]) -> list[Node]:
        """The nodes placement looks at for model m, from the indexes: `out` (its busiest
        instances and its start under way), nodes holding its tensors idle, and the nodes
        with the most available memory per kind."""
        k = self.policy.candidates_per_kind
        kinds = ("cpu", "gpu") if self.policy.use_cpu else ("gpu",)
        for nid in itertools.islice(self.idle_at[m], k):
            out[nid] = self.nodes[nid]
        for kind in kinds:
            for n in self.top_free(kind, k, m):
                out[n.nid] = n
        for nid in avoid:
            out.pop(nid, None)
        nodes = list(out.values())
        now = self.now
        for n in nodes:
            if n.t < now:
                self.advance(n)  # what placement reads of them, as of now
        return nodes

    def place_shared(self, r: Req, avoid: set[int] | None = None) -> None:
        """Place r as the scheduler does (`sched.place`), then carry the decision out; with no
        room anywhere, r waits in the line (`Policy.line`) or goes where the line would send it
        once its wait is over."""
        avoid = avoid or set()
        decision = self.decide_shared(r, avoid)
        if isinstance(decision, sched.NoRoom):
            if self.policy.line:
                until = self.now + (self.policy.reject_over_slo or 1.0) * r.ttft
                self.line.append((r, until, avoid))
                self.stats.lined += 1
                self.push(until, LINE, None)
                return
            decision = decision.otherwise
        self.carry_out(r, decision, avoid)

    def serve_line(self) -> None:
        """The line's requests placed again, in order, as room shows (a request ended) or
        their wait ends; those still without room wait on."""
        waiting, self.line = self.line, deque()
        for r, until, avoid in waiting:
            decision = self.decide_shared(r, avoid)
            if isinstance(decision, sched.NoRoom):
                if self.now < until - 1e-9:
                    self.line.append((r, until, avoid))
                    continue
                decision = decision.otherwise
            self.carry_out(r, decision, avoid)

    def decide_shared(self, r: Req, avoid: set[int]) -> Any:
        """The scheduler's decision for r (`sched.first_join`, then `sched.place`)."""
        m = r.model
        name = self.names[m]
        self.placements += 1
        # A resumed request's next token is due by its eq. 1 deadline.
        due = r.arrival + r.ttft + r.tpot * r.k0 - self.now
        demand = Demand(r.inp, r.out - r.k0, max(due, 0.0), r.tpot)
        # What the scheduler decides first (a join), from the model's own nodes: the other
        # candidates are gathered only when no instance of it validates.
        running = self.running_on(m, avoid)
        joins = sched.first_join(
            name,
            running.values(),
            max_active_per_instance=self.policy.max_active_per_instance,
            demand=demand,
            profiles=self.profiles,
        )
        decision: Any = joins.joined if joins is not None else None
        if decision is None:
            start = self.starts.get(name)
            decision = sched.place(
                name,
                self.candidates(m, avoid, running),
                {name: start} if start else {},
                self.now,
                node_timeout_s=math.inf,
                max_active_per_instance=self.policy.max_active_per_instance,
                demand=demand,
                profiles=self.profiles,
                reject_over_slo=self.policy.reject_over_slo,
                joins=joins,
            )
        return decision

    def carry_out(self, r: Req, decision: Any, avoid: set[int]) -> None:
        m = r.model
        name = self.names[m]
        if isinstance(decision, Rejected):
            self.reject(r, decision.code.value)
            return
        node = self.nodes[int(decision.node_id)]
        if isinstance(decision, sched.UseNode):
            for victim in decision.preempt:
                self.preempt(node.insts[int(victim)])
            if decision.scale_out_to is not None:
                spare = self.nodes[int(decision.scale_out_to)]
                if m not in spare.insts:
                    self.start_instance(spare, m, None)
            inst = node.insts[m]
        elif isinstance(decision, sched.AwaitStart):
            inst = node.insts[m]
            start = self.starts.get(name)
            if start is not None:
                self.starts[name] = replace(start, waiting=start.waiting + 1)
        else:
            if not self.start_instance(node, m, r):
                self.replace_elsewhere(r, node, avoid)
            return
        if not self.join(inst, r):
            self.replace_elsewhere(r, node, avoid)

    def replace_elsewhere(self, r: Req, node: Node, avoid: set[int]) -> None:
        """The node cannot hold r's KV cache: the engine says `no_capacity` and the gateway
        places the request again, avoiding that node."""
        if r.moves >= self.policy.max_replacements:
            self.reject(r, "no_capacity")
            return
        r.moves += 1
        self.place_shared(r, avoid | {node.nid})

    def join(self, inst: Inst, r: Req) -> bool:
        """r joins inst if its KV cache can grow for it (§6.2), making room by preempting
        idle neighbours (§7.1) where it cannot; False if neither."""
        plan, eligible_at = self.kv_plan(inst, r)
        if not plan.accepts:
            if not self.try_preempt(inst, r):
                return False
            plan, eligible_at = self.kv_plan(inst, r)
            if not plan.accepts:
                return False
        self.attach(inst, r, plan.target_bytes, eligible_at)
        return True

    def attach(self, inst: Inst, r: Req, kv_target: int, eligible_at: float) -> None:
        node = inst.node
        r.inst = inst
        inst.reqs.add(r)
        inst.npend += 1
        inst.pend_inp += r.inp
        r.eligible_at = eligible_at
        self._indexed(inst)
        if kv_target > inst.kv:
            evicted = node.pool.grow_kv(str(inst.model), kv_target - inst.kv, self.now)
            if evicted is None:
                raise AssertionError("the KV plan accepted what the pool cannot hold")
            self._evicted(node, evicted)
            r.kv_wait = True
            inst.kv_free_at = eligible_at
            self.issue(node, resize_kv(self.next_op(), str(inst.model), inst.kv, kv_target), inst, [r])
            inst.kv = kv_target
            self._mem_changed(node)
        if inst.ready and not r.kv_wait:
            self.enqueue_prefill(r)
        else:
            node.unq.append(r)
            self.advance(node)
            self.reschedule(node)

    def try_preempt(self, inst: Inst, r: Req) -> bool:
        """§7.1: make room on `inst`'s node by preempting lower-batch neighbours.

        Only neighbours with no request are taken here: rescheduling a running request would
        redo its prefill elsewhere, which validation of the preempting instance cannot see."""
        node = inst.node
        need = self.kv_required(inst, r) - inst.kv - node.pool.available_bytes()
        if need <= 0:
            return False
        neighbours = [
            defrag.Neighbour(str(o.model), o.batch, o.weights + o.kv, o.batch == 0)
            for o in node.insts.values()
            if o is not inst and o.ready
        ]
        choice = defrag.choose_preemption(inst.batch + 1, need, neighbours)
        if choice is None:
            return False
        for key in choice.victims:
            self.retire(node.insts[int(key)])
            self.stats.preemptions += 1
        return True

    def perf_of(self, model: int, kind: str) -> PerfModel:
        return self.perf[(self.models[model].params_b, kind)]

    def start_instance(self, node: Node, m: int, r: Req | None) -> bool:
        """Start model m on node (for r, or ahead of demand): what its pool lacks is loaded
        (Tangram eq. 3); False if the pool cannot hold it with its first KV cache."""
        spec = self.models[m]
        kv0 = first_kv_bytes(spec, r.inp if r else int(TYPICAL_LENGTH), self.mean_output(m))
        if node.pool.available_bytes() < spec.weight_bytes + kv0:
            return False  # (tensors it reuses are idle, so available counts them)
        got = node.pool.acquire(str(m), self.tensors[m], self.now)
        if got is None:
            return False
        self._evicted(node, got.evicted)
        evicted = node.pool.grow_kv(str(m), kv0, self.now)
        if evicted is None:
            node.pool.release(str(m), self.now)
            return False
        self._evicted(node, evicted)
        self.idle_at[m].discard(node.nid)
        node.resident.discard(f"w{m}")
        self.stats.cold_starts += 1
        if got.loaded_bytes == 0:
            self.stats.reuse_starts += 1
        load_s = node.hw.init_s + got.loaded_bytes / node.hw.load_bps
        self.wid += 1
        inst = Inst(self, m, node, self.perf_of(m, node.kind), load_s, self.now, spec.weight_bytes)
        inst.kv = kv0
        node.insts[m] = inst
        name = self.names[m]
        node.instances[name] = inst
        self.starts[name] = sched.StartUnderWay(node.node_id, self.now, 1 if r else 0)
        self.insts[m].append(inst)
        self.issue(node, load(self.next_op(), str(m), spec.weight_bytes), inst, [])
        self.issue(node, resize_kv(self.next_op(), str(m), 0, kv0), inst, [])
        inst.kv_free_at = inst.ready_at + kvw.resize_seconds(0, kv0, node.hw.kv_copy_bps, RESIZE_FIXED_S)
        self._mem_changed(node)
        self._indexed(inst)
        if r is not None:
            r.cold = True
            self.attach(inst, r, kv0, inst.ready_at)
        else:
            inst.idle_ver += 1
            self.push(inst.ready_at + self.policy.keep_alive_s, KEEPALIVE, inst, inst.idle_ver)
        return True

    def preempt(self, inst: Inst) -> None:
        """§7.1 for compute: the instance stops; its requests go on elsewhere (the gateway
        resumes each with its text so far as the prompt). A prefill of one still queued on
        the node runs anyway (conservative: no iteration is cut short)."""
        node = inst.node
        self.advance(node)
        moved = sorted(inst.reqs, key=lambda q: q.rid)
        for q in moved:
            if q in node.unq:
                node.unq.remove(q)
            if q.dec:
                # Its text so far (the tokens of this placement: one at d0, one per round
                # since) becomes part of the prompt it resumes with.
                k = min(int(node.D - q.d0) + 1, q.out - q.k0 - 1)
                q.k0 += k
                q.inp += k
            q.seg += 1
            q.queued = q.dec = q.kv_wait = False
            q.inst = None
        inst.reqs.clear()
        inst.nd = inst.npend = inst.inp_dec = inst.pend_inp = 0
        inst.s = 0.0
        self.stats.preemptions += 1
        self.retire(inst)
        for q in moved:
            self.place_shared(q, {node.nid})

    def retire(self, inst: Inst) -> None:
        """Scale the instance to zero; Tessera leaves its weights resident (Tangram §3.1)."""
        assert inst.batch == 0, "only idle instances are retired"
        node = inst.node
        self.advance(node)
        inst.alive = False
        del node.insts[inst.model]
        self.insts[inst.model].remove(inst)
        name = self.names[inst.model]
        node.instances.pop(name, None)
        start = self.starts.get(name)
        if start is not None and start.node_id == node.node_id:
            del self.starts[name]
        if self.policy.shared:
            if inst.kv:
                self.issue(node, resize_kv(self.next_op(), str(inst.model), inst.kv, 0), inst, [])
                node.pool.shrink_kv(str(inst.model), inst.kv)
                inst.kv = 0
            self.issue(node, unload(self.next_op(), str(inst.model), inst.weights), inst, [])
            node.pool.release(str(inst.model), self.now)
            self.idle_at[inst.model].add(node.nid)
            node.resident.add(f"w{inst.model}")
            self._mem_changed(node)
        else:
            self.exclusive_node_free(node)
        self.reschedule(node)

    # -- the exclusive baseline
    def limit(self, m: int, kind: str) -> int:
        """Its concurrency limit per instance: tuned per model and kind (LLM-Mesh §8.1); with no
        scale-out, the engine's own (requests queue in its batch, as in `bench.cluster`)."""
        if not self.policy.exclusive_scale_out:
            return self.policy.max_active_per_instance
        key = (m, kind)
        if key not in self.limit_cache:
            spec = self.models[m]
            hw = self.testbed.hardware(kind)
            tpot = spec.tpot_slo_s * self.policy.limit_tpot_fraction
            by_compute = self.perf_of(m, kind).max_batch(TYPICAL_LENGTH, tpot)
            by_memory = int((hw.memory_bytes - spec.weight_bytes) // (spec.kv_bytes_per_token * TYPICAL_LENGTH))
            self.limit_cache[key] = max(0, min(by_compute, by_memory))
        return self.limit_cache[key]

    def place_exclusive(self, r: Req) -> None:
        best = None
        for inst in self.insts[r.model]:
            if inst.batch < self.limit(r.model, inst.node.kind) and (best is None or inst.batch < best.batch):
                best = inst
        if best is not None:
            self.attach_exclusive(best, r)
        elif not self.start_exclusive(r):
            self.excl_queue.setdefault(r.model, deque()).append(r)
            self.schedule_tick(1.0)

    def attach_exclusive(self, inst: Inst, r: Req) -> None:
        r.inst = inst
        inst.npend += 1
        inst.pend_inp += r.inp
        if inst.ready:
            self.enqueue_prefill(r)
        else:
            inst.node.unq.append(r)
            self.advance(inst.node)
            self.reschedule(inst.node)

    def start_exclusive(self, r: Req) -> bool:
        m = r.model
        if self.insts[m] and not self.policy.exclusive_scale_out:
            return False  # one instance per model: r waits for a place in its batch
        spec = self.models[m]
        kinds = self.policy.exclusive_kinds if self.policy.use_cpu else ("gpu",)
        for kind in kinds:
            if self.limit(m, kind) == 0:
                continue
            free = self.free_nodes[kind]
            if free:
                node = self.nodes[free.pop()]
                load_s = node.hw.init_s + spec.weight_bytes / node.hw.load_bps
                inst = Inst(self, m, node, self.perf_of(m, kind), load_s, self.now, spec.weight_bytes)
                node.insts[m] = inst
                self.insts[m].append(inst)
                self.stats.cold_starts += 1
                r.cold = True
                self.push(self.now + load_s, READY, inst)
                self.attach_exclusive(inst, r)
                self.exclusive_pull(inst)
                return True
        return False

    def exclusive_node_free(self, node: Node) -> None:
        self.free_nodes[node.kind].append(node.nid)
        # The freed node goes to the model that has waited longest.
        while True:
            oldest = None
            for m, q in self.excl_queue.items():
                if q and (oldest is None or q[0].arrival < self.excl_queue[oldest][0].arrival):
                    oldest = m
            if oldest is None:
                return
            q = self.excl_queue[oldest]
            r = q.popleft()
            if not self.start_exclusive(r):
                q.appendleft(r)
                return

    def exclusive_pull(self, inst: Inst) -> None:
        q = self.excl_queue.get(inst.model)
        while q and inst.alive and inst.batch < self.limit(inst.model, inst.node.kind):
            self.attach_exclusive(inst, q.popleft())

    def exclusive_expire(self) -> None:
        horizon = self.now - self.policy.queue_timeout_s
        left = False
        for q in self.excl_queue.values():
            while q and q[0].arrival < horizon:
                self.reject(q.popleft(), "timeout")
            left = left or bool(q)
        if left:
            self.schedule_tick(1.0)
