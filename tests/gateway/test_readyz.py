"""The gateway's /readyz: not ready while no engine has sent a heartbeat, and it says so."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from services.gateway.admin import Admin
from services.gateway.routes import create_app
from services.gateway.serving import Gateway
from services.gateway.settings import GatewaySettings
from shared.health import NotReady, Readiness


@pytest.fixture
def gateway() -> Gateway:
    return Gateway(GatewaySettings(node_timeout_s=3.0), None, None)  # type: ignore[arg-type]


def client(gateway: Gateway, readiness: Readiness) -> httpx.AsyncClient:
    app = create_app(gateway, Admin(gateway.settings, None, None), readiness)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


async def test_no_engine_heard_is_503_naming_what_is_missing(gateway: Gateway) -> None:
    async with client(gateway, Readiness("gateway")) as http:
        r = await http.get("/readyz")
    assert r.status_code == 503
    body = r.json()
    assert body["ready"] is False and body["checks"] == {"engine": False}
    assert body["missing"] == ["engine: no engine node has sent a heartbeat within 3s"]


async def test_an_engine_heard_lately_makes_it_ready(gateway: Gateway) -> None:
    gateway.node_seen["node-0"] = time.time()  # as `_on_heartbeat` records one
    async with client(gateway, Readiness("gateway")) as http:
        r = await http.get("/readyz")
    assert r.status_code == 200
    assert r.json() == {"ready": True, "service": "gateway", "checks": {"engine": True}, "missing": []}


async def test_an_engine_gone_silent_is_not_enough(gateway: Gateway) -> None:
    gateway.node_seen["node-0"] = time.time() - 10  # past node_timeout_s
    async with client(gateway, Readiness("gateway")) as http:
        r = await http.get("/readyz")
    assert r.status_code == 503 and r.json()["missing"][0].startswith("engine: ")


async def test_every_failing_check_says_why() -> None:
    readiness = Readiness("svc")

    async def ok() -> bool:
        return True

    async def false() -> bool:
        return False

    async def not_ready() -> bool:
        raise NotReady("no model loaded")

    async def broken() -> bool:
        raise ConnectionError("refused")

    async def hangs() -> bool:
        await asyncio.Event().wait()
        return True

    readiness.add("ok", ok)
    readiness.add("nats", false, missing="not connected")
    readiness.add("plain", false)
    readiness.add("model", not_ready)
    readiness.add("valkey", broken)
    readiness.add("slow", hangs)
    report = await readiness.report()
    assert not report.ready
    assert report.checks == {
        "ok": True,
        "nats": False,
        "plain": False,
        "model": False,
        "valkey": False,
        "slow": False,
    }
    assert report.missing == [
        "nats: not connected",
        "plain: check failed",
        "model: no model loaded",
        "valkey: ConnectionError: refused",
        "slow: no answer within 1s",
    ]
