"""Memory manager bus handlers: every load, unload and KV resize on this node goes through its
reservation station (LLM-Mesh §6.3, `station.py`).

A `Reserve` is issued into the station (refused at once if the optimistic budget cannot take
it) and answered once the station dispatches it: at once, unless a conflicting operation on
the same region is running or the memory it needs is still physically held by a shrink in
flight. The engine reports the load's end with `ReserveDone`, which completes the operation;
a `Release` is an unload, complete as soon as it is dispatched (the engine releases what it
has already freed).
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge

from policy.station import MemOp, OpKind, Station
from services.memory_manager.settings import MemoryManagerSettings
from shared import subjects
from shared.bus import Bus, decode
from shared.messages import Release, Reserve, ReserveDone, ReserveResult

log = logging.getLogger(__name__)

USED = Gauge(
    "tessera_memory_used_bytes", "Bytes reserved on this node (optimistic: accepted operations at their target size)"
)
PHYSICAL = Gauge("tessera_memory_physical_bytes", "Bytes that may be held right now (pessimistic view)")
BUDGET = Gauge("tessera_memory_budget_bytes", "Bytes this node may reserve")
DENIED = Counter("tessera_memory_denied_total", "Reservations refused for lack of memory")
OPS = Counter("tessera_memory_operations_total", "Operations through the reservation station", ["kind"])
REGION = Gauge(
    "tessera_memory_region_bytes",
    "Bytes reserved per region (optimistic): weights:<artifact>, <model>:kv, a torch node's arena weights:node-arena",
    ["region"],
)
WAITING = Gauge("tessera_memory_waiting_operations", "Accepted operations waiting on a hazard or on memory")


def regions_of(owner: str, regions: list[str]) -> list[str]:
    """The regions a release names: itself, its `owner:*` parts, or every region for `*`."""
    return [r for r in regions if owner == "*" or r == owner or r.startswith(owner + ":")]


class MemoryManagerService:
    def __init__(self, settings: MemoryManagerSettings, bus: Bus) -> None:
        self.bus = bus
        self.node = settings.node_id
        self.station = Station(settings.memory_budget_bytes)
        self._ids = itertools.count(1)
        self._started: dict[int, asyncio.Event] = {}
        self._running: dict[str, int] = {}
        """Region → the granted load/resize the engine has not reported done yet."""
        self._shown: set[str] = set()
        """Regions the per-region gauge shows."""
        BUDGET.set(settings.memory_budget_bytes)

    async def close(self) -> None:
        """Nothing of its own to stop: its subscriptions end with the runtime's bus."""

    async def start(self) -> None:
        await self.bus.subscribe(subjects.memory_reserve(self.node), self.on_reserve)
        await self.bus.subscribe(subjects.memory_done(self.node), self.on_done)
        await self.bus.subscribe(subjects.memory_release(self.node), self.on_release)

    def _update_gauges(self) -> None:
        USED.set(self.station.optimistic_bytes)
        regions = {r: n for r, n in self.station.target.items() if n}
        for gone in self._shown - set(regions):
            REGION.remove(gone)
        for region, nbytes in regions.items():
            REGION.labels(region).set(nbytes)
        self._shown = set(regions)
        PHYSICAL.set(self.station.pessimistic_bytes)
        WAITING.set(len(self.station.waiting))

    def _dispatch(self) -> None:
        for op in self.station.dispatch():
            if op.kind == OpKind.UNLOAD:
                self.station.complete(op.op_id)  # already freed by the engine
            else:
                self._running[op.region] = op.op_id
            started = self._started.pop(op.op_id, None)
            if started is not None:
                started.set()
        self._update_gauges()

    def _complete(self, region: str) -> None:
        op_id = self._running.pop(region, None)
        if op_id is not None and op_id in self.station.running:
            self.station.complete(op_id)

    def _issue(self, op: MemOp) -> asyncio.Event | None:
        """Issue `op`; None if the station refuses it, else an event set when it starts."""
        if self.station.issue(op) is not None:
            return None
        OPS.labels(op.kind.value).inc()
        started = self._started[op.op_id] = asyncio.Event()
        self._dispatch()
        return started

    async def on_reserve(self, msg: Msg) -> None:
        req = decode(msg.data, Reserve)
        # A new size for a region whose last load the engine never reported done (it failed,
        # or the engine restarted): that one is over, whatever its outcome.
        self._complete(req.owner)
        old = self.station.size(req.owner)
        kind = OpKind.LOAD if old == 0 else OpKind.RESIZE
        op = MemOp(next(self._ids), kind, req.owner, old, max(req.nbytes, 0))
        started = self._issue(op) if req.nbytes >= 0 else None
        if started is None:
            DENIED.inc()
        else:
            await started.wait()
        await self.bus.reply(
            msg,
            ReserveResult(
                granted=started is not None,
                used_bytes=self.station.optimistic_bytes,
                budget_bytes=self.station.budget_bytes,
            ),
        )

    async def on_done(self, msg: Msg) -> None:
        self._complete(decode(msg.data, ReserveDone).owner)
        self._dispatch()

    async def on_release(self, msg: Msg) -> None:
        owner = decode(msg.data, Release).owner
        for region in regions_of(owner, list(self.station.target)):
            self._complete(region)
            self._issue(MemOp(next(self._ids), OpKind.UNLOAD, region, self.station.size(region), 0))
        self._dispatch()
        # Answered when asked (a reservation that follows must see this release).
        await self.bus.reply(
            msg,
            ReserveResult(
                granted=True, used_bytes=self.station.optimistic_bytes, budget_bytes=self.station.budget_bytes
            ),
        )
