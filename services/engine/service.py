"""The engine service: one object of its parts (`starts.py`, `generation.py`, `memory.py`, on
the state of `node.py`), subscribed to the node's subjects, sending heartbeats with its status.
"""

from __future__ import annotations

import asyncio
import logging

from services.engine.generation import Generation
from services.engine.starts import Starts
from shared import subjects

log = logging.getLogger(__name__)

EARLY_BEAT_GAP_S = 0.05
"""The least time between a request's end and the heartbeat it brings forward: endings within
it share one beat."""


class EngineService(Starts, Generation):
    async def start(self) -> None:
        await self.bus.subscribe(subjects.engine_start(self.node), self.on_start)
        await self.bus.subscribe(subjects.engine_stop(self.node), self.on_stop)
        await self.bus.subscribe(subjects.engine_preempt(self.node), self.on_preempt)
        await self.bus.subscribe(subjects.engine_generate(self.node), self.on_generate)
        await self.bus.subscribe(subjects.engine_cancel(self.node), self.on_cancel)
        await self.bus.subscribe(subjects.engine_evict(self.node), self.on_evict)
        await self.bus.subscribe(subjects.engine_stage(self.node), self.on_start_stage)
        await self.bus.subscribe(subjects.engine_pipelined(self.node), self.on_start_pipelined)
        await self.bus.subscribe(subjects.engine_end_stage(self.node), self.on_end_stage)
        # A restarted engine holds nothing: drop whatever an earlier run had reserved.
        await self._release_memory("*")
        self.workers.refill()
        self._heartbeat_task = asyncio.create_task(self._heartbeat())
        if self.settings.true_up_interval_s > 0:
            self._true_up_task = asyncio.create_task(self._true_ups())
        if self.settings.start_tier:
            self._tier_up_task = asyncio.create_task(self._tier_ups())

    async def close(self) -> None:
        for task in (self._heartbeat_task, self._tier_up_task, self._true_up_task):
            if task:
                task.cancel()
        for cancelled, _ in self._cancels.values():
            cancelled.flag = True
        self.workers.close()
        for bound in self.bound.values():
            bound.worker.stop()
        if self.workers.arena is not None:
            self.workers.arena.close()

    async def _heartbeat(self) -> None:
        while True:
            try:
                self._update_gauges()
                await self.learn_artifacts()
                if self.bus.connected.is_set():
                    await self.bus.publish(subjects.node_heartbeat(), self.status())
            except Exception:
                log.exception("heartbeat failed")
            # Every interval, or sooner when a request ends (`beat_due`): the scheduler's line
            # waits for that room. At most one early beat per EARLY_BEAT_GAP_S, so a crowd's
            # many endings cost a few beats a second.
            try:
                await asyncio.wait_for(self.beat_due.wait(), self.settings.heartbeat_interval_s)
                await asyncio.sleep(EARLY_BEAT_GAP_S)
            except TimeoutError:
                pass
            self.beat_due.clear()
