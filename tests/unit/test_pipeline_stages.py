"""Which node of an execution pipeline runs which layers, and from when
(policy/pipeline_stages.py, FaaScale §4.2-4.3), on the paper's Fig. 5 case and on a
checkpoint-shaped layout."""

from __future__ import annotations

from policy.multicast import kway_orders, pipecast, pipelines
from policy.pipeline_stages import Layout, assign, needs, ready


def test_fig5_two_sub_groups_hold_the_model_together_after_two_block_times() -> None:
    """k = 2 sources to six nodes, four blocks, one layer per block: sub-group 0 receives
    blocks 0, 1 first and sub-group 1 blocks 2, 3 (Algorithm 1), so after two block times the
    targets together hold every block, two block times before any one of them does (§4.2: a
    pipeline forms once a set of nodes collectively holds the required blocks)."""
    targets = ["b", "c", "d", "f", "g", "h"]
    plan = pipecast(["s0", "s1"], targets, 4)
    assert plan.orders == ((0, 1, 2, 3), (2, 3, 0, 1))
    layout = Layout(blocks=4, lead=0, units=(((0, 0),), ((1, 1),), ((2, 2),), ((3, 3),)))
    got = ready(plan, targets, layout)
    assert got is not None and got.early
    assert (got.step, got.whole_step) == (1, 4)
    assert [(s.node, s.lo, s.hi) for s in got.stages] == [("b", 0, 1), ("c", 1, 2), ("f", 2, 3), ("g", 3, 4)]
    two = ready(plan, targets, layout, max_stages=2)  # fewer stages (workers): a step later
    assert two is not None and two.early and two.step == 2 and len(two.stages) == 2
    # Algorithm 2's first pipeline (one node of each sub-group) alone: later, in fewer stages.
    pair = ready(plan, pipelines(plan.groups)[0], layout)
    assert pair is not None and pair.early and pair.step == 3 and len(pair.stages) == 2


def test_lead_blocks_come_first_in_every_order() -> None:
    assert kway_orders(7, 2, lead=1) == [[0, 1, 2, 3, 4, 5, 6], [0, 4, 5, 6, 1, 2, 3]]
    assert kway_orders(4, 2, lead=9) == kway_orders(4, 2)  # a lead past the end is none


def test_a_stage_needs_the_lead_its_units_and_the_embedding_for_the_first() -> None:
    # Three layers and a tied head (the norm in block 9, the embedding in blocks 1-2).
    layout = Layout(blocks=10, lead=1, units=(((2, 3),), ((3, 5),), ((6, 8),), ((1, 2), (9, 9))), first=((1, 2),))
    assert needs(layout, 0, 1) == {0, 1, 2, 3}
    assert needs(layout, 1, 2) == {0, 3, 4, 5}
    assert needs(layout, 2, 3) == {0, 6, 7, 8}
    assert needs(layout, 3, 4) == {0, 1, 2, 9}  # the head alone: the embedding and the norm
    assert needs(layout, 0, 4) == set(range(10))


def test_a_tied_head_runs_on_the_node_that_holds_the_embedding() -> None:
    """The first half's node holds the embedding early, the second half's late: the head
    goes back to the first, rather than wait for the second to receive the embedding."""
    layout = Layout(blocks=10, lead=1, units=(((3, 4),), ((5, 6),), ((7, 8),), ((1, 2), (9, 9))), first=((1, 2),))
    holds = {"a": frozenset({0, 1, 2, 3, 4, 5, 6, 9}), "b": frozenset({0, 7, 8, 9})}
    got = assign(layout, ["a", "b"], lambda n: holds[n])
    assert got is not None and [(s.node, s.lo, s.hi) for s in got] == [("a", 0, 2), ("b", 2, 3), ("a", 3, 4)]


def test_the_fewest_stages_cover_the_layers_and_a_gap_is_no_pipeline() -> None:
    layout = Layout(blocks=6, lead=0, units=tuple(((i, i),) for i in range(6)))
    holds = {"a": frozenset({0, 1, 2}), "b": frozenset({1, 2, 3, 4}), "c": frozenset({3, 4, 5})}
    got = assign(layout, ["a", "b", "c"], lambda n: holds[n])
    # From unit 3, c reaches the end and b only unit 4: c takes it.
    assert got is not None and [(s.node, s.lo, s.hi) for s in got] == [("a", 0, 3), ("c", 3, 6)]
    holds["c"] = frozenset({3, 4})
    assert assign(layout, ["a", "b", "c"], lambda n: holds[n]) is None  # nobody holds layer 5
    whole = {"a": frozenset(range(6))}
    one = assign(layout, ["a"], lambda n: whole[n])
    assert one is not None and [(s.node, s.lo, s.hi) for s in one] == [("a", 0, 6)]


def test_one_sub_group_serves_early_only_by_a_block_or_two() -> None:
    """k = 1 (one source): the binomial pipeline gives the targets different blocks, but the
    source sends each block once, so together they hold everything only about when the first
    holds it all; the window is a block time or two, and with two targets none."""
    layout = Layout(blocks=12, lead=0, units=tuple(((i, i),) for i in range(12)))
    plan = pipecast(["s"], ["a", "b"], 12)
    got = ready(plan, ["a", "b"], layout)
    assert got is not None and got.whole_step - got.step <= 2
    k2 = ready(pipecast(["s", "store"], ["a", "b"], 12), ["a", "b"], layout)
    assert k2 is not None and k2.early and k2.whole_step - k2.step >= 5
