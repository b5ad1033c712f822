"""A scheduler's scale-out multicasts (FaaScale §4-5, `multicast`): the starts of a model
that begin together get its blob along one plan from the nodes running it, and on torch nodes
serve it through an execution pipeline before any target holds it whole (§4.3)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from prometheus_client import Counter

from policy.multicast_groups import Groups
from policy.scheduling import NodeView
from services.scheduler import multicast
from services.scheduler.settings import SchedulerSettings
from shared.bus import Bus
from shared.messages import ModelRecord, Tier
from shared.pipeline_messages import StageLayout

log = logging.getLogger(__name__)

PIPELINES = Counter(
    "tessera_scheduler_pipelines_total",
    "Scale-outs whose targets served the model as an execution pipeline before a replica was whole",
)


class Casts:
    def __init__(
        self,
        bus: Bus,
        settings: SchedulerSettings,
        nodes: Mapping[str, NodeView],
        pipelined: Callable[[str, str], None],
    ) -> None:
        self.bus = bus
        self.settings = settings
        self.nodes = nodes
        """The scheduler's view, by node (read, never written here)."""
        self.pipelined = pipelined
        """Told (node, model) when a pipeline serves the model from that node."""
        self.groups = Groups(settings.multicast_group_s)
        self.group_sent: dict[int, asyncio.Event] = {}
        """Per scale-out group not yet sent, set once its multicast is ordered."""
        self.under_way: set[asyncio.Task[Any]] = set()
        """Multicasts and pipelines under way (`to`)."""

    async def grouped(self, record: ModelRecord, node_id: str) -> None:
        """A scale-out's blob, in the group of this model's scale-outs that begin within
        `multicast_group_s` (`policy.multicast_groups`): the first waits the window out and
        orders one plan for the group; the others wait for that order before their start asks
        its loader for a stage (which then waits for the blocks)."""
        model = record.name
        if not any(model in view.instances for n, view in self.nodes.items() if n != node_id):
            return  # a first start: nobody to fetch from, nothing to wait for
        joined = self.groups.join(model, node_id, time.monotonic())
        if joined.opened:
            sent = self.group_sent[joined.group] = asyncio.Event()
            try:
                await asyncio.sleep(max(0.0, self.groups.due(joined.group) - time.monotonic()))
                await self.to(record, self.groups.close(joined.group))
            finally:
                sent.set()
                del self.group_sent[joined.group]
        else:
            await self.group_sent[joined.group].wait()

    async def to(self, record: ModelRecord, node_ids: list[str]) -> None:
        """A scale-out: the new nodes' loaders fetch the blob from the loaders of the nodes
        running the model (FaaScale §4-5), all of them along one plan. Sent before the starts,
        not waited for: each loader makes its start's stage wait for the blocks (or read the
        store if they fail)."""
        running = [n for n, view in self.nodes.items() if record.name in view.instances and n not in node_ids]
        if not running:
            return
        for order in await multicast.order(self.bus, record, node_ids, running):
            shape = None
            if order.multicast.tier == Tier.TORCH and len(order.nodes) > 1 and self.settings.pipeline_max_stages:
                # Every stage needs the checkpoint's small files and header: they go first.
                shape = await multicast.layout(self.bus, order.nodes[0], order)
                if shape is not None:
                    order = dataclasses.replace(
                        order, multicast=msgspec.structs.replace(order.multicast, lead=shape.lead)
                    )
            for node_id in order.nodes:  # each target derives the same plan and carries out its part
                self.track(
                    asyncio.create_task(
                        multicast.send(self.bus, order.multicast, node_id, self.settings.start_timeout_s)
                    )
                )
            if shape is not None:
                self.track(asyncio.create_task(self.pipeline(record, order, shape)))
        await asyncio.sleep(0)  # its orders go out ahead of the starts

    def track(self, task: asyncio.Task[Any]) -> None:
        """Keep a multicast's task from the collector until it is done."""
        self.under_way.add(task)
        task.add_done_callback(self.under_way.discard)

    async def pipeline(self, record: ModelRecord, order: multicast.Order, shape: StageLayout) -> None:
        """Serve the model from the scale-out's targets before any holds it whole (FaaScale
        §4.3): the pipeline's first node then counts as running it."""
        try:
            ready = await multicast.pipeline(
                self.bus, record, order, shape, self.settings.pipeline_max_stages, self.settings.start_timeout_s
            )
        except Exception:  # the starts go on as they would have; the operator's log says why
            log.exception("the pipeline of %s's scale-out failed", record.name, extra={"model": record.name})
            return
        if ready is None:
            return
        PIPELINES.inc()
        self.pipelined(ready.node_id, record.name)
