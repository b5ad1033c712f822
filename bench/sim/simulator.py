"""The simulator (`Sim`): its layers composed, `SimPlacement(SimMemory(SimCore))` (each calls
only the layers below it), and the event loop that dispatches to them: arrivals to the
policy's placement, a node's next completion, prefills done, memory operations done,
instances ready, keep-alives, the exclusive baseline's ticks, the line's turns, samples. `simulate` runs one.
"""

from __future__ import annotations

import gc
import heapq
from typing import Any

from bench.sim.core import KEEPALIVE, LINE, NODE_NEXT, OP_DONE, PF_DONE, READY, SAMPLE, TICK
from bench.sim.hardware import LLM_MESH, Policy, Testbed
from bench.sim.placement import SimPlacement
from bench.sim.state import Node, Req, Stats
from bench.trace import Trace
from policy.slo import ttft_slo


class Sim(SimPlacement):
    """The layers composed, and the event loop that dispatches to them."""

    # -- events
    def run(self) -> Stats:
        # The run allocates millions of small objects that live until its end: the cyclic
        # collector would scan them over and over for nothing.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if enabled:
                gc.enable()

    def _run(self) -> Stats:
        tr = self.trace
        arrival, model = tr.arrival.tolist(), tr.model.tolist()
        inp, out = tr.input_len.tolist(), tr.output_len.tolist()
        n = len(arrival)
        slos = [self.profiles[name] for name in self.names]
        self.stats.requests = n
        self.push(0.0, SAMPLE, None)
        i = 0
        stop = tr.duration_s + 3600.0
        events = self.events
        pop = heapq.heappop
        while i < n or events:
            if events and (i >= n or events[0][0] <= arrival[i]):
                t, _, kind, obj, ver = pop(events)
                if t > stop:
                    break
                self.now = t
                if kind == NODE_NEXT:
                    if obj.ver == ver:
                        self.on_node_next(obj)
                elif kind == PF_DONE:
                    self.on_prefill_done(obj)
                else:
                    self.dispatch(kind, obj, ver)
            else:
                self.now = arrival[i]
                slo = slos[model[i]]
                r = Req(i, model[i], arrival[i], inp[i], out[i], ttft_slo(slo, inp[i]), slo.tpot_slo_s)
                self.reqs.append(r)
                i += 1
                self.on_arrive(r)
        self.finish()
        return self.stats

    def dispatch(self, kind: int, obj: Any, ver: int) -> None:
        if kind == OP_DONE:
            node, op_id = obj
            self.on_op_done(node, op_id)
        elif kind == READY:
            if obj.alive:
                self.on_ready(obj)
        elif kind == KEEPALIVE:
            if obj.alive and obj.idle_ver == ver and obj.batch == 0:
                self.retire(obj)
        elif kind == TICK:
            self.tick_pending = False
            self.on_tick()
        elif kind == LINE:
            self.serve_line()
        elif kind == SAMPLE:
            self.sample()
            if self.now < self.trace.duration_s:
                self.push(self.now + 10.0, SAMPLE, None)

    # -- a node's completions
    def on_node_next(self, node: Node) -> None:
        self.advance(node)
        h = node.done_heap
        lim = node.D + 1e-6
        finished = []
        while h and h[0][0] <= lim:
            _, _, seg, r = heapq.heappop(h)
            if r.seg == seg:
                finished.append(r)
        for r in finished:
            self.complete(r)
        self.reschedule(node)
        if finished and self.excl_queue:
            self.schedule_tick(0.0)
        if finished and self.line:  # their room may take the line's (as heartbeats wake it)
            self.push(self.now, LINE, None)

    def complete(self, r: Req) -> None:
        r.done = self.now
        if self.testbed.mean_tpot:
            r.met = met_as_benched(r)
        r.outcome = "met" if r.met else "late"
        inst = r.inst
        assert inst is not None
        kind = inst.node.kind
        self.stats.served_on[kind] = self.stats.served_on.get(kind, 0) + 1
        if not r.met:
            self.stats.late_on[kind] = self.stats.late_on.get(kind, 0) + 1
        inst.nd -= 1
        inst.s -= r.inp - r.d0
        inst.inp_dec -= r.inp
        inst.reqs.discard(r)
        inst.last_used = self.now
        self.out_sum[r.model] += r.out
        self.out_n[r.model] += 1
        if self.policy.shared:
            self._indexed(inst)
            self.shrink_kv(inst)
        if inst.batch == 0:
            inst.idle_ver += 1
            self.push(self.now + self.policy.keep_alive_s, KEEPALIVE, inst, inst.idle_ver)
        if not self.policy.shared:
            self.exclusive_pull(inst)

    # -- arrivals
    def on_arrive(self, r: Req) -> None:
        if self.policy.shared:
            self.place_shared(r)
        else:
            self.place_exclusive(r)

    def on_tick(self) -> None:
        self.exclusive_expire()


def met_as_benched(r: Req) -> bool:
    """`bench.cluster`'s judgement of a completed request: its first token within its TTFT SLO
    and the mean time per output token after it within its TPOT SLO."""
    tpot = (r.done - r.first) / (r.out - 1) if r.out > 1 else 0.0
    return r.first - r.arrival <= r.ttft + 1e-9 and tpot <= r.tpot + 1e-9


def simulate(trace: Trace, n_cpu: int, n_gpu: int, policy: Policy, testbed: Testbed = LLM_MESH) -> Stats:
    return Sim(trace, n_cpu, n_gpu, policy, testbed).run()
