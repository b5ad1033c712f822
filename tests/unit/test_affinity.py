import pytest

from policy.affinity import load_time_s, start_s_if_fits

GB = 10**9


def test_eq3_load_time_counts_only_missing_bytes() -> None:
    assert load_time_s(14 * GB, 10 * GB, 2 * GB) == pytest.approx(2.0)
    assert load_time_s(14 * GB, 14 * GB, 2 * GB) == 0.0


def test_resident_tensors_count_toward_the_room_a_start_needs() -> None:
    # 16 GB needed, 4 GB free: only with the model's 14 GB still resident does it fit.
    assert start_s_if_fits(4 * GB, 0, 14 * GB, 16 * GB, 2 * GB) is None
    assert start_s_if_fits(4 * GB, 14 * GB, 14 * GB, 16 * GB, 2 * GB, init_s=0.5) == pytest.approx(0.5)
