"""The scheduler's keep-warm part (`services/scheduler/warm.py`) on fakes, as vLLM's scheduler
tests hold theirs: a pinned model missing from the live nodes is started, a start that failed
waits `RETRY_S` before the next, and the engines running a model hear of its pin and priority
once per change. The bus is a fake (named so): it records what the engines would be told."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from policy import keep_warm
from policy.perf_book import PerfBook
from policy.scheduling import NodeView
from services.scheduler import warm
from services.scheduler.settings import SchedulerSettings
from services.scheduler.warm import KeepWarm
from shared import subjects
from shared.messages import (
    ColdStartPhases,
    ErrorCode,
    InstanceReady,
    InstanceView,
    ModelRecord,
    Rejected,
    StartInstance,
)
from tests.unit.test_keep_warm import record

NOW = 50_000.0


class FakeBus:
    """What the engines would be told, in order; each answers at once."""

    def __init__(self) -> None:
        self.told: list[tuple[str, StartInstance]] = []

    async def request(self, subject: str, msg: StartInstance, _reply: Any, timeout: float) -> InstanceReady:
        self.told.append((subject, msg))
        return ready(msg.model.name)


def ready(model: str) -> InstanceReady:
    return InstanceReady(node_id="n", model=model, phases=ColdStartPhases(0.0, 0.0, 0.0), loaded_from_cache=True)


def node(node_id: str, *models: str) -> NodeView:
    return NodeView(node_id, NOW, {m: InstanceView(model=m, active=0, last_used=NOW, loaded_at=NOW) for m in models})


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [NOW]
    monkeypatch.setattr(warm.time, "time", lambda: now[0])
    return now


async def test_a_pinned_model_missing_from_the_nodes_is_started_and_a_failed_start_waits(clock: list[float]) -> None:
    bus = FakeBus()
    outcomes: list[InstanceReady | Rejected] = [Rejected(code=ErrorCode.UNAVAILABLE, message="no room")]
    started: list[tuple[str, str]] = []
    tasks: list[asyncio.Task[InstanceReady | Rejected]] = []

    def start(r: ModelRecord, node_id: str) -> asyncio.Task[InstanceReady | Rejected]:
        started.append((r.name, node_id))

        async def outcome() -> InstanceReady | Rejected:
            return outcomes.pop(0) if outcomes else ready(r.name)

        tasks.append(asyncio.ensure_future(outcome()))
        return tasks[-1]

    kw = KeepWarm(SchedulerSettings(), bus, PerfBook(), start)  # type: ignore[arg-type]
    pinned = record("pin")
    kw.run({"pin": pinned}, [node("n0")], starting=set())
    assert started == [("pin", "n0")]
    await asyncio.gather(*tasks)  # its done callback (registered first) has run when this returns
    kw.run({"pin": pinned}, [node("n0")], starting=set())
    assert started == [("pin", "n0")], "a start that failed is not tried again at once"
    clock[0] += keep_warm.RETRY_S
    kw.run({"pin": pinned}, [node("n0")], starting=set())
    assert started == [("pin", "n0"), ("pin", "n0")]
    # Running there, it is not started again.
    kw.run({"pin": pinned}, [node("n0", "pin")], starting=set())
    assert len(started) == 2


async def test_the_engines_running_a_model_hear_of_its_pin_once_per_change(clock: list[float]) -> None:
    bus = FakeBus()
    kw = KeepWarm(SchedulerSettings(), bus, PerfBook(), lambda r, n: pytest.fail("nothing to start"))  # type: ignore[arg-type]
    plain = record("m", min_instances=0, priority=0)
    live = [node("n0", "m"), node("n1", "m")]
    kw.run({"m": plain}, live, starting=set())
    assert bus.told == []  # nothing pinned, nothing told: no pass at all
    high = msgspec.structs.replace(plain, priority=5)
    for _ in range(2):
        kw.run({"m": high}, live, starting=set())
        await asyncio.gather(*kw._tasks)
    assert [(s, m.model.priority) for s, m in bus.told] == [
        (subjects.engine_start("n0"), 5),
        (subjects.engine_start("n1"), 5),
    ]
    # A start under way there carries the record itself: not told again.
    kw.run({"m": msgspec.structs.replace(high, priority=6)}, live, starting={("m", "n0"), ("m", "n1")})
    await asyncio.gather(*kw._tasks)
    assert len(bus.told) == 2
