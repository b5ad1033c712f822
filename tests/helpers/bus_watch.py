"""A watcher on a real cluster's bus: every `Generate` sent to an engine, every token stream,
every `PreemptInstance`, and the heartbeats' performance reports. Tests see what the engines
were sent and what they streamed: each leg of a resumed request, its node, its chunks and its end."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from policy.perf_book import PerfBook
from shared import subjects
from shared.bus import Bus, decode
from shared.messages import (
    Failed,
    Finished,
    Generate,
    InstanceStopped,
    NodeStatus,
    PreemptInstance,
    StreamEvent,
    TokenChunk,
)
from tests.helpers.cluster import wait_for


@dataclass
class Leg:
    """One placement of a request on an engine: a resumed request has several."""

    node: str
    request: Generate
    events: list[tuple[float, TokenChunk | Finished | Failed]]

    @property
    def chunks(self) -> list[TokenChunk]:
        return [e for _, e in self.events if isinstance(e, TokenChunk)]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)

    @property
    def end(self) -> Finished | Failed | None:
        return next((e for _, e in self.events if not isinstance(e, TokenChunk)), None)

    @property
    def ended_at(self) -> float:
        return next((t for t, e in self.events if not isinstance(e, TokenChunk)), math.inf)


class Watch:
    """A plain subscriber on the cluster's NATS (its own thread and event loop): every
    `Generate` sent to an engine, every token stream, every `PreemptInstance`, and the
    heartbeats with the performance reports the scheduler fits its models from."""

    def __init__(self, nats_url: str) -> None:
        self.generates: list[tuple[str, Generate]] = []
        self.events: dict[str, list[tuple[float, TokenChunk | Finished | Failed]]] = defaultdict(list)
        self.preempts: list[tuple[str, PreemptInstance]] = []
        self.status: dict[str, NodeStatus] = {}
        self.perf = PerfBook()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.bus = Bus("test-watch")
        self.call(self._start(nats_url))

    def call(self, coro: Any, timeout_s: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self, nats_url: str) -> None:
        await self.bus.connect(nats_url)
        nc = self.bus.client

        async def on_generate(msg: Any) -> None:
            self.generates.append((msg.subject.split(".")[-2], decode(msg.data, Generate)))

        async def on_stream(msg: Any) -> None:
            event = decode(msg.data, StreamEvent)
            self.events[event.request_id].append((time.monotonic(), event))

        async def on_preempt(msg: Any) -> None:
            self.preempts.append((msg.subject.split(".")[-2], decode(msg.data, PreemptInstance)))

        async def on_heartbeat(msg: Any) -> None:
            status = decode(msg.data, NodeStatus)
            for report in status.perf:
                self.perf.report(status.node_id, status.kind, report)
            self.status[status.node_id] = status

        await nc.subscribe(subjects.engine_generate("*"), cb=on_generate)
        await nc.subscribe(subjects.token_stream("*"), cb=on_stream)
        await nc.subscribe(subjects.engine_preempt("*"), cb=on_preempt)
        await nc.subscribe(subjects.node_heartbeat(), cb=on_heartbeat)
        await nc.flush()

    def legs(self, prompt: str) -> list[Leg]:
        """The legs of the request whose prompt starts with `prompt`, in the order sent (a
        request sent again to another node, its instance gone, is one leg: the last node)."""
        nodes: dict[str, tuple[str, Generate]] = {}
        for node, g in list(self.generates):
            if g.prompt.startswith(prompt):
                nodes[g.request_id] = (node, g)  # dicts keep the first insertion's order
        return [Leg(node, g, list(self.events.get(rid, ()))) for rid, (node, g) in nodes.items()]

    def ended_legs(self, prompt: str, count: int) -> list[Leg]:
        """The request's `count` legs once this watcher has seen each one end. Its client can
        have its answer first: the watcher reads the same stream on a connection of its own."""
        return wait_for(
            lambda: legs if len(legs := self.legs(prompt)) == count and all(leg.end for leg in legs) else None,
            30,
            f"the watcher to see {count} legs of {prompt!r} end",
        )

    def preempt(self, node: str, model: str) -> InstanceStopped:
        """The scheduler's order, sent by hand: end the instance's requests as PREEMPTED."""
        reply: InstanceStopped = self.call(
            self.bus.request(
                subjects.engine_preempt(node),
                PreemptInstance(model=model, for_model="a test"),
                InstanceStopped,
                timeout=10,
            )
        )
        return reply

    def close(self) -> None:
        try:
            self.call(self.bus.close(), timeout_s=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
