"""The simulator's memory (`SimMemory`): the memory manager's station, whose operations (loads,
unloads, KV resizes) take the time the hardware says and finish as events, and KV sizing: an
instance's KV cache from eq. 2 and the watermark, grown for a request joining it (§6.2, its
cost what `kv_watermark.resize_seconds` says: LLM-Mesh Fig. 8) and shrunk lazily after one
leaves (§6.2). The tensor pool's eviction (Tangram's rule, `policy.eviction`) runs inside the
pool (`policy.tensor_pool`); its index of idle tensors is the base's (`core.py`).
"""

from __future__ import annotations

from bench.sim.core import OP_DONE, SimCore
from bench.sim.hardware import DEFAULT_MEAN_OUTPUT, L_MIN_TOKENS, RESIZE_FIXED_S, TYPICAL_LENGTH, UNLOAD_S
from bench.sim.state import Inst, Node, Req
from policy import kv_watermark as kvw
from policy.station import MemOp, OpKind, resize_kv


class SimMemory(SimCore):
    """The station's operations and KV sizing, on the base's state."""

    # -- memory
    def issue(self, node: Node, op: MemOp, inst: Inst, waiters: list[Req]) -> None:
        if node.station.issue(op) is not None:
            raise AssertionError(f"station refused {op} that the pool accepted")
        node.ops[op.op_id] = (inst, waiters)
        self.active_bytes += op.delta
        self.run_station(node)

    def run_station(self, node: Node) -> None:
        for op in node.station.dispatch():
            inst, _ = node.ops[op.op_id]
            if op.kind is OpKind.LOAD:
                d = inst.load_s
                if node.hw.loads_on_node and d > node.hw.init_s:
                    # Its init first (a prewarmed worker's), then the weights on the node's cores.
                    d = self.occupy(node, self.now + node.hw.init_s, d - node.hw.init_s) - self.now
                inst.ready_at = self.now + d
            elif op.kind is OpKind.UNLOAD:
                d = UNLOAD_S
            else:
                d = kvw.resize_seconds(op.old_bytes, op.new_bytes, node.hw.kv_copy_bps, RESIZE_FIXED_S)
            self.push(self.now + d, OP_DONE, (node, op.op_id))

    def on_op_done(self, node: Node, op_id: int) -> None:
        op = node.station.complete(op_id)
        inst, waiters = node.ops.pop(op_id)
        if op.kind is OpKind.LOAD and inst.alive:
            self.on_ready(inst)
        for r in waiters:
            r.kv_wait = False
            if inst.alive and inst.ready and r.inst is inst and not r.queued:
                node.unq.remove(r)
                self.enqueue_prefill(r)
        self.run_station(node)

    def next_op(self) -> int:
        self.op_seq += 1
        return self.op_seq

    def mean_output(self, m: int) -> float:
        """Ō of eq. 2: the model's mean output so far (a default until a few are seen)."""
        return self.out_sum[m] / self.out_n[m] if self.out_n[m] >= 4 else DEFAULT_MEAN_OUTPUT

    def growth_s(self, inst: Inst) -> float:
        """Seconds to grow inst's KV cache for one more request of typical length, if it must."""
        if not self.policy.shared:
            return 0.0
        required = self._kv_required(inst, int(TYPICAL_LENGTH))
        if required <= inst.kv:
            return 0.0
        return kvw.resize_seconds(inst.kv, kvw.recommended_bytes(required), inst.node.hw.kv_copy_bps, RESIZE_FIXED_S)

    def kv_required(self, inst: Inst, extra: Req | None) -> int:
        return self._kv_required(inst, None if extra is None else extra.inp)

    def _kv_required(self, inst: Inst, extra_inp: int | None) -> int:
        """Eq. 2 from the instance's aggregates: Σ I + max(Σ O, n·Ō) (Σ max(O_r, Ō) ≥ this;
        the watermark's 20% covers the difference)."""
        spec = self.models[inst.model]
        n = inst.batch
        inp = inst.inp_dec + inst.pend_inp
        generated = max(inst.s - inst.inp_dec + inst.nd * inst.node.D, 0.0) + inst.nd
        if extra_inp is not None:
            n += 1
            inp += extra_inp
        mean = self.mean_output(inst.model)
        return kvw.required_bytes(spec.kv_bytes_per_token, [(inp, int(generated))], n * mean, L_MIN_TOKENS)

    def shrink_kv(self, inst: Inst) -> None:
        """§6.2 lazy scale-down after a request leaves."""
        if not inst.ready:
            return
        node = inst.node
        plan = kvw.on_complete(inst.kv, self.kv_required(inst, None))
        if plan.action is kvw.Action.SHRINK:
            self.issue(node, resize_kv(self.next_op(), str(inst.model), inst.kv, plan.target_bytes), inst, [])
            node.pool.shrink_kv(str(inst.model), inst.kv - plan.target_bytes)
            d = kvw.resize_seconds(inst.kv, plan.target_bytes, node.hw.kv_copy_bps, RESIZE_FIXED_S)
            inst.kv = plan.target_bytes
            inst.kv_free_at = max(inst.kv_free_at, self.now) + d
            self._mem_changed(node)

    def kv_plan(self, inst: Inst, r: Req) -> tuple[kvw.KvPlan, float]:
        """The KV plan for r joining inst, and when r's prefill could then start."""
        node = inst.node
        plan = kvw.on_admit(inst.kv, self.kv_required(inst, r), node.pool.available_bytes())
        ready = self.now if inst.ready else inst.ready_at
        if plan.accepts and plan.target_bytes > inst.kv:
            start = max(self.now, inst.kv_free_at, ready)
            d = kvw.resize_seconds(inst.kv, plan.target_bytes, node.hw.kv_copy_bps, RESIZE_FIXED_S)
            return plan, start + d
        return plan, ready
