import pytest

from policy.affinity import load_time_s, most_reused, reusable_shares, start_s_if_fits

GB = 10**9


def test_eq3_load_time_counts_only_missing_bytes() -> None:
    assert load_time_s(14 * GB, 10 * GB, 2 * GB) == pytest.approx(2.0)
    assert load_time_s(14 * GB, 14 * GB, 2 * GB) == 0.0


def test_resident_tensors_count_toward_the_room_a_start_needs() -> None:
    # 16 GB needed, 4 GB free: only with the model's 14 GB still resident does it fit.
    assert start_s_if_fits(4 * GB, 0, 14 * GB, 16 * GB, 2 * GB) is None
    assert start_s_if_fits(4 * GB, 14 * GB, 14 * GB, 16 * GB, 2 * GB, init_s=0.5) == pytest.approx(0.5)


def test_the_idle_worker_holding_most_of_a_fine_tune_is_the_one_reused() -> None:
    # A fine-tune shares its base's embedding and first layers (Tangram §3.1: matched by
    # content hash); only its changed layers differ.
    base = {"embed": 400, "l0": 100, "l1": 100, "l2": 100}
    tune = {"embed": 400, "l0": 100, "l1": 100, "l2*": 100}
    workers = {"w-base": set(base), "w-other": {"x", "l0"}, "w-empty": set()}
    assert most_reused(workers, tune) == ("w-base", 600)
    assert load_time_s(sum(tune.values()), 600, 100.0) == 1.0  # eq. 3: only the changed layer
    assert most_reused({"w-other": {"x"}}, tune) is None  # nothing shared: a fresh worker
    assert most_reused({"b": {"l0"}, "a": {"l1"}}, tune) == ("a", 100)  # a tie: by name


def test_each_artifact_reports_the_largest_share_one_idle_arena_holds() -> None:
    # The node's status: the base's worker is idle; the fine-tune (one layer changed) is 6/7
    # there, a model sharing only a layer with the other worker 1/7, an unrelated one nothing.
    base = {"embed": 400, "l0": 100, "l1": 100, "l2": 100}
    artifacts = {
        "tune": {"embed": 400, "l0": 100, "l1": 100, "l2*": 100},
        "same": dict(base),
        "cousin": {"e2": 400, "l0": 100, "m1": 100, "m2": 100},
        "stranger": {"s": 10},
        "empty": {},
    }
    idle = {"w-base": set(base), "w-other": {"l0"}}
    assert reusable_shares(idle, artifacts) == {"tune": 600 / 700, "same": 1.0, "cousin": 100 / 700}
    assert reusable_shares({}, artifacts) == {}
