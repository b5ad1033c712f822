"""The node's headroom gate (services/engine/step_gate.py) shared by real spawned processes:
one iteration at a time, the urgent worker first (the pure choice: tests/unit/test_step_gate.py)."""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.connection import Connection

from services.engine.step_gate import StepGate


def _contender(gate: StepGate, slot: int, deadline: float, steps: int, log: Connection) -> None:
    for _ in range(steps):
        gate.enter(slot, deadline)
        log.send(("in", slot, time.monotonic()))
        time.sleep(0.002)  # sync-ok: stands in for an iteration's compute
        log.send(("out", slot, time.monotonic()))
        gate.leave(slot, deadline)
    gate.idle(slot)


def test_across_processes_one_iteration_at_a_time_and_the_urgent_worker_runs_its_batch_first() -> None:
    ctx = multiprocessing.get_context("spawn")
    gate = StepGate(ctx, 1)
    lax_slot, urgent_slot = gate.claim(), gate.claim()
    # The lax worker holds its first iteration while the urgent one posts: from then on the
    # urgent one runs every iteration of its batch before the lax one gets another.
    assert gate.enter(lax_slot, 100.0)
    recv, send = ctx.Pipe(duplex=False)
    urgent = ctx.Process(target=_contender, args=(gate, urgent_slot, 1.0, 20, send))
    urgent.start()
    lax = None
    try:
        deadline = time.monotonic() + 120  # a safety bound on a hang, not a speed asked for
        while gate._deadlines[urgent_slot] != 1.0:  # it has posted: it waits at the gate
            assert time.monotonic() < deadline, "the urgent worker never reached the gate"
            time.sleep(0.01)  # sync-ok: polling shared memory with a deadline
        assert not recv.poll(0.2), "the urgent worker ran while another iteration held the gate"
        gate.leave(lax_slot, 100.0)  # posted for its next iteration, like a running batch
        lax = ctx.Process(target=_contender, args=(gate, lax_slot, 100.0, 20, send))
        lax.start()
        events = [recv.recv() for _ in range(80)]
    finally:
        urgent.join(10)
        if lax is not None:
            lax.join(10)
    order = [slot for kind, slot, _ in events if kind == "in"]
    assert order == [urgent_slot] * 20 + [lax_slot] * 20
    inside = 0
    for kind, _, _ in events:  # never two iterations at once
        inside += 1 if kind == "in" else -1
        assert 0 <= inside <= 1
