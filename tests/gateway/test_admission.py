"""The gateway's admission line: past `max_inflight` requests wait, first come first served,
for a bounded time; a full line is refused at once."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.serving import Gateway
from services.gateway.settings import GatewaySettings
from shared.errors import TesseraError
from shared.messages import ErrorCode


def _gateway(inflight: int, waiting: int) -> Gateway:
    return Gateway(GatewaySettings(max_inflight=inflight, max_waiting=waiting), bus=None, registry=None)  # type: ignore[arg-type]


async def test_requests_past_the_limit_wait_and_are_admitted_in_arrival_order() -> None:
    gw = _gateway(inflight=1, waiting=4)
    await gw.admit(1.0)
    order: list[int] = []

    async def one(i: int) -> None:
        await gw.admit(30.0)
        order.append(i)

    waiters = [asyncio.create_task(one(i)) for i in range(3)]
    await asyncio.sleep(0)  # sync-ok: lets the tasks reach the line (no time passes)
    assert order == [] and gw.inflight == 1
    for expected in ([0], [0, 1], [0, 1, 2]):
        gw.release()
        await asyncio.wait_for(asyncio.shield(asyncio.gather(*waiters[: len(expected)])), 5)
        assert order == expected
        assert gw.inflight == 1  # a released slot changes hands


async def test_a_full_line_is_refused_at_once_with_retry_after() -> None:
    gw = _gateway(inflight=1, waiting=1)
    await gw.admit(1.0)
    first = asyncio.create_task(gw.admit(30.0))
    await asyncio.sleep(0)  # sync-ok: lets it reach the line
    with pytest.raises(TesseraError) as e:
        await gw.admit(30.0)
    assert e.value.code == ErrorCode.OVERLOADED and e.value.retry_after_s
    gw.release()
    await asyncio.wait_for(first, 5)


async def test_a_wait_past_its_deadline_is_429_and_gives_its_place_up() -> None:
    gw = _gateway(inflight=1, waiting=4)
    await gw.admit(1.0)
    with pytest.raises(TesseraError) as e:
        await gw.admit(0.01)
    assert e.value.code == ErrorCode.OVERLOADED
    gw.release()
    assert gw.inflight == 0  # nobody left in line to hand the slot to


async def test_a_cancelled_waiter_leaves_the_line() -> None:
    gw = _gateway(inflight=1, waiting=4)
    await gw.admit(1.0)
    waiter = asyncio.create_task(gw.admit(30.0))
    await asyncio.sleep(0)  # sync-ok: lets it reach the line
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    gw.release()
    assert gw.inflight == 0
