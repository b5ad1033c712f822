"""Blocks over real TCP on the loopback between block servers: a PipeCast plan carried out,
a peer that dies mid-transfer routed around, a corrupt block detected and refetched."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from policy.multicast import STORE, pipecast
from services.loader.blockset import BlockSet, bad_blocks, block_set_of, prepare, read_block, write_block
from services.loader.peer import BlockServer, DirectoryStore, Holding, Link, PeerSource, Received, receive

BLOCK = 64 * 1024


def make_set(root: Path) -> BlockSet:
    root.mkdir(parents=True)
    # Two files whose sizes are not multiples of the block: blocks span the boundary.
    (root / "model.bin").write_bytes(os.urandom(5 * BLOCK + 1234))
    (root / "sub").mkdir()
    (root / "sub" / "model.xml").write_bytes(os.urandom(BLOCK // 3))
    return block_set_of(root, ["sub/model.xml", "model.bin"], "set-1", BLOCK)


async def multicast(
    tmp_path: Path, n: int, *, kill_after: int | None = None, corrupt_source_block: int | None = None
) -> tuple[BlockSet, dict[str, Received], dict[str, Path], dict[str, BlockServer]]:
    src_root = tmp_path / "store"
    bs = make_set(src_root)
    if corrupt_source_block is not None:
        # The source node's copy (not the store's) has one bad block.
        peer_root = tmp_path / "peer"
        prepare(peer_root, bs)
        for i in range(bs.blocks):
            data = read_block(src_root, bs, i)
            write_block(peer_root, bs, i, data if i != corrupt_source_block else bytes(len(data)))
    else:
        peer_root = src_root
    names = ["src"] + [f"t{i}" for i in range(n)]
    servers = {name: BlockServer(Link()) for name in names}
    addrs = {name: await servers[name].start() for name in names}
    servers["src"].offer(Holding.complete(peer_root, bs))
    roots = {name: tmp_path / name for name in names[1:]}
    holdings = {name: Holding(roots[name], bs) for name in names[1:]}
    for name, h in holdings.items():
        servers[name].offer(h)
    plan = pipecast(["src"], names[1:], bs.blocks)
    victim = "t0"

    async def maybe_kill(_: int) -> None:
        if kill_after is not None and len(holdings[victim].have) == kill_after:
            await servers[victim].close()  # t0 keeps receiving; it no longer forwards

    async def one(name: str) -> Received:
        sources = {f"{STORE}": DirectoryStore(src_root)} | {m: PeerSource(addrs[m]) for m in names if m != name}
        try:
            return await receive(
                holdings[name],
                [(s.block, s.src) for s in plan.feeds(name)],
                sources,
                fallbacks=[STORE],
                timeout_s=10,
                on_block=maybe_kill if name == victim else None,
            )
        finally:
            for s in sources.values():
                await s.close()

    try:
        got = dict(zip(names[1:], await asyncio.gather(*(one(m) for m in names[1:])), strict=True))
    finally:
        for s in servers.values():
            await s.close()
    return bs, got, roots, servers


def test_a_pipecast_plan_over_tcp_gives_every_target_every_byte(tmp_path: Path) -> None:
    bs, got, roots, servers = asyncio.run(multicast(tmp_path, 4))
    for name, r in got.items():
        assert bad_blocks(roots[name], bs) == [], name
        assert (roots[name] / "model.bin").read_bytes() == (tmp_path / "store" / "model.bin").read_bytes()
        assert r.blocks == bs.blocks and r.refetched == 0 and r.corrupt == 0
    # The targets forwarded: the source sent each block about once, not once per target.
    assert servers["src"].served_blocks < 2 * bs.blocks
    assert sum(servers[f"t{i}"].served_blocks for i in range(4)) >= 4 * bs.blocks - servers["src"].served_blocks


def test_a_peer_that_dies_mid_transfer_is_routed_around(tmp_path: Path) -> None:
    bs, got, roots, _ = asyncio.run(multicast(tmp_path, 4, kill_after=2))
    for name in got:
        assert bad_blocks(roots[name], bs) == [], name
    # Someone was to get blocks from t0 after it died, and got them from the store instead.
    assert sum(r.refetched for r in got.values()) > 0
    assert any("t0" in r.dead_sources for r in got.values())


def test_a_corrupt_block_from_a_peer_is_detected_and_refetched(tmp_path: Path) -> None:
    bs, got, roots, _ = asyncio.run(multicast(tmp_path, 1, corrupt_source_block=3))
    assert bad_blocks(roots["t0"], bs) == []
    assert got["t0"].corrupt == 1 and got["t0"].refetched == 1


def test_no_source_left_fails_the_transfer(tmp_path: Path) -> None:
    bs = make_set(tmp_path / "store")
    holding = Holding(tmp_path / "t", bs)

    async def go() -> None:
        await receive(holding, [(0, "gone")], {"gone": PeerSource("127.0.0.1:1")}, fallbacks=[], timeout_s=2)

    with pytest.raises(Exception, match="no source could supply block 0"):
        asyncio.run(go())


def test_a_request_that_arrives_before_its_set_is_offered_waits_for_it(tmp_path: Path) -> None:
    # Every target gets its order at once, so a target may ask a peer for a block before
    # the peer's own order (which offers the set) has reached it: that peer is not dead.
    bs = make_set(tmp_path / "store")

    async def go() -> bytes:
        server = BlockServer()
        addr = await server.start()
        source = PeerSource(addr)
        try:
            asked = asyncio.create_task(source.get(bs, 2, timeout_s=10))
            while not server.awaiting_offer:  # noqa: ASYNC110 (the server has no event to wait on)
                await asyncio.sleep(0.01)  # sync-ok: polling the server's state, under the get's timeout
            server.offer(Holding.complete(tmp_path / "store", bs))
            return await asked
        finally:
            await source.close()
            await server.close()

    assert asyncio.run(go()) == read_block(tmp_path / "store", bs, 2)
