"""A cold start's progress as the engine reports it (issue 35, part 4): the throttle, the
bandwidth and ETA read from bytes, the blob's size, and a start's events in order."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from services.engine.progress import (
    REPORTER,
    StartReporter,
    Throttle,
    bandwidth,
    enter,
    eta_s,
    form_bytes,
    reported,
    reporting,
)
from shared.messages import StartProgress


def test_the_throttle_lets_one_event_per_interval_within_a_phase_and_every_phase_change() -> None:
    t = Throttle(0.2)
    assert t.due("load", 10.0)
    assert not t.due("load", 10.1)
    assert t.due("load", 10.25)
    assert t.due("profile", 10.26)  # a new phase at once
    assert not t.due("profile", 10.3)


def test_bandwidth_and_eta_come_from_the_bytes_read() -> None:
    assert bandwidth(0, 1.0) == 0.0 and bandwidth(100, 0.0) == 0.0
    assert bandwidth(50_000_000, 0.5) == pytest.approx(100_000_000)
    assert eta_s(50, 150, 10.0) == pytest.approx(10.0)
    assert eta_s(50, 150, 0.0) is None  # nothing measured yet
    assert eta_s(150, 150, 0.0) == 0.0 and eta_s(200, 150, 5.0) == 0.0


def test_the_form_bytes_are_its_files_sizes(tmp_path: Path) -> None:
    (tmp_path / "a.blob").write_bytes(b"x" * 1000)
    (tmp_path / "b.json").write_bytes(b"y" * 24)
    (tmp_path / "sub").mkdir()
    assert form_bytes(tmp_path) == 1024
    assert form_bytes(tmp_path / "missing") == 0


class Published:
    """Records what the reporter publishes (the bus's part)."""

    def __init__(self) -> None:
        self.events: list[StartProgress] = []
        self.more = asyncio.Event()

    async def publish(self, subject: str, message: Any) -> None:
        assert subject.endswith(".events.startprogress")
        self.events.append(message)
        self.more.set()


async def test_a_start_reports_its_phases_and_the_bytes_its_load_reads_never_less() -> None:
    bus = Published()
    read = iter([10, 40, 30, 90, 120])  # a sample may read less than the last (pages dropped)
    last = [0]

    def read_bytes() -> int:
        last[0] = next(read, last[0])
        return last[0]

    async def load() -> str:
        # The load ends once its reporter has counted (nearly) all its bytes.
        while not any(e.done_bytes >= 99 for e in bus.events):
            bus.more.clear()
            await bus.more.wait()
        return "loaded"

    async def start() -> str:
        async with reporting(bus, "node-0", "m", interval_s=0.001):
            result = await reported(load(), read_bytes, 100)
            await enter("profile")
            return result

    assert await asyncio.ensure_future(start()) == "loaded"
    phases = [e.phase for e in bus.events]
    assert phases[0] == "init" and phases[-2:] == ["profile", "ready"] and "load" in phases
    loads = [e for e in bus.events if e.phase == "load"]
    assert all(e.total_bytes == 100 for e in loads)
    done_bytes = [e.done_bytes for e in bus.events]
    assert done_bytes == sorted(done_bytes)  # never back
    assert max(e.done_bytes for e in loads) == 99  # the last byte counts once the load is done
    assert bus.events[-1].done_bytes == 100 and bus.events[-1].eta_s == 0.0
    measured = [e for e in loads if e.done_bytes > 0]
    assert measured and all(e.bytes_per_s > 0 and e.eta_s is not None for e in measured)
    assert len({e.started_at for e in bus.events}) == 1
    assert REPORTER.get() is None  # the start's own, gone with it


async def test_a_start_that_fails_says_so_and_stops_reporting() -> None:
    bus = Published()

    async def start() -> None:
        async with reporting(bus, "node-0", "m", interval_s=0.001):
            while len(bus.events) < 3:  # its state again each interval meanwhile
                bus.more.clear()
                await bus.more.wait()
            raise RuntimeError("no room")

    with pytest.raises(RuntimeError):
        await asyncio.ensure_future(start())
    assert [e.phase for e in bus.events][-1] == "failed"
    assert all(e.phase == "init" for e in bus.events[:-1])


async def test_a_load_outside_a_start_reports_nothing() -> None:
    async def load() -> int:
        return 7

    assert await reported(load(), lambda: 0, 100) == 7


async def test_a_resident_start_that_read_nothing_ends_whole() -> None:
    bus = Published()
    reporter = StartReporter(bus, "node-0", "m", interval_s=0.2)
    await reporter.enter("init")
    await reporter.enter("ready")
    assert [(e.phase, e.done_bytes, e.total_bytes) for e in bus.events] == [("init", 0, 0), ("ready", 1, 1)]
