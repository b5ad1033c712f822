"""The node's headroom gate (services/engine/step_gate.py): the pure choice, and a
turn's hold in one process (across real processes: tests/integration/test_step_gate.py)."""

from __future__ import annotations

import math
import multiprocessing

from services.engine.step_gate import SLOTS, StepGate, may_step

INF = math.inf


def deadlines(**posted: float) -> list[float]:
    d = [INF] * 4
    for k, v in posted.items():
        d[int(k[1:])] = v
    return d


def test_the_least_headroom_goes_first() -> None:
    d = deadlines(s0=5.0, s1=3.0)
    assert may_step(1, d, [0, 0, 0, 0], 1)
    assert not may_step(0, d, [0, 0, 0, 0], 1)


def test_nothing_steps_past_the_capacity() -> None:
    d = deadlines(s0=1.0)
    assert not may_step(0, d, [0, 1, 0, 0], 1)
    assert may_step(0, d, [0, 1, 0, 0], 2)


def test_a_worker_posted_between_its_iterations_keeps_its_turn() -> None:
    # Slot 0 runs a batch and is between iterations (posted, not holding): slot 1 is less urgent.
    assert not may_step(1, deadlines(s0=2.0, s1=9.0), [0, 0, 0, 0], 1)


def test_ties_go_to_the_lower_slot() -> None:
    d = deadlines(s0=4.0, s2=4.0)
    assert may_step(0, d, [0] * 4, 1) and not may_step(2, d, [0] * 4, 1)


def test_the_lock_free_fallbacks_run_ungated() -> None:
    gate = StepGate(multiprocessing.get_context("spawn"), 1)
    assert gate.enter(-1, 0.0) is False  # no slot: ungated, nothing to leave
    slots = [gate.claim() for _ in range(SLOTS)]
    assert sorted(slots) == list(range(SLOTS)) and gate.claim() == -1
    gate.release(slots[0])
    assert gate.claim() == slots[0]


def test_a_turn_holds_the_gate_for_its_block_and_leaves_posted_with_the_next_deadline() -> None:
    gate = StepGate(multiprocessing.get_context("spawn"), 1)
    slot = gate.claim()
    with gate.turn(slot, 5.0) as turn:
        assert gate._holding[slot] == 1
        turn.then = 7.0
    assert gate._holding[slot] == 0 and gate._deadlines[slot] == 7.0  # its batch goes on: posted
    try:
        with gate.turn(slot, 5.0) as turn:
            turn.then = 7.0
            raise RuntimeError("the step failed")
    except RuntimeError:
        pass
    assert gate._holding[slot] == 0 and gate._deadlines[slot] == INF  # a failed step posts nothing
    with gate.turn(-1, 5.0):  # no slot: ungated
        assert not any(gate._holding)  # it holds no slot
