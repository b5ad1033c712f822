"""Scale-outs of a model that begin within the window share one multicast plan."""

from __future__ import annotations

from policy.multicast_groups import Groups, Joined


def test_scale_outs_within_the_window_join_the_first_ones_group() -> None:
    g = Groups(window_s=0.5)
    first = g.join("m", "n1", now=10.0)
    assert first.opened  # its caller sends the plan when due
    assert g.join("m", "n2", now=10.125) == Joined(first.group, False)
    assert g.join("m", "n2", now=10.25) == Joined(first.group, False)  # the same node once
    other = g.join("other", "n3", now=10.375)
    assert other.opened and other.group != first.group  # another model: a group of its own
    assert not g.join("m", "n4", now=10.5).opened  # the window's edge still joins
    assert g.due(first.group) == 10.5
    assert g.close(first.group) == ["n1", "n2", "n4"]
    assert g.close(other.group) == ["n3"]
    assert g.close(first.group) == []


def test_a_scale_out_after_the_window_opens_a_new_group_the_old_one_keeps_its_own() -> None:
    # The opener of the first group has not woken to close it yet when a late scale-out comes:
    # the late one opens a group of its own, and each closes with its own targets.
    g = Groups(window_s=0.5)
    first = g.join("m", "n1", now=1.0)
    assert not g.join("m", "n2", now=1.25).opened
    late = g.join("m", "n3", now=1.75)
    assert late.opened and late.group != first.group
    assert not g.join("m", "n4", now=1.875).opened  # joins the late group, the open one
    assert g.close(first.group) == ["n1", "n2"]
    assert not g.join("m", "n5", now=2.0).opened  # the late group is still open
    assert g.close(late.group) == ["n3", "n4", "n5"]
    assert g.join("m", "n6", now=2.0).opened  # closed: the next opens another
    assert Groups(window_s=0.0).join("m", "n1", now=0.0).opened
