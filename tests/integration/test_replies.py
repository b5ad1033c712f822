"""Replies that always come (issue 19): a request whose handler raises anything is answered at
once with a typed error, on a real nats-server.

Every request here has a 1 s limit of its own: a handler left unanswered would end it with
"no reply ... within 1s", which each test tells apart from the error the bus answers with (the
exception's name and text are in it). The services are built as their `__main__`s build them,
with one dependency broken (a method their handler calls), and answer on their own subjects.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from ops.localcluster import free_port, nats_server_binary, wait_port
from services.engine.service import EngineService
from services.engine.settings import EngineSettings
from services.loader.service import LoaderService
from services.loader.settings import LoaderSettings
from services.memory_manager.service import MemoryManagerService
from services.memory_manager.settings import MemoryManagerSettings
from services.scheduler.service import SchedulerService
from services.scheduler.settings import SchedulerSettings
from shared import subjects
from shared.adapters import StageAdapter
from shared.bus import Bus, encode
from shared.cache_messages import CacheQuery, CacheStatus, Evicted, EvictHostCache, EvictResidents, Staged
from shared.errors import TesseraError
from shared.messages import (
    ClusterStatus,
    ClusterStatusQuery,
    ErrorCode,
    Failed,
    Generate,
    GenerateAccepted,
    Rejected,
    Reserve,
    ReserveResult,
    SamplingParams,
)
from shared.registry import Registry
from shared.routing_messages import Placement, PlaceRequest

LIMIT_S = 60.0
"""Each request's own timeout, a bound on a hang: a request nobody answered fails with "no reply
... within 60s", which the checks tell from the bus's typed error by its message (not its time)."""


@pytest.fixture(scope="module")
def nats_url() -> Iterator[str]:
    """A nats-server of this module's own, on a free port (as `ops.localcluster` runs one)."""
    port = free_port()
    proc = subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_port(port, proc, 10, "nats-server")
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
async def buses(nats_url: str) -> AsyncIterator[tuple[Bus, Bus]]:
    """(the service's bus, the caller's bus): two connections, as two processes have."""
    service, caller = Bus("service"), Bus("caller")
    await service.connect(nats_url)
    await caller.connect(nats_url)
    try:
        yield service, caller
    finally:
        await caller.close()
        await service.close()


async def settled(bus: Bus) -> None:
    """Return once the server has every command `bus` has sent (a subscription, a reply), and
    `bus` every message the server had for it then. nats-py's `flush()` writes its PING straight
    to the socket, ahead of commands still queued for its flusher (a SUB just made): the first
    round trip lets the flusher write them, the second is behind them."""
    await bus.client.flush()
    await bus.client.flush()


async def handlers_done(bus: Bus) -> None:
    """Wait until every handler task the bus started has ended (its error reply sent, if any)."""
    while bus._tasks:
        await asyncio.wait(set(bus._tasks))


def boom(*_: Any, **__: Any) -> NoReturn:
    raise RuntimeError("boom: a bug in the handler")


async def ask(caller: Bus, subject: str, message: Any, reply_type: Any) -> Any:
    """The reply, or the error the request raised."""
    try:
        return await caller.request(subject, message, reply_type, timeout=LIMIT_S)
    except TesseraError as e:
        return e


def assert_bus_answered(outcome: Any, names: str = "RuntimeError") -> TesseraError:
    """The caller got the bus's typed error, not its own timeout."""
    assert isinstance(outcome, TesseraError), outcome
    assert "no reply" not in outcome.message, f"the caller waited for its own timeout: {outcome.message}"
    assert names in outcome.message, outcome.message
    return outcome


def failures_logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "shared.bus" and r.exc_info]


# --- the bus's guarantee ---------------------------------------------------------------------


async def test_a_handler_that_raises_is_answered_with_a_typed_error_logged_once(
    buses: tuple[Bus, Bus], caplog: pytest.LogCaptureFixture
) -> None:
    service, caller = buses

    async def handler(_msg: Any) -> None:
        boom()

    await service.subscribe("t.raise", handler)

    await settled(service)
    outcome = await ask(caller, "t.raise", ClusterStatusQuery(), ClusterStatus)
    error = assert_bus_answered(outcome)
    assert error.code == ErrorCode.UNAVAILABLE and error.retry_after_s == 1
    assert "boom: a bug in the handler" in error.message and "t.raise" in error.message
    await handlers_done(service)
    logged = failures_logged(caplog)
    assert len(logged) == 1, [r.getMessage() for r in caplog.records]
    assert logged[0].levelno == logging.ERROR and "t.raise" in logged[0].getMessage()


async def test_a_caller_that_takes_rejected_gets_it_as_a_value(buses: tuple[Bus, Bus]) -> None:
    service, caller = buses

    async def handler(_msg: Any) -> None:
        boom()

    await service.subscribe("t.union", handler)

    await settled(service)
    reply = await caller.request("t.union", ClusterStatusQuery(), Placement | Rejected, timeout=LIMIT_S)
    assert isinstance(reply, Rejected) and "RuntimeError" in reply.message


async def test_a_tessera_error_that_escapes_keeps_its_code(buses: tuple[Bus, Bus]) -> None:
    service, caller = buses

    async def handler(_msg: Any) -> None:
        raise TesseraError(ErrorCode.MODEL_NOT_FOUND, "no such model", retry_after_s=3)

    await service.subscribe("t.typed", handler)

    await settled(service)
    outcome = await ask(caller, "t.typed", ClusterStatusQuery(), ClusterStatus)
    error = assert_bus_answered(outcome, names="no such model")
    assert error.code == ErrorCode.MODEL_NOT_FOUND and error.retry_after_s == 3


async def test_a_handler_that_replied_and_then_raised_is_not_answered_twice(
    buses: tuple[Bus, Bus], caplog: pytest.LogCaptureFixture
) -> None:
    service, caller = buses

    async def handler(msg: Any) -> None:
        await service.reply(msg, ClusterStatus(nodes=()))
        boom()  # work after the answer fails: the caller has its answer already

    await service.subscribe("t.after", handler)

    await settled(service)
    inbox = caller.client.new_inbox()
    replies = await caller.client.subscribe(inbox)
    await caller.client.publish("t.after", encode(ClusterStatusQuery()), reply=inbox)
    first = await replies.next_msg(timeout=LIMIT_S)
    assert first.data == encode(ClusterStatus(nodes=()))
    await handlers_done(service)
    # Whatever the service sent is at the caller once a round trip after it is done.
    await settled(service)
    await settled(caller)
    with pytest.raises(asyncio.TimeoutError):  # nats' TimeoutError is one
        await replies.next_msg(timeout=0.05)
    assert len(failures_logged(caplog)) == 1


async def test_a_message_with_no_reply_subject_is_only_logged_once(
    buses: tuple[Bus, Bus], caplog: pytest.LogCaptureFixture
) -> None:
    service, caller = buses
    seen = asyncio.Event()

    async def handler(_msg: Any) -> None:
        seen.set()
        boom()

    await service.subscribe("t.fire", handler)

    await settled(service)
    await caller.publish("t.fire", ClusterStatusQuery())
    await asyncio.wait_for(seen.wait(), LIMIT_S)
    await handlers_done(service)
    logged = failures_logged(caplog)
    assert len(logged) == 1 and "answered" not in logged[0].getMessage()


# --- each service's own handlers -------------------------------------------------------------


async def test_memory_manager_reserve_answers_an_unexpected_error(
    buses: tuple[Bus, Bus], monkeypatch: pytest.MonkeyPatch
) -> None:
    service, caller = buses
    mm = MemoryManagerService(MemoryManagerSettings(node_id="mm-node"), service)
    await mm.start()
    await settled(service)
    monkeypatch.setattr(mm.station, "size", boom)
    # As the engine asks before a load (`_reserve_memory`).
    outcome = await ask(caller, subjects.memory_reserve("mm-node"), Reserve(owner="m:kv", nbytes=1), ReserveResult)
    assert_bus_answered(outcome)


class DownRegistry(Registry):
    """Valkey is down: every read fails as redis-py's would."""

    def __init__(self) -> None:
        pass

    async def get(self, name: str) -> NoReturn:
        raise ConnectionError("Error 111 connecting to valkey. Connection refused.")

    async def all(self) -> NoReturn:
        raise ConnectionError("Error 111 connecting to valkey. Connection refused.")


async def test_scheduler_place_and_status_answer_an_unexpected_error(
    buses: tuple[Bus, Bus], monkeypatch: pytest.MonkeyPatch
) -> None:
    service, caller = buses
    scheduler = SchedulerService(SchedulerSettings(), service, DownRegistry())
    await scheduler.start()
    await settled(service)
    try:
        # The gateway places with `Placement | Rejected` and raises the Rejected's code.
        placed = await caller.request(
            subjects.place(),
            PlaceRequest(request_id="r1", model="m", prompt_tokens=3, max_tokens=4),
            Placement | Rejected,
            timeout=LIMIT_S,
        )
        assert isinstance(placed, Rejected), placed
        assert placed.code == ErrorCode.UNAVAILABLE and "ConnectionError" in placed.message

        # The admin API asks for `ClusterStatus` alone.
        monkeypatch.setattr(scheduler, "nodes", None)  # `.values()` of it raises AttributeError
        outcome = await ask(caller, subjects.cluster_status(), ClusterStatusQuery(), ClusterStatus)
        assert_bus_answered(outcome, names="AttributeError")
    finally:
        await scheduler.close()


async def test_loader_cache_and_evict_answer_an_unexpected_error(
    buses: tuple[Bus, Bus], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    service, caller = buses
    settings = LoaderSettings(node_id="loader-node", model_store=tmp_path / "store", host_cache_dir=tmp_path / "cache")
    loader = LoaderService(settings, service)
    await loader.start()
    await settled(service)
    monkeypatch.setattr(loader.cache, "evict_all", boom)
    outcome = await ask(caller, subjects.loader_evict("loader-node"), EvictHostCache(), Evicted)
    assert_bus_answered(outcome)

    monkeypatch.setattr(loader, "cache", None)  # `.entries` of it raises AttributeError
    outcome = await ask(caller, subjects.loader_cache("loader-node"), CacheQuery(), CacheStatus)
    assert_bus_answered(outcome, names="AttributeError")


async def test_the_loader_refuses_a_bad_adapter_path_with_a_bounded_warning(
    buses: tuple[Bus, Bus], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """No adapter kept at the path, or a path too long to read: a `Rejected` at once (the
    engine then reads the store's copy), logged as a warning without a traceback, and neither
    the answer nor the log echoes a 100 KB path whole."""
    service, caller = buses
    settings = LoaderSettings(node_id="loader-a", model_store=tmp_path / "store", host_cache_dir=tmp_path / "cache")
    await LoaderService(settings, service).start()
    await settled(service)
    empty = tmp_path / "no-adapter"
    empty.mkdir()
    caplog.set_level(logging.WARNING, logger="services.loader.service")
    for path, why in ((str(empty), "no whole adapter is kept"), ("/" + "a" * 100_000, "cannot be read")):
        reply = await caller.request(
            subjects.loader_stage_adapter("loader-a"), StageAdapter(path=path), Staged | Rejected, timeout=LIMIT_S
        )
        assert isinstance(reply, Rejected) and why in reply.message, reply
        assert len(reply.message) < 1_000
    logged = [r for r in caplog.records if r.name == "services.loader.service"]
    assert len(logged) == 2 and all(r.levelno == logging.WARNING and not r.exc_info for r in logged)
    assert all(len(r.getMessage()) < 1_000 for r in logged)


async def test_engine_evict_and_generate_answer_an_unexpected_error(
    buses: tuple[Bus, Bus], monkeypatch: pytest.MonkeyPatch
) -> None:
    service, caller = buses
    # No worker process: the handlers below are subscribed as `EngineService.start` does,
    # without its pre-warmed pool.
    engine = EngineService(EngineSettings(node_id="engine-node", worker_pool_size=0, interleave=False), service)
    await service.subscribe(subjects.engine_evict("engine-node"), engine.starts.on_evict)
    await service.subscribe(subjects.engine_generate("engine-node"), engine.requests.on_generate)
    await settled(service)
    try:
        monkeypatch.setattr(engine.memory, "evict", boom)
        outcome = await ask(caller, subjects.engine_evict("engine-node"), EvictResidents(), Evicted)
        assert_bus_answered(outcome)

        # The gateway sends with `GenerateAccepted | Failed`: a `Rejected` is neither.
        monkeypatch.setattr(engine.node, "instances", None)  # `.get` of it raises AttributeError
        request = Generate(
            request_id="g1",
            model="m",
            prompt="hi",
            prompt_ids=(1,),
            prompt_tokens=1,
            params=SamplingParams(max_tokens=1),
            stream_subject="t.stream",
        )
        outcome = await ask(caller, subjects.engine_generate("engine-node"), request, GenerateAccepted | Failed)
        assert_bus_answered(outcome, names="AttributeError")
    finally:
        await engine.close()


@pytest.fixture
def lone_nats() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A nats-server the test stops itself."""
    port = free_port()
    proc = subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_port(port, proc, 10, "nats-server")
        yield f"nats://127.0.0.1:{port}", proc
    finally:
        proc.terminate()
        proc.wait(10)


async def test_a_bus_whose_server_is_gone_closes_without_raising(
    lone_nats: tuple[str, subprocess.Popen[bytes]],
) -> None:
    # A cluster stopped NATS first: nats-py is reconnecting, and its drain() would raise.
    url, proc = lone_nats
    bus = Bus("closing")
    await bus.connect(url)
    proc.terminate()
    deadline = time.monotonic() + 120  # a safety bound on a hang, not a speed asked for
    while not bus.client.is_reconnecting:
        assert time.monotonic() < deadline, "the client never noticed its server had gone"
        await asyncio.sleep(0.05)  # sync-ok: polling a condition with a deadline
    await bus.close()
    assert bus.client.is_closed
