"""The adapter groups' turns on a pipeline that applies one adapter set per step, and the
adapters' keep-alive (`policy/adapter_turns.py`)."""

from __future__ import annotations

import math

from policy.adapter_turns import BASE, AdapterUse, adapter_residents, idle_adapters, joins_now, next_group
from policy.eviction import Resident, choose_evictions


def test_a_request_joins_at_once_only_with_its_group_applied_and_no_other_waiting() -> None:
    assert joins_now("a", "a", [])
    assert joins_now(BASE, BASE, [BASE])
    assert not joins_now("a", None, [])  # nothing applied yet: the first switch applies it
    assert not joins_now("b", "a", [])
    # Another group waits: the running group's newcomers wait behind it (no starvation).
    assert not joins_now("a", "a", ["b"])


def test_the_group_waiting_longest_runs_next() -> None:
    assert next_group({"a": 5.0, "b": 3.0, BASE: 4.0}) == "b"
    assert next_group({"a": 2.0, BASE: 2.0}) == BASE  # a tie: by name, stable


def test_a_busy_group_does_not_starve_another() -> None:
    """A stream of `a` requests while `b` waits: `a`'s newcomers queue, and `b` (older than
    them) runs next once `a` drains."""
    waiting = {"b": 1.0}
    for t in (2.0, 3.0, 4.0):
        assert not joins_now("a", "a", waiting)
        waiting.setdefault("a", t)
    assert next_group(waiting) == "b"


def test_an_adapter_is_dropped_when_idle_its_keep_alive_and_never_while_in_use() -> None:
    loaded = {
        "idle": AdapterUse(keep_alive_s=10, last_used=0.0),
        "fresh": AdapterUse(keep_alive_s=10, last_used=5.0),
        "busy": AdapterUse(keep_alive_s=1, last_used=0.0, active=1),
        "short": AdapterUse(keep_alive_s=0, last_used=12.0),
    }
    assert idle_adapters(loaded, now=12.0) == ["idle", "short"]
    assert idle_adapters(loaded, now=15.0) == ["fresh", "idle", "short"]
    assert idle_adapters({}, now=1.0) == []


def test_idle_adapters_are_evicted_by_tangrams_cost_beside_idle_models() -> None:
    """Memory pressure before any keep-alive: an idle adapter is a resident like an idle model's
    weights (Tangram eq. 2: reload time by reuse likelihood), so one order takes the cheapest
    to need again first; a busy adapter is never a candidate, a pinned one never taken for a
    model of its priority."""
    now, wall = 1_000.0, 50_000.0  # monotonic and wall clocks, 49,000 s apart
    loaded = {
        "rare": AdapterUse(keep_alive_s=600, last_used=now - 300, nbytes=8, first_used=now - 900, uses=1),
        "hot": AdapterUse(keep_alive_s=600, last_used=now - 1, nbytes=8, first_used=now - 60, uses=40, reload_s=0.2),
        "busy": AdapterUse(keep_alive_s=600, last_used=now, active=2, nbytes=8, first_used=now - 60, uses=9),
        "pinned": AdapterUse(keep_alive_s=math.inf, last_used=now - 900, nbytes=8, first_used=now - 900),
    }
    residents = adapter_residents(loaded, now, wall, lambda n: f"m:adapter:{n}")
    by_key = {r.key: r for r in residents}
    assert set(by_key) == {"m:adapter:hot", "m:adapter:pinned", "m:adapter:rare"}
    rare = by_key["m:adapter:rare"]
    assert (rare.last_used, rare.first_used, rare.nbytes, rare.priority) == (wall - 300, wall - 900, 8, 0)
    assert {r.priority for r in adapter_residents(loaded, now, wall, str, priority=3)} == {3}  # its base's
    assert by_key["m:adapter:pinned"].pinned and not rare.pinned
    # An idle model's weights: 100 bytes, reloaded in 2 s, last used a minute ago.
    weights = Resident("model-b", 100, 2.0, first_used=wall - 600, last_used=wall - 60, uses=5)
    # 8 bytes needed: the rarely used adapter is the cheapest to need again.
    assert choose_evictions([weights, *residents], 8, wall) == ["m:adapter:rare"]
    # 16: the hot adapter's expected reload (0.2 s, used every 1.5 s) is still below the
    # model's (2 s, likely): both adapters go before the weights.
    assert choose_evictions([weights, *residents], 16, wall) == ["m:adapter:rare", "m:adapter:hot"]
    # More than the adapters hold: the weights alone make the room (the adapters stay).
    assert choose_evictions([weights, *residents], 50, wall) == ["model-b"]
