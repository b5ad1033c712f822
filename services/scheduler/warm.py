"""Keep warm (issue 35) at the scheduler: each keep-alive pass starts the pinned models that run
on fewer nodes than their `min_instances` (`policy.keep_warm.restore` decides) and tells the
engines running a model whose pin or priority changed (their evictions read it). Composed into
the scheduler with what it needs of it: the bus, its measurements and how it starts a model."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from typing import Any

from prometheus_client import Counter

from policy import keep_warm
from policy.perf_book import PerfBook
from policy.scheduling import NodeView
from services.scheduler.settings import SchedulerSettings
from shared import subjects
from shared.adapters import AdapterRecord
from shared.bus import Bus
from shared.errors import TesseraError
from shared.messages import InstanceReady, ModelRecord, Rejected, StartInstance

log = logging.getLogger(__name__)

RESTORES = Counter(
    "tessera_scheduler_keep_warm_starts_total",
    "Starts of pinned models running on fewer nodes than their min_instances (registration, node restart)",
)

Start = Callable[[ModelRecord, str], "asyncio.Task[InstanceReady | Rejected]"]
"""Starts a model on a node (or joins the start under way there): its task."""


class KeepWarm:
    def __init__(self, settings: SchedulerSettings, bus: Bus, perf: PerfBook, start: Start) -> None:
        self.settings = settings
        self.bus = bus
        self.perf = perf
        self._start = start
        self.adapter_pins: list[AdapterRecord] = []
        """The pinned adapters, as the last keep-alive pass read them: they pin their bases."""
        self._restore_failed: dict[str, float] = {}
        """Pinned model → when its last keep-warm start failed (the next waits a while)."""
        self._told: dict[tuple[str, str], tuple[int, int]] = {}
        """(model, node) → the (min_instances, priority) its engine last had from here: a pin
        or an unpin of a running model is told to its engines (their evictions read it)."""
        self._tasks: set[asyncio.Task[None]] = set()

    def pinned(self, record: ModelRecord) -> ModelRecord:
        """`record` as its pinned adapters keep it."""
        return keep_warm.with_adapter_pins([record], self.adapter_pins)[0]

    def started(self, record: ModelRecord, node_id: str) -> None:
        """A start of `record` there carried its pin and priority."""
        self._told[(record.name, node_id)] = (record.min_instances, record.priority)

    def run(
        self, records: Mapping[str, ModelRecord], live: Sequence[NodeView], starting: Collection[tuple[str, str]]
    ) -> None:
        """One pass over the live nodes (`starting`: the (model, node) starts under way). Nothing
        awaited: the starts run as any start does, and the next pass sees them under way."""
        if not self._told and not any(r.min_instances or r.priority for r in records.values()):
            return  # nothing kept warm, nothing to tell: no pass over the view
        now = time.time()
        pins = keep_warm.pinned(records.values())
        profiles = self.perf.profiles(pins, kv_min_tokens=self.settings.kv_min_tokens)
        for model, node_id in keep_warm.restore(pins, live, profiles, now, self._restore_failed):
            log.info("keeping %s warm: starting it on %s", model, node_id, extra={"model": model})
            RESTORES.inc()
            self._start(records[model], node_id).add_done_callback(functools.partial(self._restored, model))
        running = {(m, n.node_id) for n in live for m in n.instances}
        for key in set(self._told) - running:
            del self._told[key]
        for model, node_id in sorted(running - set(starting)):
            record = records.get(model)
            terms = (record.min_instances, record.priority) if record is not None else (0, 0)
            if record is not None and self._told.get((model, node_id), (0, 0)) != terms:
                self._told[(model, node_id)] = terms
                self._background(self._tell(record, node_id))

    def _restored(self, model: str, task: asyncio.Task[InstanceReady | Rejected]) -> None:
        failed = task.cancelled() or task.exception() is not None or isinstance(task.result(), Rejected)
        if failed:
            log.warning("keep-warm start of %s failed; trying again in %gs", model, keep_warm.RETRY_S)
            self._restore_failed[model] = time.time()
        else:
            self._restore_failed.pop(model, None)

    async def _tell(self, record: ModelRecord, node_id: str) -> None:
        """A start of a model running there: the engine answers at once, and keeps the
        record's `min_instances` and `priority` for its evictions."""
        try:
            await self.bus.request(
                subjects.engine_start(node_id),
                StartInstance(model=record),
                InstanceReady | Rejected,
                timeout=self.settings.request_timeout_s,
            )
        except TesseraError as e:
            log.warning("could not tell %s of %s's pin: %s", node_id, record.name, e.message)
            self._told.pop((record.name, node_id), None)

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
