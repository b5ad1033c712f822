"""Scale-outs of a model that begin within the window share one multicast plan."""

from __future__ import annotations

from policy.multicast_groups import Groups


def test_scale_outs_within_the_window_join_the_first_ones_group() -> None:
    g = Groups(window_s=0.5)
    assert g.join("m", "n1", now=10.0)  # opens: its caller sends the plan when due
    assert not g.join("m", "n2", now=10.125)
    assert not g.join("m", "n2", now=10.25)  # the same node once
    assert g.join("other", "n3", now=10.375)  # another model: a group of its own
    assert not g.join("m", "n4", now=10.5)  # the window's edge still joins
    assert g.due("m") == 10.5
    assert g.close("m") == ["n1", "n2", "n4"]
    assert g.close("other") == ["n3"]
    assert g.close("m") == []


def test_a_scale_out_after_the_window_opens_a_new_group() -> None:
    g = Groups(window_s=0.05)
    assert g.join("m", "n1", now=1.0)
    assert g.join("m", "n2", now=1.2)  # the first group's plan went out long ago
    assert g.close("m") == ["n2"]
    assert Groups(window_s=0.0).join("m", "n1", now=0.0)
