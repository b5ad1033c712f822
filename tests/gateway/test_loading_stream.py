"""A stream that began while its model started (issue 35, part 4): its comments as the start's
events come, and a start that then fails ends it with the API's error event, which the
`openai` client raises, rather than a status the headers already gave."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from services.gateway.completion import _loading_then, _start_seen
from services.gateway.loading import Placing, StartWatch
from services.gateway.responses import stream_error as responses_error
from shared.errors import TesseraError
from shared.messages import ErrorCode, StartProgress


def event(phase: str, done: int, total: int) -> StartProgress:
    return StartProgress(node_id="n", model="m", started_at=1.0, phase=phase, done_bytes=done, total_bytes=total)


def unused_shape(legs: Any) -> Any:
    raise AssertionError("no answer is shaped for a request that failed to open")


async def test_a_start_failing_after_the_stream_began_ends_it_with_an_error_event() -> None:
    watch, placing = StartWatch(), Placing(since=time.monotonic())
    placing.models["m"] += 1
    failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    seen = asyncio.ensure_future(_start_seen(watch, placing, failed))
    await asyncio.sleep(0)  # sync-ok: lets the waiter block on the watch
    assert not seen.done()
    watch.heard(event("init", 0, 0))
    first = await seen
    assert first is not None and first[0].phase == "init"

    out: list[str] = []

    async def read() -> None:
        async for part in _loading_then(watch, placing, first, failed, [], None, unused_shape, None):  # type: ignore[arg-type]
            out.append(part)
            if len(out) == 1:
                watch.heard(event("load", 60, 100))
            elif len(out) == 2:
                watch.heard(event("load", 30, 100))  # another start reports less: the stream stays
            elif len(out) == 3:
                failed.set_exception(TesseraError(ErrorCode.ENGINE_FAILED, "start failed: boom"))

    await read()
    assert out[0].startswith(": tessera loading phase=init 0%")
    assert out[1].startswith(": tessera loading phase=load 60%")
    assert out[2].startswith(": tessera loading phase=load 60%")
    error, done = out[3].strip().split("\n\n")
    body = json.loads(error.removeprefix("data: "))
    assert body["error"]["code"] == "engine_failed" and "boom" in body["error"]["message"]
    assert done == "data: [DONE]" and len(out) == 4


async def test_the_responses_error_event_is_openais() -> None:
    kind, data = responses_error(503, "start failed", "engine_failed", None).strip().split("\n")
    assert kind == "event: error"
    assert json.loads(data.removeprefix("data: ")) == {
        "type": "error",
        "sequence_number": 0,
        "code": "engine_failed",
        "message": "start failed",
        "param": None,
    }


async def test_a_request_placed_before_any_start_event_is_not_streamed_early() -> None:
    watch, placing = StartWatch(), Placing(since=time.monotonic())
    placed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    placed.set_exception(TesseraError(ErrorCode.MODEL_STARTING, "predicted ready in 3.0 s"))
    watch.heard(event("init", 0, 0))  # the start the refusal let go ahead: not this request's
    assert await _start_seen(watch, placing, placed) is None
    placed.exception()


async def test_between_two_events_the_last_line_is_written_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("services.gateway.completion.KEEPALIVE_S", 0.01)  # not a second: a test
    watch, placing = StartWatch(), Placing(since=time.monotonic())
    placing.models["m"] += 1
    watch.heard(
        StartProgress(node_id="n", model="m", started_at=1.0, phase="load", done_bytes=40, total_bytes=100, eta_s=5.0)
    )
    first = watch.under_way(placing)
    assert first is not None
    opening: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    out: list[str] = []
    async for part in _loading_then(watch, placing, first, opening, [], None, unused_shape, None):  # type: ignore[arg-type]
        out.append(part)
        if len(out) == 3:  # no event came since the first: the line again, its ETA counting down
            opening.set_exception(TesseraError(ErrorCode.ENGINE_FAILED, "gone"))
    etas = [float(line.split("eta=")[1].rstrip("s\n")) for line in out[:3]]
    assert all(line.startswith(": tessera loading phase=load 40% eta=") for line in out[:3])
    assert etas == sorted(etas, reverse=True) and etas[0] <= 5.0
    assert '"engine_failed"' in out[3]
