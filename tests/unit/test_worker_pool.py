"""When the pool warms a replacement: only once the start that took a warm worker has its
first token (a replacement warming meanwhile takes the cores that start needs)."""

from __future__ import annotations

import asyncio

from services.engine.backends import OPENVINO, WorkerSpec
from services.engine.worker_pool import Worker, WorkerPool


class FakeWorker:
    """Stands in for a worker process: ready at once, counts its spawns."""

    spawned = 0

    def __init__(self) -> None:
        FakeWorker.spawned += 1
        self.dead = False

    async def ready(self, timeout_s: float) -> None:
        return None

    def stop(self) -> None:
        self.dead = True

    def rss_bytes(self) -> int:
        return 0


def pool() -> WorkerPool:
    FakeWorker.spawned = 0

    def spawn() -> Worker:
        return FakeWorker()  # type: ignore[return-value]

    return WorkerPool(1, OPENVINO, WorkerSpec("CPU", 1), refill_delay_s=60.0, spawn=spawn)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)  # sync-ok: lets the pool's refill task run, so a spawn it should not make would show


async def test_the_replacement_warms_on_the_taking_starts_first_token() -> None:
    p = pool()
    p.refill()
    await settle()
    assert len(p.idle) == 1 and FakeWorker.spawned == 1
    await p.take()
    await settle()
    assert FakeWorker.spawned == 1, "the replacement must wait for the start's first token"
    p.start_done()
    await settle()
    assert FakeWorker.spawned == 2 and len(p.idle) == 1
    p.close()


async def test_a_kick_left_by_a_start_without_a_warm_worker_does_not_release_the_next() -> None:
    p = pool()
    p.refill()
    await settle()
    p.start_done()  # a resident model's start: it took no warm worker
    await settle()
    await p.take()
    await settle()
    assert FakeWorker.spawned == 1, "a stale kick released the replacement during the start"
    p.start_done()
    await settle()
    assert FakeWorker.spawned == 2
    p.close()
