import pytest

from policy.headroom import RequestClock, headroom, pick_next, run_iteration


def test_headroom_follows_eq1() -> None:
    assert headroom(start=10.0, ttft_slo=2.0, tpot_slo=0.25, generated=4, now=12.5) == 0.5


def test_fig5_one_iteration_then_a_token_moves_headroom_from_1_9_to_2_1() -> None:
    # §5.1: TPOT SLO 0.25 s, an iteration of 0.05 s: 1.9 - 0.05 + 0.25 = 2.1.
    r = RequestClock("r", start=0.0, ttft_slo=2.0, tpot_slo=0.25, generated=1)
    now = 0.35  # headroom 2.0 + 0.25 - 0.35 = 1.9
    assert r.headroom(now) == pytest.approx(1.9)
    assert r.after_token().headroom(now + 0.05) == pytest.approx(2.1)


def test_the_instance_with_the_shortest_headroom_runs_next() -> None:
    a = RequestClock("a", 0.0, 2.0, 0.25, generated=3)  # 2.75 - now
    b = RequestClock("b", 0.0, 2.0, 0.25, generated=1)  # 2.25 - now
    pick = pick_next({"inst-1": [a], "inst-2": [b]}, now=0.5)
    assert pick is not None and pick.instance == "inst-2" and pick.prefill_of is None


def test_a_request_waiting_for_prefill_is_served_by_a_prefill_iteration() -> None:
    new = RequestClock("n", 0.0, 2.0, 0.25, generated=0)
    pick = pick_next({"i": [new]}, now=0.1)
    assert pick is not None and pick.prefill_of == "n"
    after = run_iteration({"i": (new,)}, pick)
    assert after["i"][0].generated == 1


def test_a_decode_step_gives_every_decoding_request_one_token() -> None:
    reqs = (RequestClock("a", 0, 2, 0.25, 2), RequestClock("b", 0, 2, 0.25, 0))
    pick = pick_next({"i": reqs}, now=3.0)
    assert pick is not None
    out = run_iteration({"i": reqs}, pick)["i"]
    assert [r.generated for r in out] in ([3, 0], [2, 1])
