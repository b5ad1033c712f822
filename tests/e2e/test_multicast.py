"""A model's compiled blob multicast between real loader processes over real NATS and TCP
(FaaScale PipeCast, `policy.multicast`): every block checked, a corrupt one refetched, a
loader killed mid-transfer routed around."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from ops import netns
from ops.loaders import LoaderClient
from ops.localcluster import LocalCluster, default_model_path
from policy.multicast import STORE, pipecast
from services.loader.blockset import BlockSet, bad_blocks, read_block
from services.loader.hostcache import block_set
from shared import subjects
from shared.artifact import has_torch_checkpoint, torch_checkpoint
from shared.bus import Bus
from shared.cache_messages import CacheStatus, MulticastDone, StageArtifact, Staged
from shared.errors import TesseraError
from shared.messages import Artifact, Tier
from shared.pipeline_messages import AwaitBlocks, BlocksHeld
from tests.conftest import TEST_ENV, running_cluster
from tests.helpers.cluster import wait_for

DEVICE = "CPU"
T = TypeVar("T")


@pytest.fixture(scope="module")
def loaders(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    """Four loaders and nothing else; uplinks shaped so a transfer lasts long enough to kill
    a peer in the middle of it (≈ 1 s a hop for the default model's blob)."""
    with running_cluster(
        tmp_path_factory.mktemp("loaders"),
        model_store,
        nodes=4,
        services=("loader",),
        timeout_s=120,
        TESSERA_FILL_DELAY_S="0",
        TESSERA_LINK_BPS=str(300e6),
    ) as c:
        yield c


def with_loaders(c: LocalCluster, work: Callable[[LoaderClient], Awaitable[T]]) -> T:
    """Run `work` with a client of the cluster's loaders on a bus connection of its own."""

    async def go() -> T:
        bus = Bus("test-multicast")
        await bus.connect(c.nats_url)
        try:
            return await work(LoaderClient(bus, DEVICE))
        finally:
            await bus.close()

    return asyncio.run(go())


def cached(c: LocalCluster, node: str) -> CacheStatus:
    return with_loaders(c, lambda loaders: loaders.status(node))


@pytest.fixture(scope="module")
def model(loaders: LocalCluster) -> tuple[Artifact, BlockSet, dict[str, str]]:
    """The default model imported, node-0's host cache holding its blob, the loaders' addresses."""
    artifact = with_loaders(loaders, lambda c: c.import_model(str(default_model_path())))
    with_loaders(loaders, lambda c: c.cache_on("node-0", artifact, timeout_s=60))
    addr = {f"node-{i}": cached(loaders, f"node-{i}").peer_addr for i in range(4)}
    assert all(a.startswith("127.0.0.1:") for a in addr.values()), addr
    return artifact, block_set(artifact, DEVICE, Tier.STEADY), addr


def copy_in(c: LocalCluster, node: str, artifact: Artifact, bs: BlockSet) -> Path:
    [blob] = [f.path for f in bs.files]
    [path] = list((c.host_cache / node / artifact.artifact_id).glob(f"*/{blob}"))
    return path.parent


def evict(c: LocalCluster, artifact: Artifact, targets: list[str]) -> None:
    with_loaders(c, lambda loaders: loaders.evict(targets, artifact))


def multicast(
    c: LocalCluster,
    artifact: Artifact,
    bs: BlockSet,
    addr: dict[str, str],
    targets: list[str],
    unawaited: frozenset[str] = frozenset(),
) -> dict[str, MulticastDone | str]:
    """Send each target (caches emptied: `evict`) its feeds of a PipeCast plan from node-0,
    and collect the answers, or the errors they gave (not those of `unawaited`: a loader
    killed never answers)."""
    plan = pipecast(["node-0"], targets, bs.blocks)
    feeds = {t: [(s.block, addr[s.src]) for s in plan.feeds(t)] for t in targets}
    _, done = with_loaders(
        c,
        lambda loaders: loaders.multicast(
            artifact, feeds, (addr["node-0"], STORE), block_timeout_s=10, unawaited=unawaited
        ),
    )
    return done


def test_a_pipecast_plan_brings_every_verified_block_to_every_target(
    loaders: LocalCluster, model: tuple[Artifact, BlockSet, dict[str, str]]
) -> None:
    artifact, bs, addr = model
    assert bs.blocks > 8  # enough blocks for a pipeline to matter
    targets = ["node-1", "node-2", "node-3"]
    evict(loaders, artifact, targets)
    done = multicast(loaders, artifact, bs, addr, targets)
    for t in targets:
        d = done[t]
        assert isinstance(d, MulticastDone), d
        assert d.blocks == bs.blocks and d.nbytes == bs.size and d.refetched == 0 and d.corrupt == 0
        assert bad_blocks(copy_in(loaders, t, artifact, bs), bs) == []
        # The host cache counts it: a start on this node is now a hit.
        assert [e.artifact_id for e in cached(loaders, t).entries] == [artifact.artifact_id]
    # The targets forwarded to each other: node-0 did not send every block three times.
    sent = {
        t: sum(
            float(line.split()[-1])
            for line in httpx.get(
                f"http://127.0.0.1:{loaders.procs[f'loader@{t}'].http_port}/metrics"
            ).text.splitlines()
            if line.startswith("tessera_loader_served_blocks_total ")
        )
        for t in ["node-0", *targets]
    }
    assert sum(sent[t] for t in targets) > 0, sent


def test_a_corrupt_block_on_the_source_is_detected_and_refetched_from_the_store(
    loaders: LocalCluster, model: tuple[Artifact, BlockSet, dict[str, str]]
) -> None:
    artifact, bs, addr = model
    src = copy_in(loaders, "node-0", artifact, bs)
    blob = src / bs.files[0].path
    good = read_block(src, bs, 3)
    with blob.open("r+b") as f:  # flip a byte of block 3 in node-0's host memory copy
        f.seek(3 * bs.block_bytes + 100)
        byte = f.read(1)
        f.seek(3 * bs.block_bytes + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        evict(loaders, artifact, ["node-1"])
        done = multicast(loaders, artifact, bs, addr, ["node-1"])
        d = done["node-1"]
        assert isinstance(d, MulticastDone), d
        assert d.corrupt >= 1 and d.refetched >= 1
        assert bad_blocks(copy_in(loaders, "node-1", artifact, bs), bs) == []
    finally:
        with blob.open("r+b") as f:
            f.seek(3 * bs.block_bytes)
            f.write(good)


def test_a_loader_killed_mid_transfer_is_routed_around(
    loaders: LocalCluster, model: tuple[Artifact, BlockSet, dict[str, str]]
) -> None:
    artifact, bs, addr = model
    targets = ["node-1", "node-2", "node-3"]
    plan = pipecast(["node-0"], targets, bs.blocks)
    # Someone was to receive from node-1 after its first blocks: killing it is a real fault.
    assert any(s.src == "node-1" for t in targets for s in plan.feeds(t))
    victim = loaders.procs["loader@node-1"]
    metrics = f"http://127.0.0.1:{victim.http_port}/metrics"

    def forwarding() -> bool:
        try:
            text = httpx.get(metrics, timeout=2).text
        except httpx.HTTPError:
            return False
        return any(
            line.startswith("tessera_loader_multicast_received_blocks ") and float(line.split()[-1]) >= 2
            for line in text.splitlines()
        )

    def kill_when_forwarding() -> None:
        wait_for(forwarding, 60, "node-1 to receive its first blocks", every_s=0.02)
        victim.kill()

    evict(loaders, artifact, targets)  # and their count of blocks received goes back to 0
    killer = threading.Thread(target=kill_when_forwarding, daemon=True)
    killer.start()
    try:
        outcome = multicast(loaders, artifact, bs, addr, targets, unawaited=frozenset({"node-1"}))
        killer.join(60)
        assert not victim.alive(), "node-1 was never killed"
        for t in ["node-2", "node-3"]:
            d = outcome[t]
            assert isinstance(d, MulticastDone), d  # the scale-out completed without node-1
            assert d.blocks == bs.blocks
            assert bad_blocks(copy_in(loaders, t, artifact, bs), bs) == []
        # Blocks planned from node-1 after it died came from the fallback.
        assert sum(d.refetched for d in outcome.values() if isinstance(d, MulticastDone)) > 0
        assert any(
            isinstance(d, MulticastDone) and any(addr["node-1"] in x for x in d.dead_sources) for d in outcome.values()
        )
    finally:
        loaders.restart("loader@node-1")


def test_loaders_in_network_namespaces_multicast_over_shaped_links(
    tmp_path: Path, model_store: Path, model: tuple[Artifact, BlockSet, dict[str, str]]
) -> None:
    """Each loader in a namespace of its own, its link a `tc` token bucket each way: the
    multicast goes over real (virtual) network links between hosts, not the loopback."""
    why_not = netns.unavailable()
    if why_not:
        pytest.skip(f"no network namespaces here: {why_not}")
    artifact, bs, _ = model
    names = ["node-0", "node-1", "node-2"]
    spaces = netns.NetNamespaces(str(tmp_path), names, link_mbit=2000)
    c = LocalCluster(
        home=tmp_path / "home",
        nodes=3,
        store=model_store,
        services=("loader",),
        env={**TEST_ENV, "TESSERA_FILL_DELAY_S": "0"},
        netns=spaces,
    )
    c.start(timeout_s=120)
    try:
        with_loaders(c, lambda loaders: loaders.cache_on("node-0", artifact, timeout_s=60))
        addr = {n: cached(c, n).peer_addr for n in names}
        # Every loader serves at its own namespace's address, behind a shaped link.
        assert {a.rsplit(":", 1)[0] for a in addr.values()} == {spaces.ip(n) for n in names}
        for n in names:
            shown = subprocess.run(
                [*spaces.prefix(n), "tc", "qdisc", "show"], capture_output=True, text=True, check=True
            ).stdout
            assert "tbf" in shown and "rate 2Gbit" in shown, shown
        evict(c, artifact, ["node-1", "node-2"])
        done = multicast(c, artifact, bs, addr, ["node-1", "node-2"])
        for t in ("node-1", "node-2"):
            d = done[t]
            assert isinstance(d, MulticastDone), d
            assert d.blocks == bs.blocks and d.refetched == 0
            assert bad_blocks(copy_in(c, t, artifact, bs), bs) == []
    finally:
        c.stop()
    # Nothing of the namespaces is left behind.
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(spaces.namespace(n) in left for n in names), left


def test_a_copy_evicted_while_it_arrives_is_not_cached(
    loaders: LocalCluster, model: tuple[Artifact, BlockSet, dict[str, str]]
) -> None:
    """An eviction during a multicast removes the copy under way: the multicast fails (its
    caller hears so) rather than count a copy with no files as cached; the next one works."""
    artifact, bs, addr = model
    target = loaders.procs["loader@node-2"]
    metrics = f"http://127.0.0.1:{target.http_port}/metrics"

    def receiving() -> bool:
        text = httpx.get(metrics, timeout=2).text
        return any(
            line.startswith("tessera_loader_multicast_received_blocks ") and float(line.split()[-1]) >= 2
            for line in text.splitlines()
        )

    def evict_when_receiving() -> None:
        wait_for(receiving, 60, "node-2 to receive its first blocks", every_s=0.02)
        evict(loaders, artifact, ["node-2"])

    evict(loaders, artifact, ["node-2"])
    evicter = threading.Thread(target=evict_when_receiving, daemon=True)
    evicter.start()
    done = multicast(loaders, artifact, bs, addr, ["node-2"])
    evicter.join(60)
    assert not isinstance(done["node-2"], MulticastDone), done  # failed, and said so
    assert "evicted while it arrived" in str(done["node-2"]), done
    assert cached(loaders, "node-2").entries == ()
    again = multicast(loaders, artifact, bs, addr, ["node-2"])["node-2"]
    assert isinstance(again, MulticastDone) and again.blocks == bs.blocks
    assert bad_blocks(copy_in(loaders, "node-2", artifact, bs), bs) == []


def test_a_start_waiting_for_a_failed_multicast_reads_the_store(
    loaders: LocalCluster, model: tuple[Artifact, BlockSet, dict[str, str]]
) -> None:
    """A start's stage of an artifact whose multicast is under way waits for it; when the
    multicast fails (its only source never answers), the stage reads the store's copy instead
    and the node caches the model behind it. Had the stage not waited, its fill would have
    been skipped for the multicast under way, and nothing would cache the model."""
    artifact, bs, _ = model
    evict(loaders, artifact, ["node-3"])
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, reads, never answers
    asked = threading.Event()

    def listen() -> None:
        conn, _ = silent.accept()
        conn.recv(1024)  # the block request: the multicast is under way
        asked.set()
        conn.recv(1024)  # held open until the receiver gives up and closes
        conn.close()

    threading.Thread(target=listen, daemon=True).start()
    host, port = silent.getsockname()

    async def work(client: LoaderClient) -> tuple[str, Staged, str]:
        feeds = {"node-3": [(i, f"{host}:{port}") for i in range(bs.blocks)]}
        under_way = asyncio.create_task(client.multicast(artifact, feeds, (), block_timeout_s=3))
        assert await asyncio.to_thread(asked.wait, 60), "the multicast never asked its source"
        # A pipeline stage waiting for blocks of it (FaaScale §4.3) hears of the failure.
        stage = asyncio.create_task(
            client.bus.request(
                subjects.loader_await_blocks("node-3"),
                AwaitBlocks(artifact=artifact, blocks=(0, 1), timeout_s=120),
                BlocksHeld,
                timeout=120,
            )
        )
        staged = await client.bus.request(
            subjects.loader_stage("node-3"), StageArtifact(artifact=artifact, device=DEVICE), Staged, timeout=120
        )
        _, answers = await under_way
        try:
            held = f"held: {await stage}"
        except TesseraError as e:
            held = e.message
        return str(answers["node-3"]), staged, held

    try:
        answer, staged, held = with_loaders(loaders, work)
    finally:
        silent.close()
    assert not answer.startswith("MulticastDone("), answer  # it failed, and said so
    assert "failed before block 0" in held, held  # an answer, not a wait to its timeout
    assert staged.hit is False  # the store's copy
    wait_for(lambda: cached(loaders, "node-3").entries, 60, "node-3 to cache the model after the start")


def test_a_torch_checkpoint_moves_along_the_same_plan(
    loaders: LocalCluster, model: tuple[Artifact, BlockSet, dict[str, str]], request: pytest.FixtureRequest
) -> None:
    """What a torch node's starts load (`Tier.TORCH`: the checkpoint's directory, several
    files as one block set) is cached and multicast like a blob: every file arrives whole."""
    pytest.importorskip("torch", reason="writing a torch checkpoint needs torch")

    artifact, _, addr = model
    if not has_torch_checkpoint(artifact):  # a torch node's registration writes it (float32 here)
        # The run's copy of the default model's checkpoint (materialized once for the run),
        # renamed into place whole as the loader does.
        made: Path = request.getfixturevalue("torch_checkpoint_f32")
        tmp = torch_checkpoint(artifact).with_name(".torch-copy")
        shutil.copytree(made, tmp)
        tmp.rename(torch_checkpoint(artifact))
    bs = block_set(artifact, DEVICE, Tier.TORCH)
    assert len(bs.files) > 1 and bs.blocks > 8
    targets = ["node-1", "node-2"]
    evict(loaders, artifact, ["node-0", *targets])
    try:
        with_loaders(loaders, lambda c: c.cache_on("node-0", artifact, timeout_s=60, tier=Tier.TORCH))
        plan = pipecast(["node-0"], targets, bs.blocks)
        feeds = {t: [(s.block, addr[s.src]) for s in plan.feeds(t)] for t in targets}
        _, done = with_loaders(
            loaders, lambda c: c.multicast(artifact, feeds, (addr["node-0"], STORE), tier=Tier.TORCH)
        )
        store = {p.name: p.read_bytes() for p in torch_checkpoint(artifact).iterdir() if p.is_file()}
        for t in targets:
            d = done[t]
            assert isinstance(d, MulticastDone) and d.blocks == bs.blocks and d.corrupt == 0, d
            copy = loaders.host_cache / t / artifact.artifact_id / "torch"
            assert {p.name: p.read_bytes() for p in copy.iterdir()} == store
            assert [(e.artifact_id, e.tier) for e in cached(loaders, t).entries] == [(artifact.artifact_id, "torch")]
    finally:  # the other tests expect node-0 to hold the blob
        evict(loaders, artifact, ["node-0", *targets])
        with_loaders(loaders, lambda c: c.cache_on("node-0", artifact, timeout_s=60))
