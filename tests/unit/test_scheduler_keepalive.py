"""The scheduler's keep-alive loop while Valkey is down: one warning when its passes start
failing, one line when they work again, and no traceback per pass in between."""

from __future__ import annotations

import asyncio
import logging

import pytest

from services.scheduler.service import SchedulerService
from services.scheduler.settings import SchedulerSettings
from shared.adapters import AdapterRecord
from shared.messages import ModelRecord
from shared.registry import Registry


class FlakyRegistry(Registry):
    """Valkey down for the first `failures` reads, then up; each read is counted."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.reads = 0
        self.read = asyncio.Event()

    async def all(self) -> list[ModelRecord]:
        self.reads += 1
        self.read.set()
        if self.reads <= self.failures:
            raise ConnectionError("Error 111 connecting to valkey. Connection refused.")
        return []

    async def adapters(self, base: str | None = None) -> list[AdapterRecord]:
        return []

    async def reads_reach(self, n: int) -> None:
        while self.reads < n:
            self.read.clear()
            await self.read.wait()


async def test_valkey_down_is_logged_once_and_its_return_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="services.scheduler.service")
    registry = FlakyRegistry(failures=6)
    scheduler = SchedulerService(SchedulerSettings(keep_alive_check_s=0.005), None, registry)  # type: ignore[arg-type]
    loop = asyncio.create_task(scheduler._keepalive_loop())
    try:
        await asyncio.wait_for(
            registry.reads_reach(8), 60
        )  # a bound on a hang only; 6 failures, then 2 passes that work
    finally:
        loop.cancel()
    records = [r for r in caplog.records if r.name == "services.scheduler.service"]
    assert [r.levelno for r in records] == [logging.WARNING, logging.INFO], [r.getMessage() for r in records]
    assert "ConnectionError" in records[0].getMessage()
    assert "after 6 failures" in records[1].getMessage()
