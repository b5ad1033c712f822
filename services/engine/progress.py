"""A cold start's progress, as the engine tells the gateways (issue 35, part 4): its phase and
the bytes of weights its worker has read, published on `subjects.start_progress()` so that a
streamed request waiting for the start can show it (`services/gateway/loading.py`).

Measured, not timed: during Load the worker's resident memory grows as the runtime maps the
compiled blob in (OpenVINO imports a cached blob by mmap, so a read counter stays at 0 while
its resident pages grow with every byte read), sampled every `interval_s` against the blob's
size on disk; the bandwidth is what was read over the time it took, and the ETA what is left
at that bandwidth. Every phase change is published at once; within a phase at most one event
per `interval_s` (the `Throttle`).

The state is published again each `interval_s` for the whole start, so that a request
arriving during a long phase (a start waiting for memory) hears it at once, and a start whose
engine died goes silent. A start ends with "ready" or "failed".

The pure parts (`Throttle`, `bandwidth`, `eta_s`, `form_bytes`) first; `StartReporter` is the
I/O shell, one per start (`reporting`), reached through `REPORTER` (set in the start's own
task, so the steps under it report without each being handed it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from shared import subjects
from shared.messages import StartProgress

log = logging.getLogger(__name__)

T = TypeVar("T")


class Publisher(Protocol):
    async def publish(self, subject: str, message: Any) -> None: ...


@dataclass
class Throttle:
    """At most one event per `interval_s` within a phase; a new phase's first event at once."""

    interval_s: float
    _phase: str = ""
    _last: float = -math.inf

    def due(self, phase: str, now: float) -> bool:
        if phase != self._phase or now - self._last >= self.interval_s:
            self._phase, self._last = phase, now
            return True
        return False


def bandwidth(done_bytes: int, elapsed_s: float) -> float:
    """Bytes per second read so far; 0 before anything was read (or no time passed)."""
    return done_bytes / elapsed_s if done_bytes > 0 and elapsed_s > 0 else 0.0


def eta_s(done_bytes: int, total_bytes: int, bytes_per_s: float) -> float | None:
    """Seconds until `total_bytes` are read at `bytes_per_s`; None while no bandwidth is measured."""
    left = max(0, total_bytes - done_bytes)
    if left == 0:
        return 0.0
    return left / bytes_per_s if bytes_per_s > 0 else None


def form_bytes(directory: Path) -> int:
    """Bytes of the files in a compiled form's directory (the blob a start reads); 0 if none."""
    try:
        return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
    except OSError:
        return 0


@dataclass(eq=False)
class StartReporter:
    """One start's progress events (published best-effort: a lost event costs a comment line,
    never the start)."""

    bus: Publisher
    node_id: str
    model: str
    interval_s: float
    total_bytes: int = 0
    started_at: float = field(default_factory=time.time)
    phase: str = "init"
    done_bytes: int = 0
    bytes_per_s: float = 0.0
    _throttle: Throttle = field(init=False)
    _read: Callable[[], int] | None = None
    """During Load: the bytes read so far."""
    _load_t0: float = 0.0

    def __post_init__(self) -> None:
        self._throttle = Throttle(self.interval_s)

    async def enter(self, phase: str) -> None:
        """A new phase: published at once. "profile" and "ready" come after every byte is read."""
        if self.phase == "load" and phase != "load":
            self.sample()
            self._read = None
        self.phase = phase
        if phase in ("profile", "ready"):  # a resident start read nothing: it is whole too
            self.total_bytes = max(self.total_bytes, 1)
            self.done_bytes = self.total_bytes
        await self._publish(force=True)

    async def begin_load(self, read_bytes: Callable[[], int], total_bytes: int) -> None:
        """The Load phase: `read_bytes()` (bytes read so far) sampled each tick against
        `total_bytes`, until the next phase."""
        self.total_bytes = max(total_bytes, 1)
        self._read, self._load_t0 = read_bytes, time.monotonic()
        await self.enter("load")

    def sample(self) -> None:
        """What the load read so far: never less than before, and at most `total_bytes` - 1
        until the phase ends (the last pages may be counted before the load is done)."""
        if self._read is None:
            return
        self.done_bytes = min(max(self.done_bytes, self._read()), self.total_bytes - 1)
        self.bytes_per_s = bandwidth(self.done_bytes, time.monotonic() - self._load_t0)

    async def run(self) -> None:
        """Until cancelled, each `interval_s`: the load sampled and the state published again,
        so that a stream that joins the start late hears it within one interval, and a gateway
        tells a start under way from one whose engine went."""
        while True:
            await asyncio.sleep(self.interval_s)
            self.sample()
            await self._publish()

    async def _publish(self, force: bool = False) -> None:
        if not self._throttle.due(self.phase, time.monotonic()) and not force:
            return
        event = StartProgress(
            node_id=self.node_id,
            model=self.model,
            started_at=self.started_at,
            phase=self.phase,
            done_bytes=self.done_bytes,
            total_bytes=self.total_bytes,
            bytes_per_s=self.bytes_per_s,
            eta_s=eta_s(self.done_bytes, self.total_bytes, self.bytes_per_s) if self.total_bytes else None,
        )
        try:
            await self.bus.publish(subjects.start_progress(), event)
        except Exception as e:  # best-effort: the start goes on
            log.debug("progress of %s not published: %s", self.model, e)


REPORTER: ContextVar[StartReporter | None] = ContextVar("start_reporter", default=None)
"""The start this task runs (`reporting` sets it in the start's own task)."""


@contextlib.asynccontextmanager
async def reporting(bus: Publisher, node_id: str, model: str, interval_s: float) -> AsyncIterator[StartReporter]:
    """One start's progress, from "init" to "ready" (or "failed", if it raises), its state
    published again each interval meanwhile; the steps under it reach it as `REPORTER`."""
    progress = StartReporter(bus, node_id, model, interval_s)
    token = REPORTER.set(progress)
    ticker = asyncio.ensure_future(progress.run())
    try:
        await progress.enter("init")
        yield progress
        await progress.enter("ready")
    except BaseException:
        await progress.enter("failed")
        raise
    finally:
        ticker.cancel()
        REPORTER.reset(token)


async def enter(phase: str) -> None:
    """The start this task runs (if any) enters `phase`."""
    if (reporter := REPORTER.get()) is not None:
        await reporter.enter(phase)


async def reported(load: Awaitable[T], read_bytes: Callable[[], int], total_bytes: int) -> T:
    """`load` awaited as the Load phase of the start this task runs (if any), its bytes read
    `read_bytes()` of `total_bytes`."""
    if (reporter := REPORTER.get()) is not None:
        await reporter.begin_load(read_bytes, total_bytes)
    return await load
