import pytest

from policy.affinity import (
    Offer,
    choose_node,
    load_time_s,
    rank_nodes,
    schedule_starts,
    slowest_bandwidth,
)

GB = 10**9


def test_eq3_load_time_counts_only_missing_bytes() -> None:
    assert load_time_s(14 * GB, 10 * GB, 2 * GB) == pytest.approx(2.0)
    assert load_time_s(14 * GB, 14 * GB, 2 * GB) == 0.0


def test_pipelined_loading_runs_at_the_slower_medium() -> None:
    assert slowest_bandwidth(3 * GB, 12 * GB) == 3 * GB


def test_a_node_holding_the_models_tensors_wins() -> None:
    offers = [Offer("cold", "gpu", 80 * GB, 0, 10 * GB), Offer("warm", "gpu", 66 * GB, 14 * GB, 10 * GB)]
    assert choose_node(14 * GB, 16 * GB, offers).node_id == "warm"


def test_cpu_nodes_come_before_gpu_nodes() -> None:
    offers = [Offer("g", "gpu", 80 * GB, 14 * GB, 10 * GB), Offer("c", "cpu", 100 * GB, 0, 10 * GB)]
    assert [c.node_id for c in rank_nodes(14 * GB, 16 * GB, offers)] == ["c", "g"]


def test_a_node_without_room_is_not_offered() -> None:
    assert choose_node(14 * GB, 16 * GB, [Offer("full", "gpu", 1 * GB, 0, 10 * GB)]) is None


def test_ties_in_load_time_go_to_the_tightest_fit() -> None:
    offers = [Offer("roomy", "gpu", 80 * GB, 0, 10 * GB), Offer("tight", "gpu", 20 * GB, 0, 10 * GB)]
    assert choose_node(14 * GB, 16 * GB, offers).node_id == "tight"


def test_algorithm2_assigns_each_gpu_once() -> None:
    offers = [Offer("g0", "gpu", 80 * GB, 0, 10 * GB), Offer("g1", "gpu", 80 * GB, 0, 10 * GB)]
    out = schedule_starts(
        [("a", 14 * GB, 16 * GB), ("b", 14 * GB, 16 * GB), ("c", 14 * GB, 16 * GB)], offers, {("b", "g1"): 14 * GB}
    )
    assert out["a"].node_id == "g0" and out["b"].node_id == "g1" and out["c"] is None
