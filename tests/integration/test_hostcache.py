"""The loader's host block cache (services/loader/hostcache.py) filled by a multicast from a
peer's block server over real TCP on the loopback (the cache alone: tests/unit/test_hostcache.py)."""

from __future__ import annotations

import asyncio
import copy
import time
from pathlib import Path

from policy.eviction import choose_evictions, over_budget
from services.loader.blockset import bad_blocks
from services.loader.hostcache import HostCache, block_set
from services.loader.peer import BlockServer, Holding, PeerSource, receive
from shared.artifact import compiled_cache_dir
from shared.messages import Tier
from tests.unit.test_hostcache import DEVICE, MB, artifact, on_disk


def test_a_multicast_into_a_full_cache_evicts_by_cost_and_completes(tmp_path: Path) -> None:
    """What the loader's `Multicast` does: room made as a fill makes it (Tangram's choice),
    the blocks received over TCP and checked, the copy then cached like any other."""
    store = tmp_path / "store"
    big, small, new = artifact(store, "big", 12 * MB), artifact(store, "small", 2 * MB), artifact(store, "new", 3 * MB)
    cache = HostCache(tmp_path / "shm", budget_bytes=16 * MB)
    cache.stage(big, DEVICE)
    cache.stage(small, DEVICE)
    before = {k: copy.copy(r) for k, r in cache.entries.items()}
    expected = choose_evictions(before.values(), over_budget(before.values(), 16 * MB - 3 * MB), time.time())
    bs = block_set(new, DEVICE, Tier.STEADY)

    async def go() -> int:
        peer = BlockServer()  # another node holding `new` whole
        addr = await peer.start()
        peer.offer(Holding.complete(compiled_cache_dir(new, DEVICE), bs))
        place = cache.reserve(new, DEVICE, Tier.STEADY, bs.size)
        source = PeerSource(addr)
        try:
            got = await receive(Holding(place, bs), [(i, addr) for i in range(bs.blocks)], {addr: source}, [])
        finally:
            await source.close()
            await peer.close()
        cache.adopt(new, Tier.STEADY, bs.size, got.seconds)
        return got.blocks

    assert asyncio.run(go()) == bs.blocks
    assert set(cache.entries) == {"big", "small", "new"} - set(expected)
    assert on_disk(cache) == set(cache.entries) and cache.used_bytes <= 16 * MB
    assert bad_blocks(cache.place(new, DEVICE), bs) == []
    assert cache.verify(new, DEVICE) is not None  # a start now finds it: a hit
