from policy.footprint import true_up

MB = 1_000_000


def test_a_worker_holding_more_than_its_weights_has_its_reservation_grown_to_what_it_holds() -> None:
    # The measured case: 92 MB of weights, a worker of 990 MB with 10 MB of KV cache in it.
    assert true_up(92 * MB, 92 * MB, 990 * MB, 10 * MB) == 980 * MB


def test_small_moves_keep_the_reservation_and_a_clear_drop_shrinks_it() -> None:
    assert true_up(980 * MB, 92 * MB, 1010 * MB, 10 * MB) is None  # +2 %: noise
    assert true_up(980 * MB, 92 * MB, 900 * MB, 10 * MB) is None  # -9 %: the next crowd brings it back
    assert true_up(980 * MB, 92 * MB, 600 * MB, 10 * MB) == 590 * MB
    # The IR's mapped weights let go after the first pass (the 1.7B: 1.9 -> 1.6 GB): shrunk.
    assert true_up(1900 * MB, 874 * MB, 1610 * MB, 10 * MB) == 1600 * MB


def test_never_below_the_weights_and_an_unreadable_rss_changes_nothing() -> None:
    assert true_up(500 * MB, 92 * MB, 50 * MB, 0) == 92 * MB
    assert true_up(92 * MB, 92 * MB, 0, 0) is None
