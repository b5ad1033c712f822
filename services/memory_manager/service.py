"""Memory manager bus handlers: every reservation on this node goes through its budget."""

from __future__ import annotations

from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge

from services.memory_manager.policy import Budget
from services.memory_manager.settings import MemoryManagerSettings
from shared import subjects
from shared.bus import Bus, decode
from shared.messages import Release, Reserve, ReserveResult

USED = Gauge("tessera_memory_used_bytes", "Bytes reserved on this node")
BUDGET = Gauge("tessera_memory_budget_bytes", "Bytes this node may reserve")
DENIED = Counter("tessera_memory_denied_total", "Reservations refused for lack of memory")


class MemoryManagerService:
    def __init__(self, settings: MemoryManagerSettings, bus: Bus) -> None:
        self.bus = bus
        self.node = settings.node_id
        self.budget = Budget(settings.memory_budget_bytes)
        BUDGET.set(settings.memory_budget_bytes)

    async def start(self) -> None:
        await self.bus.subscribe(subjects.memory_reserve(self.node), self.on_reserve)
        await self.bus.subscribe(subjects.memory_release(self.node), self.on_release)

    async def on_reserve(self, msg: Msg) -> None:
        req = decode(msg.data, Reserve)
        granted = self.budget.reserve(req.owner, req.nbytes)
        if not granted:
            DENIED.inc()
        USED.set(self.budget.used_bytes)
        await self.bus.reply(
            msg,
            ReserveResult(
                granted=granted,
                used_bytes=self.budget.used_bytes,
                budget_bytes=self.budget.budget_bytes,
            ),
        )

    async def on_release(self, msg: Msg) -> None:
        self.budget.release(decode(msg.data, Release).owner)
        USED.set(self.budget.used_bytes)
