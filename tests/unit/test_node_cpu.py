"""A start's cores beside busy instances (TESSERA_START_CPU_SHARE) and the tier-up that waits
for an idle node (TESSERA_TIER_UP_IDLE_S): policy/node_cpu.py, as the engine runs it."""

from __future__ import annotations

import pytest

from policy.node_cpu import StartTierWorker, next_tier_up, start_cores


@pytest.mark.parametrize("share", [0.25, 0.5, 1.0])
def test_a_start_on_an_idle_node_gets_every_core_whatever_the_share(share: float) -> None:
    assert start_cores([0, 1, 2, 3], share, others_busy=False) is None


@pytest.mark.parametrize(
    ("cores", "share", "expected"),
    [
        ([0, 1, 2, 3], 0.5, (2, 3)),  # the last half: the busy ones' inference threads pin from the first
        ([3, 1, 2, 0], 0.25, (3,)),  # in core order, whatever order they were listed in
        ([4, 5, 6, 7, 8, 9], 0.5, (7, 8, 9)),
        ([0, 1], 0.1, (1,)),  # one core at least
        ([0, 1], 1.0, None),  # the default: no bound
        ([5], 0.5, None),  # a one-core node has nothing to keep back
    ],
)
def test_a_start_beside_busy_instances_gets_its_share_of_the_cores(
    cores: list[int], share: float, expected: tuple[int, ...] | None
) -> None:
    assert start_cores(cores, share, others_busy=True) == expected


def start(key: str, **kw: bool) -> StartTierWorker:
    return StartTierWorker(key, on_start_tier=True, **kw)


def test_no_tier_up_while_anything_runs_or_before_the_node_has_been_idle_long_enough() -> None:
    workers = [start("a")]
    assert next_tier_up(workers, idle_since=None, now=100.0, idle_s=0.5) is None
    assert next_tier_up(workers, idle_since=99.7, now=100.0, idle_s=0.5) is None
    assert next_tier_up(workers, idle_since=99.5, now=100.0, idle_s=0.5) == "a"


def test_one_tier_up_at_a_time_and_never_one_that_failed_or_is_on_its_steady_tier() -> None:
    steady = StartTierWorker("s", on_start_tier=False)
    assert next_tier_up([steady, start("a"), start("b")], 0.0, 10.0, 0.5) == "a"
    assert next_tier_up([start("a", tiering=True), start("b")], 0.0, 10.0, 0.5) is None
    assert next_tier_up([start("a", tier_up_failed=True), start("b")], 0.0, 10.0, 0.5) == "b"
    assert next_tier_up([steady, start("a", tier_up_failed=True)], 0.0, 10.0, 0.5) is None
