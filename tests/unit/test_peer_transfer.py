"""Block sets (services/loader/blockset.py) and a shaped link, in one process (the transfers
over real TCP between block servers: tests/integration/test_peer_transfer.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from services.loader.blockset import bad_blocks, block_set_of, prepare, read_block, write_block
from services.loader.peer import Link


def test_a_block_set_spans_files_and_round_trips(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a").write_bytes(b"x" * 10)
    (src / "sub" / "b").write_bytes(b"y" * 25)
    bs = block_set_of(src, ["a", "sub/b"], "s", 16)
    assert bs.blocks == 3 and bs.size == 35 and [bs.block_len(i) for i in range(3)] == [16, 16, 3]
    assert read_block(src, bs, 0) == b"x" * 10 + b"y" * 6
    dst = tmp_path / "dst"
    prepare(dst, bs)
    assert bad_blocks(dst, bs) == [0, 1, 2]
    for i in (2, 0, 1):  # any order
        write_block(dst, bs, i, read_block(src, bs, i))
    assert bad_blocks(dst, bs) == []
    assert (dst / "sub" / "b").read_bytes() == b"y" * 25


def test_a_shaped_link_paces_what_it_carries() -> None:
    async def go() -> float:
        link = Link(bps=4 * 1024 * 1024)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.gather(*(link.carry(1024 * 1024) for _ in range(2)))  # 2 MiB at 4 MiB/s
        return loop.time() - t0

    assert asyncio.run(go()) >= 0.5
