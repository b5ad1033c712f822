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


def _raw(body: str) -> dict[str, object]:
    return {"content": body.encode(), "headers": {"Content-Type": "application/json"}}


@pytest.mark.parametrize("name", ["a/../b", "..", "a/.", "./a", "a//b", "a/", "a/b/.."])
async def test_a_model_name_with_an_empty_dot_or_dot_dot_segment_is_refused_at_registration(
    http: httpx.AsyncClient, name: str
) -> None:
    error = _error(await http.post("/admin/models", json={"name": name, "source": "/x.gguf"}))
    assert error["param"] == "name"


@pytest.mark.parametrize("name", ["org/adapters/x", "adapters/x", "base/adapters"])
async def test_adapters_is_reserved_as_a_part_of_a_grouped_name(http: httpx.AsyncClient, name: str) -> None:
    """`/admin/models/<base>/adapters/<name>` would read such a model name as an adapter's."""
    for path in ("/admin/models", "/admin/models/some-base/adapters"):
        error = _error(await http.post(path, json={"name": name, "source": "/x"}))
        assert error["param"] == "name" and "reserved" in str(error["message"])


@pytest.mark.parametrize("value", ["1e309", "-1e309", "NaN", "Infinity", "1e12"])
async def test_a_keep_alive_that_is_not_a_finite_number_in_range_is_refused(
    http: httpx.AsyncClient, value: str
) -> None:
    body = f'{{"name": "m", "source": "/x.gguf", "keep_alive_s": {value}}}'
    error = _error(await http.post("/admin/models", **_raw(body)))  # type: ignore[arg-type]
    assert error["param"] == "keep_alive_s"


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("max_tokens", '"16"'),
        ("max_tokens", "16.0"),
        ("n", '"2"'),
        ("seed", '"7"'),
        ("temperature", '"0.5"'),
        ("temperature", "1e309"),
        ("stream", '"true"'),
        ("stream", "1"),
    ],
)
async def test_a_number_or_flag_sent_as_another_type_is_refused_not_coerced(
    http: httpx.AsyncClient, param: str, value: str
) -> None:
    for path, fields in (
        ("/v1/completions", '"prompt": "Hi"'),
        ("/v1/chat/completions", '"messages": [{"role": "user", "content": "Hi"}]'),
        ("/v1/responses", '"input": "Hi"'),
    ):
        if path == "/v1/responses" and param == "max_tokens":
            param = "max_output_tokens"
        body = f'{{"model": "m", {fields}, "{param}": {value}}}'
        error = _error(await http.post(path, **_raw(body)))  # type: ignore[arg-type]
        assert error["param"] == param, (path, error)


@pytest.mark.parametrize("param", ["n", "best_of"])
async def test_a_responses_request_for_several_outputs_is_refused_not_answered_with_one(
    http: httpx.AsyncClient, param: str
) -> None:
    r = await http.post("/v1/responses", json={"model": "m", "input": "Hi", param: 2})
    error = _error(r)
    assert error["code"] == "unsupported_parameter" and error["param"] == param
