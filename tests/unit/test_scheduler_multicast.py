"""Which loaders a scale-out's multicast reads from and sends to (services/scheduler/multicast.py):
the holders of the artifact, in the tier their starts cached; the targets that lack it."""

from __future__ import annotations

from policy.multicast import STORE, pipecast
from services.scheduler.multicast import choose
from shared.messages import CachedArtifact, CacheStatus, Tier
from tests.helpers.records import RECORD


def status(node: str, *held: tuple[str, str], addr: str | None = None) -> CacheStatus:
    return CacheStatus(
        node_id=node,
        budget_bytes=1 << 30,
        used_bytes=0,
        entries=tuple(CachedArtifact(artifact_id=a, nbytes=1, tier=t, uses=1, last_used=0.0) for a, t in held),
        peer_addr=f"10.0.0.{node[-1]}:7000" if addr is None else addr,
        device="CPU",
    )


def test_the_holders_feed_the_targets_that_lack_it_with_the_store_last() -> None:
    got = choose(
        RECORD,
        ["node-0", "node-1", "node-2"],
        ["node-3", "node-4"],
        {
            "node-0": status("node-0", ("a1", "start")),
            "node-1": status("node-1", ("other", "start")),  # runs it, but its cache lost the blob
            "node-2": status("node-2", ("a1", "start")),
            "node-3": status("node-3"),
            "node-4": status("node-4", ("a1", "start")),  # already has it
        },
    )
    assert got is not None
    assert got.plan_sources == ("10.0.0.0:7000", "10.0.0.2:7000")
    assert got.plan_targets == ("10.0.0.3:7000",)
    assert got.fallbacks == ("10.0.0.0:7000", "10.0.0.2:7000", STORE)
    assert got.tier == Tier.START and got.device == "CPU" and got.artifact == RECORD.artifact
    # Every target derives its feeds from these: one plan, the same on every node.
    plan = pipecast(got.plan_sources, got.plan_targets, 8)
    assert {s.src for s in plan.feeds("10.0.0.3:7000")} <= set(got.plan_sources)


def test_no_multicast_without_a_holder_or_a_target_in_need() -> None:
    assert choose(RECORD, ["node-0"], ["node-1"], {"node-0": status("node-0"), "node-1": status("node-1")}) is None
    assert (
        choose(
            RECORD,
            ["node-0"],
            ["node-1"],
            {"node-0": status("node-0", ("a1", "steady")), "node-1": status("node-1", ("a1", "steady"))},
        )
        is None
    )
    # A loader that did not answer, or serves no blocks, is neither a source nor a target.
    assert choose(RECORD, ["node-0"], ["node-1"], {"node-1": status("node-1")}) is None
    assert (
        choose(
            RECORD,
            ["node-0"],
            ["node-1"],
            {"node-0": status("node-0", ("a1", "start"), addr=""), "node-1": status("node-1")},
        )
        is None
    )


def test_sources_are_the_holders_of_the_first_holders_tier() -> None:
    got = choose(
        RECORD,
        ["node-0", "node-1"],
        ["node-2"],
        {
            "node-0": status("node-0", ("a1", "steady")),
            "node-1": status("node-1", ("a1", "start")),
            "node-2": status("node-2"),
        },
    )
    assert got is not None and got.tier == Tier.STEADY and got.plan_sources == ("10.0.0.0:7000",)
