"""The adapter groups' turns on a pipeline that applies one adapter set per step, and the
adapters' keep-alive (`policy/adapter_turns.py`)."""

from __future__ import annotations

from policy.adapter_turns import BASE, AdapterUse, idle_adapters, joins_now, next_group


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
