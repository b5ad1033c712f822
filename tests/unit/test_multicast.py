"""PipeCast's plans (FaaScale §4.1-4.3): Algorithm 1's orders, the sub-groups, the binomial
pipeline's schedule, Algorithm 2's execution pipelines, and the transfer times they give."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from policy.multicast import (
    STORE,
    Plan,
    binomial_sends,
    chunk_of,
    kway_orders,
    naive,
    pipecast,
    pipeline_ready_step,
    pipelines,
    subgroups,
    transfer_s,
)


def nodes(n: int, prefix: str = "t") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def test_algorithm_1_on_the_papers_2_to_8_example() -> None:
    # Fig. 5: four blocks, two sub-groups; sub-group 1 sends {B3, B4} before {B1, B2}, the
    # other {B1, B2} before {B3, B4} (0-based here).
    assert kway_orders(4, 2) == [[0, 1, 2, 3], [2, 3, 0, 1]]
    assert kway_orders(5, 1) == [[0, 1, 2, 3, 4]]
    # ⌈b/k⌉-block chunks, the last one short; every order a permutation.
    orders = kway_orders(7, 3)
    assert orders == [[0, 1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 0, 1, 2], [6, 0, 1, 2, 3, 4, 5]]
    assert all(sorted(o) == list(range(7)) for o in orders)
    assert [chunk_of(b, 7, 3) for b in range(7)] == [0, 0, 0, 1, 1, 1, 2]
    with pytest.raises(ValueError):
        kway_orders(0, 2)


def test_subgroups_split_evenly_one_per_source() -> None:
    assert subgroups(["a", "b"], nodes(6)) == [["t0", "t1", "t2"], ["t3", "t4", "t5"]]
    sizes = [len(g) for g in subgroups(nodes(3, "s"), nodes(8))]
    assert sizes == [3, 3, 2]
    assert subgroups(["a", "b"], ["t0"]) == [["t0"], []]
    with pytest.raises(ValueError):
        subgroups([], nodes(2))


def check_schedule(plan: Plan) -> None:
    """What any plan must be: every target gets every block exactly once; a node sends a block
    only once it holds it (received in an earlier step); one send and one receipt per node per
    step."""
    got = Counter((s.dst, s.block) for s in plan.sends)
    assert set(got) == {(t, b) for t in plan.targets for b in range(plan.blocks)}
    assert set(got.values()) == {1}
    arrived = {(s.dst, s.block): s.step for s in plan.sends}
    for s in plan.sends:
        if s.src not in plan.sources:
            assert arrived[(s.src, s.block)] < s.step, s
    per_step_src = Counter((s.step, s.src) for s in plan.sends if s.src != STORE)  # the store serves many
    per_step_dst = Counter((s.step, s.dst) for s in plan.sends)
    assert max(per_step_src.values(), default=1) == 1 and max(per_step_dst.values()) == 1


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 16, 31])
@pytest.mark.parametrize("blocks", [1, 4, 16])
def test_the_binomial_pipeline_reaches_n_nodes_in_about_b_plus_log_n_steps(n: int, blocks: int) -> None:
    plan = pipecast(["src"], nodes(n), blocks)
    check_schedule(plan)
    optimum = blocks + math.ceil(math.log2(n + 1)) - 1  # Ganesan & Seshadri's binomial pipeline
    assert optimum <= plan.steps <= optimum + math.ceil(math.log2(n + 1)) + 1
    # The source starts a new block every step until every block is in the sub-group.
    first_out = sorted(s.step for s in plan.sends if s.src == "src")[:blocks]
    assert first_out == list(range(blocks))


def test_a_sub_group_feeds_blocks_in_its_order_when_none_is_rarer() -> None:
    sends = binomial_sends("src", ["t0"], [2, 3, 0, 1])
    assert [s.block for s in sends] == [2, 3, 0, 1]


def test_k_sources_complete_a_replica_between_sub_groups_after_b_over_k_steps() -> None:
    # Fig. 5's 2 → 8: two sources, six targets (three per sub-group), four blocks.
    plan = pipecast(["A", "E"], ["B", "C", "D", "F", "G", "H"], 4)
    check_schedule(plan)
    assert plan.groups == (("B", "C", "D"), ("F", "G", "H"))
    # Algorithm 2: one node from each sub-group per pipeline.
    pipes = pipelines(plan.groups)
    assert pipes == [["B", "F"], ["C", "G"], ["D", "H"]]
    # Each pipeline's two nodes hold complementary halves, every block, before either holds the
    # whole model; the first within ~b/k steps plus the sub-group's ⌈log2 L⌉ of fan-out.
    for pipe in pipes:
        assert pipeline_ready_step(plan, pipe) < min(plan.complete_step(n) for n in pipe)
    assert min(pipeline_ready_step(plan, p) for p in pipes) <= 4 // 2 - 1 + math.ceil(math.log2(3 + 1))
    big = pipecast(["A", "E"], nodes(14), 16)
    check_schedule(big)
    first = min(pipeline_ready_step(big, p) for p in pipelines(big.groups))
    assert first <= 16 // 2 - 1 + math.ceil(math.log2(7 + 1)) < max(big.complete_step(n) for n in big.targets)


def test_algorithm_2_pipelines() -> None:
    assert pipelines([["a", "b", "c"], ["d", "e", "f"]]) == [["a", "d"], ["b", "e"], ["c", "f"]]
    # Unequal sub-groups: as many cross pipelines as the smallest has nodes, then again over
    # what is left; a single sub-group left forms one pipeline.
    assert pipelines([["a", "b", "c"], ["d"]]) == [["a", "d"], ["b", "c"]]
    assert pipelines([["a", "b"], ["c", "d", "e"], ["f"]]) == [["a", "c", "f"], ["b", "d"], ["e"]]
    assert pipelines([["a"], []]) == [["a"]]


def test_naive_reads_everything_from_the_store() -> None:
    plan = naive(nodes(3), 4)
    check_schedule(plan)
    assert {s.src for s in plan.sends} == {STORE}


def test_transfer_times_pipecast_barely_grows_with_n_the_baseline_linearly() -> None:
    # One block per second on every link and at the store: the baseline shares the store N
    # ways (N × b seconds); PipeCast forwards (b + ~log2 N).
    blocks = 32
    times = {}
    for n in (1, 2, 4, 8, 256):
        targets = nodes(n)
        times[n] = (
            max(transfer_s(pipecast([STORE], targets, blocks), 1, 1.0).values()),
            max(transfer_s(naive(targets, blocks), 1, 1.0).values()),
        )
    assert times[1] == (blocks, blocks)
    for n, (pipe, base) in times.items():
        assert base == n * blocks
        assert blocks + math.log2(n) - 1 <= pipe <= blocks + 2 * math.ceil(math.log2(n + 1))
    assert times[8][0] / times[1][0] <= 1.5  # the targets, on the model
    assert times[8][1] / times[8][0] >= 4 and times[256][1] / times[256][0] >= 50


def test_a_store_slower_than_the_links_bounds_only_the_first_copy() -> None:
    targets = nodes(8)
    slow_store = transfer_s(pipecast([STORE], targets, 16), 1, 1.0, store_bps=0.5)
    # The store feeds one reader at half a link: its 16 blocks take 32 s to enter; the rest
    # forwards behind them (the plan's per-link order, made for a full-speed source, costs
    # a few block times more).
    assert 32 <= max(slow_store.values()) <= 1.5 * 32
    assert max(transfer_s(naive(targets, 16), 1, 1.0, store_bps=0.5).values()) == 8 * 16 * 2
