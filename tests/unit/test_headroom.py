import pytest

from policy.headroom import headroom


def test_headroom_follows_eq1() -> None:
    assert headroom(start=10.0, ttft_slo=2.0, tpot_slo=0.25, generated=4, now=12.5) == 0.5


def test_fig5_one_iteration_then_a_token_moves_headroom_from_1_9_to_2_1() -> None:
    # §5.1: TPOT SLO 0.25 s, an iteration of 0.05 s: 1.9 - 0.05 + 0.25 = 2.1.
    now = 0.35  # one token out: headroom 2.0 + 0.25 - 0.35 = 1.9
    assert headroom(0.0, 2.0, 0.25, 1, now) == pytest.approx(1.9)
    assert headroom(0.0, 2.0, 0.25, 2, now + 0.05) == pytest.approx(2.1)
