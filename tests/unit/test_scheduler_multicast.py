"""Which loaders a scale-out's multicast reads from and sends to (services/scheduler/multicast.py):
the holders of the artifact, in the tier their starts cached, and the store; the targets that
lack it."""

from __future__ import annotations

from policy.multicast import STORE, pipecast
from services.scheduler.multicast import choose
from shared.cache_messages import CachedArtifact, CacheStatus
from shared.messages import Tier
from tests.helpers.records import RECORD


def status(node: str, *held: tuple[str, str], addr: str | None = None, torch: bool = False) -> CacheStatus:
    return CacheStatus(
        node_id=node,
        budget_bytes=1 << 30,
        used_bytes=0,
        entries=tuple(CachedArtifact(artifact_id=a, nbytes=1, tier=t, uses=1, last_used=0.0) for a, t in held),
        peer_addr=f"10.0.0.{node[-1]}:7000" if addr is None else addr,
        device="CPU",
        torch=torch,
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
    assert [o.nodes for o in got] == [("node-3",)]  # the order goes to its targets alone
    got = got[0].multicast
    assert got.plan_sources == ("10.0.0.0:7000", "10.0.0.2:7000", STORE)  # the store feeds a sub-group too
    assert got.plan_targets == ("10.0.0.3:7000",)
    assert got.fallbacks == ("10.0.0.0:7000", "10.0.0.2:7000", STORE)
    assert got.tier == Tier.START and got.device == "CPU" and got.artifact == RECORD.artifact
    # Every target derives its feeds from these: one plan, the same on every node.
    plan = pipecast(got.plan_sources, got.plan_targets, 8)
    assert {s.src for s in plan.feeds("10.0.0.3:7000")} <= set(got.plan_sources)


def test_no_multicast_without_a_holder_or_a_target_in_need() -> None:
    assert choose(RECORD, ["node-0"], ["node-1"], {"node-0": status("node-0"), "node-1": status("node-1")}) == []
    assert (
        choose(
            RECORD,
            ["node-0"],
            ["node-1"],
            {"node-0": status("node-0", ("a1", "steady")), "node-1": status("node-1", ("a1", "steady"))},
        )
        == []
    )
    # A loader that did not answer, or serves no blocks, is neither a source nor a target.
    assert choose(RECORD, ["node-0"], ["node-1"], {"node-1": status("node-1")}) == []
    assert (
        choose(
            RECORD,
            ["node-0"],
            ["node-1"],
            {"node-0": status("node-0", ("a1", "start"), addr=""), "node-1": status("node-1")},
        )
        == []
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
    assert len(got) == 1 and got[0].multicast.tier == Tier.STEADY
    assert got[0].multicast.plan_sources == ("10.0.0.0:7000", STORE)


def test_a_torch_checkpoint_goes_only_to_torch_nodes_and_a_blob_only_to_openvino_nodes() -> None:
    """In a mixed cluster each target loads one form: a plan per form, from the holders of
    that form to the targets that load it."""
    statuses = {
        "node-0": status("node-0", ("a1", "torch"), torch=True),
        "node-1": status("node-1", torch=True),
        "node-2": status("node-2"),  # an OpenVINO node: the checkpoint is of no use to it
        "node-3": status("node-3", torch=True),
        "node-4": status("node-4", ("a1", "steady")),
    }
    targets = ["node-1", "node-2", "node-3"]
    blob, ckpt = choose(RECORD, ["node-0", "node-4"], targets, statuses)
    assert blob.multicast.tier == Tier.STEADY and blob.nodes == ("node-2",)
    assert blob.multicast.plan_sources == ("10.0.0.4:7000", STORE)
    assert ckpt.multicast.tier == Tier.TORCH and ckpt.nodes == ("node-1", "node-3")
    assert ckpt.multicast.plan_sources == ("10.0.0.0:7000", STORE)
    assert ckpt.multicast.plan_targets == ("10.0.0.1:7000", "10.0.0.3:7000")
    # No holder of a form: its targets read the store.
    (only,) = choose(RECORD, ["node-0"], targets, statuses)
    assert only.multicast.tier == Tier.TORCH and only.nodes == ("node-1", "node-3")
    assert choose(RECORD, ["node-0"], ["node-2"], statuses) == []
