"""The engine service: it owns its parts, each built with the collaborators it needs (the
node's state, its memory, starts, pipelines, requests, over one worker pool of one backend),
subscribes them to the node's subjects and sends heartbeats with the node's status."""

from __future__ import annotations

import asyncio
import logging

from services.engine import adapters
from services.engine.backends import BACKENDS
from services.engine.memory import BusMemoryManager, KvMemory, MemoryManager
from services.engine.node import Node, every
from services.engine.pipelines import Pipelines
from services.engine.requests import Requests
from services.engine.settings import EngineSettings
from services.engine.starts import Starts
from services.engine.worker_pool import WorkerPool, node_pool
from shared import subjects
from shared.bus import Bus

log = logging.getLogger(__name__)

EARLY_BEAT_GAP_S = 0.05
"""The least time between a request's end and the heartbeat it brings forward: endings within
it share one beat."""


class EngineService:
    def __init__(
        self,
        settings: EngineSettings,
        bus: Bus,
        workers: WorkerPool | None = None,
        memory_manager: MemoryManager | None = None,
    ) -> None:
        """`workers` and `memory_manager` default to the node's; a test passes fakes."""
        self.settings = settings
        self.bus = bus
        backend = BACKENDS[settings.engine_backend]
        self.workers = workers or node_pool(settings, backend)
        self.node = Node(settings, backend, self.workers, bus)
        manager = memory_manager or BusMemoryManager(bus, settings.node_id, settings.memory_request_timeout_s)
        self.memory = KvMemory(self.node, manager)
        self.starts = Starts(self.node, self.memory)
        self.pipelines = Pipelines(self.node, self.memory)
        self.requests = Requests(self.node, self.memory)
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        node, starts, pipelines, requests = self.node.id, self.starts, self.pipelines, self.requests
        for subject, handler in (
            (subjects.engine_start(node), starts.on_start),
            (subjects.engine_stop(node), starts.on_stop),
            (subjects.engine_preempt(node), starts.on_preempt),
            (subjects.engine_evict(node), starts.on_evict),
            (subjects.engine_generate(node), requests.on_generate),
            (subjects.engine_cancel(node), requests.on_cancel),
            (subjects.engine_stage(node), pipelines.on_start_stage),
            (subjects.engine_pipelined(node), pipelines.on_start_pipelined),
            (subjects.engine_end_stage(node), pipelines.on_end_stage),
        ):
            await self.bus.subscribe(subject, handler)
        # A restarted engine holds nothing: drop whatever an earlier run had reserved.
        await self.memory.release("*")
        self.workers.refill()
        self._tasks.append(asyncio.create_task(self._heartbeat()))
        if self.settings.true_up_interval_s > 0:
            true_ups = every(self.settings.true_up_interval_s, self.memory.true_up_weights, "memory true-up")
            self._tasks.append(asyncio.create_task(true_ups))
        if self.settings.start_tier:
            tier_ups = every(min(0.1, self.settings.tier_up_idle_s), self.starts.tier_up_next, "tier-up check")
            self._tasks.append(asyncio.create_task(tier_ups))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for cancelled, _ in self.node.cancels.values():
            cancelled.flag = True
        self.workers.close()
        for bound in self.node.bound.values():
            bound.worker.stop()
        if self.workers.arena is not None:
            self.workers.arena.close()

    async def _heartbeat(self) -> None:
        while True:
            try:
                await self.node.learn_artifacts()
                for owner in adapters.drop_idle(list(self.node.instances.values())):  # each its own keep-alive
                    await self.memory.release(owner)
                if self.bus.connected.is_set():
                    await self.node.beat()
            except Exception:
                log.exception("heartbeat failed")
            # Every interval, or sooner when a request ends (`beat_due`): the scheduler's line
            # waits for that room. At most one early beat per EARLY_BEAT_GAP_S.
            try:
                await asyncio.wait_for(self.node.beat_due.wait(), self.settings.heartbeat_interval_s)
                await asyncio.sleep(EARLY_BEAT_GAP_S)
            except TimeoutError:
                pass
            self.node.beat_due.clear()
