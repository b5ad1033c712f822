"""The gateway app in-process (httpx ASGITransport): validation and limits need no bus."""

from __future__ import annotations

import httpx
import pytest

from services.gateway.admin import Admin
from services.gateway.routes import create_app
from services.gateway.serving import Gateway
from services.gateway.settings import GatewaySettings
from shared.health import Readiness


@pytest.fixture
def http() -> httpx.AsyncClient:
    settings = GatewaySettings(max_body_bytes=1000)
    # No bus and no Valkey: every request here must be refused before it needs them.
    app = create_app(Gateway(settings, None, None), Admin(settings, None, None), Readiness("gateway"))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


async def test_body_over_the_limit_is_413_before_it_is_parsed(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/completions", content=b"x" * 2000, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "body_too_large"


async def test_missing_field_names_the_field(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/chat/completions", json={"model": "m"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages"


async def test_an_empty_or_too_long_list_of_prompts_is_400(http: httpx.AsyncClient) -> None:
    for prompts in ([], ["a"] * 17, ["a", "b", "c"]):
        r = await http.post("/v1/completions", json={"model": "m", "prompt": prompts, "n": 6})
        assert r.status_code == 400
        assert "prompt" in r.json()["error"]["message"] or r.json()["error"]["param"] is None


async def test_too_many_stop_sequences_is_400(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/completions", json={"model": "m", "prompt": "a", "stop": ["1", "2", "3", "4", "5"]})
    assert r.status_code == 400


async def test_unknown_route_is_an_openai_style_404(http: httpx.AsyncClient) -> None:
    r = await http.get("/v1/nothing")
    assert r.status_code == 404
    assert "error" in r.json()


async def test_admin_registration_rejects_unsafe_names(http: httpx.AsyncClient) -> None:
    r = await http.post("/admin/models", json={"name": "../etc", "source": "/x.gguf"})
    assert r.status_code == 400
