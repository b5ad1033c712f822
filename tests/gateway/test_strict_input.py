"""Request bodies validated strictly at the edge (in-process app, no bus): what OpenAI refuses
is a 400 naming the parameter, never a 500 or a value quietly coerced."""

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
    settings = GatewaySettings()
    # No bus and no Valkey: every request here must be refused before it needs them.
    app = create_app(Gateway(settings, None, None), Admin(settings, None, None), Readiness("gateway"))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://gw")


def _error(r: httpx.Response) -> dict[str, object]:
    assert r.status_code == 400, r.text
    error: dict[str, object] = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize("key", ["²", "٣", "1²", "１", "12345678901"])
async def test_a_logit_bias_key_that_is_not_an_ascii_token_id_is_400_naming_logit_bias(
    http: httpx.AsyncClient, key: str
) -> None:
    for path, body in (
        ("/v1/completions", {"model": "m", "prompt": "Hi"}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}),
    ):
        error = _error(await http.post(path, json={**body, "logit_bias": {key: 5}}))
        assert str(error["param"]).startswith("logit_bias")

