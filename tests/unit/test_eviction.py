from policy.eviction import Resident, choose_evictions, eviction_cost, over_budget

NOW = 10_000.0


def resident(
    key: str,
    nbytes: int = 100,
    reload_s: float = 1.0,
    uses: int = 1,
    last_used: float = NOW - 10,
    first_used: float = NOW - 600,
    users: int = 0,
) -> Resident:
    return Resident(key, nbytes, reload_s, first_used, last_used, uses, users)


def test_a_stale_model_goes_before_a_hot_one() -> None:
    hot = resident("hot", uses=50, last_used=NOW - 5)
    stale = resident("stale", uses=1, last_used=NOW - 3000)
    assert choose_evictions([hot, stale], 100, NOW) == ["stale"]


def test_a_model_that_is_slow_to_reload_is_kept_over_a_quick_one() -> None:
    slow = resident("slow", reload_s=5.0)
    quick = resident("quick", reload_s=0.2)
    assert choose_evictions([slow, quick], 100, NOW) == ["quick"]


def test_cost_is_per_byte_freed_so_one_big_idle_model_beats_two_small_ones() -> None:
    big = resident("big", nbytes=200, reload_s=1.0)
    small = [resident("s1", nbytes=100, reload_s=1.0), resident("s2", nbytes=100, reload_s=1.0)]
    assert choose_evictions([*small, big], 150, NOW) == ["big"]


def test_a_resident_in_use_is_never_evicted() -> None:
    assert choose_evictions([resident("busy", users=1)], 50, NOW) == []


def test_nothing_is_evicted_when_even_everything_would_not_make_room() -> None:
    assert choose_evictions([resident("a"), resident("b")], 1000, NOW) == []


def test_cost_follows_tangram_eq2_in_its_factors() -> None:
    base = resident("x")
    doubled = resident("x", reload_s=2.0)
    assert eviction_cost(doubled, NOW) == 2 * eviction_cost(base, NOW)
    base.alpha = 0.5
    assert eviction_cost(base, NOW) == eviction_cost(resident("x"), NOW) / 2


def test_only_idle_residents_count_against_the_pool_budget() -> None:
    assert over_budget([resident("a", nbytes=300), resident("b", nbytes=500, users=1)], 200) == 100
