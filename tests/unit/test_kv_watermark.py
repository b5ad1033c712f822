from policy.kv_watermark import (
    Action,
    on_admit,
    on_complete,
    recommended_bytes,
    required_bytes,
    resize_seconds,
)

GB = 10**9


def test_eq2_assumes_the_mean_output_for_requests_that_have_not_reached_it() -> None:
    # Two requests: 100 in / 10 out so far, 200 in / 300 out so far; mean output 50.
    assert required_bytes(2, [(100, 10), (200, 300)], 50.0, 0) == 2 * (150 + 500)


def test_eq2_never_goes_below_l_min() -> None:
    assert required_bytes(2, [(10, 0)], 5.0, 4096) == 2 * 4096


def test_a_short_cache_grows_early_to_the_recommended_size() -> None:
    plan = on_admit(current=100, required=200, available=10**6, watermark=0.2)
    assert plan.action is Action.GROW and plan.target_bytes == 240


def test_when_the_recommended_size_does_not_fit_it_compromises_to_the_requirement() -> None:
    plan = on_admit(current=100, required=200, available=120, watermark=0.2)
    assert plan.action is Action.GROW_COMPROMISED and plan.target_bytes == 200


def test_a_grow_that_does_not_fit_at_all_is_refused() -> None:
    assert not on_admit(current=100, required=200, available=50).accepts


def test_shrinking_is_lazy_until_below_the_watermark() -> None:
    assert on_complete(current=280, required=200, watermark=0.2).action is Action.KEEP
    plan = on_complete(current=400, required=200, watermark=0.2)  # 240 * 1.2 = 288 < 400
    assert plan.action is Action.SHRINK and plan.target_bytes == recommended_bytes(200, 0.2)


def test_a_reservation_does_not_shrink_below_what_the_cache_keeps_allocated() -> None:
    # Its requests gone, a cache that never frees its blocks (OpenVINO's) still holds 300:
    # the reservation shrinks to that, not to nothing; at 280 held, 300 is within the watermark.
    plan = on_complete(current=1000, required=0, watermark=0.2, held=300)
    assert plan.action is Action.SHRINK and plan.target_bytes == 300
    assert on_complete(current=300, required=0, watermark=0.2, held=280).action is Action.KEEP
    assert on_complete(current=300, required=0, watermark=0.2).target_bytes == 0  # one that frees


def test_fig8_resize_times_at_34_gb_per_s() -> None:
    up = resize_seconds(32 * GB, 64 * GB, 34 * GB, 0.0)
    down = resize_seconds(32 * GB, 16 * GB, 34 * GB, 0.0)
    assert 1.7 < up < 2.1 and down < up  # Fig. 8: 1.9 s up, 0.3 s down


def test_l_min_is_the_setting_within_the_context_and_zero_means_the_context() -> None:
    from policy.kv_watermark import floor_tokens

    assert floor_tokens(0, 8192) == 8192
    assert floor_tokens(1024, 8192) == 1024
    assert floor_tokens(10_000, 8192) == 8192


def test_a_cache_that_grows_on_demand_books_no_floor_unless_one_is_set() -> None:
    from policy.kv_watermark import floor_tokens, required_bytes

    assert floor_tokens(0, 8192, on_demand=True) == 0
    assert floor_tokens(1024, 8192, on_demand=True) == 1024
    # Eq. 2 then counts the requests alone, each within its own max_tokens.
    assert required_bytes(10, [], 0.0, floor_tokens(0, 8192, on_demand=True)) == 0
    assert required_bytes(10, [(30, 0, 64)], 100.0, floor_tokens(0, 8192, on_demand=True)) == 10 * (30 + 64)
