from policy.eviction import Resident, choose_evictions, eviction_cost, over_budget, reuse_likelihood

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


def test_at_equal_cost_the_bigger_goes_first_so_one_eviction_makes_room() -> None:
    big = resident("big", nbytes=200, reload_s=1.0)
    small = [resident("s1", nbytes=100, reload_s=1.0), resident("s2", nbytes=100, reload_s=1.0)]
    assert choose_evictions([*small, big], 150, NOW) == ["big"]


GB = 1_000_000_000
BANDWIDTH = 1 * GB  # b_m, the same for both: bytes per second


def paper_resident(key: str, nbytes: int, p: float) -> Resident:
    """A resident whose reload takes s / b_m and whose estimated p_m is `p` (1 or 0.5):
    used often over ten minutes (rate term saturated), idle 0 s (p = 1) or 60 s (p = 0.5)."""
    idle_s = {1.0: 0.0, 0.5: 60.0}[p]
    r = Resident(key, nbytes, nbytes / BANDWIDTH, NOW - 600, NOW - idle_s, uses=100)
    assert reuse_likelihood(r, NOW) == p
    return r


def test_tangram_worked_numbers_the_cheaper_whole_eviction_goes_not_the_cheaper_per_byte() -> None:
    """Tangram §3.2.2, eq. 2 (c = p_m · s / b_m · α_m) and its greedy by ascending c: a 4 GB
    resident at p = 0.5 costs 2 GB / b, a 1 GB one at p = 1 costs 1 GB / b; 1 GB is needed:
    the 1 GB one is evicted. Per byte, the 4 GB one is the cheaper (0.5 / b against 1 / b)
    and the old order evicted it, for twice the expected reload."""
    big = paper_resident("4GB p=0.5", 4 * GB, 0.5)
    small = paper_resident("1GB p=1", 1 * GB, 1.0)
    assert eviction_cost(big, NOW) == 2.0 and eviction_cost(small, NOW) == 1.0
    assert choose_evictions([big, small], 1 * GB, NOW) == ["1GB p=1"]
    assert choose_evictions([small, big], 1 * GB, NOW) == ["1GB p=1"]
    per_byte = min([big, small], key=lambda r: eviction_cost(r, NOW) / r.nbytes)
    assert per_byte is big  # what the old order (cost per byte) took first


def test_the_greedy_goes_on_in_ascending_cost_until_enough_is_freed() -> None:
    """2 GB needed: the 1 GB one (cost 1) then the 4 GB one (cost 2), as the paper's greedy
    does; the 4 GB one alone would free enough, so the 1 GB one is kept after all."""
    big = paper_resident("4GB p=0.5", 4 * GB, 0.5)
    small = paper_resident("1GB p=1", 1 * GB, 1.0)
    assert choose_evictions([big, small], 2 * GB, NOW) == ["4GB p=0.5"]
    # Two cheap ones that together make room are evicted before a dearer one.
    small2 = paper_resident("1GB' p=1", 1 * GB, 1.0)
    assert sorted(choose_evictions([big, small, small2], 2 * GB, NOW)) == ["1GB p=1", "1GB' p=1"]


def test_a_victim_made_unnecessary_by_a_later_one_is_kept() -> None:
    tiny = resident("tiny", nbytes=1, reload_s=0.01)
    big = resident("big", nbytes=100, reload_s=1.0)
    assert choose_evictions([tiny, big], 100, NOW) == ["big"]


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
