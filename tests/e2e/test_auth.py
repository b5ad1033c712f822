"""API keys, allowlists and rate limits on a cluster of its own with auth on, and a second
gateway replica on the same Valkey (limits are counted there, so replicas share them)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from ops.localcluster import DEFAULT_MODEL_NAME, LocalCluster, Process, free_port
from tests.conftest import start_cluster
from tests.helpers.cluster import on_the_core, wait_for

CHAT = {"model": DEFAULT_MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("auth"), model_store, auth=True)
    try:
        port = free_port()
        c.procs["gateway-2"] = Process(
            "gateway-2",
            [sys.executable, "-m", "services.gateway"],
            c.gateway_env(port),
            c.home / "logs" / "gateway-2.log",
            http_port=port,
        )
        c.procs["gateway-2"].start()
        c.wait_ready("gateway-2", 60)
        c.register_default_model()
        yield c
    finally:
        c.stop()


def second_gateway(c: LocalCluster) -> str:
    return f"http://127.0.0.1:{c.procs['gateway-2'].http_port}"


def make_key(c: LocalCluster, name: str, **spec: object) -> str:
    r = httpx.post(f"{c.base_url}/admin/keys", json={"name": name, **spec}, headers=c.admin_headers, timeout=10)
    assert r.status_code == 201, r.text
    return str(r.json()["key"])


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_request_without_a_key_is_401_in_openai_format(secure: LocalCluster) -> None:
    r = httpx.post(f"{secure.base_url}/v1/chat/completions", json=CHAT, timeout=30)
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"] == "Bearer"
    error = r.json()["error"]
    assert error["code"] == "invalid_api_key" and error["param"] is None
    assert error["type"] == "authentication_error" and "API key" in error["message"]
    assert httpx.get(f"{secure.base_url}/v1/models", timeout=10).status_code == 401


def test_an_unknown_key_is_401_and_its_secret_is_not_echoed(secure: LocalCluster) -> None:
    bad = "tsk-this-key-was-never-issued-0123456789"
    r = httpx.post(f"{secure.base_url}/v1/chat/completions", json=CHAT, headers=bearer(bad), timeout=30)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert bad not in r.text


def test_health_and_metrics_stay_open(secure: LocalCluster) -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(f"{secure.base_url}{path}", timeout=10).status_code == 200


def test_admin_api_refuses_no_key_with_401_and_a_plain_key_with_403(secure: LocalCluster) -> None:
    key = make_key(secure, "not-admin")
    for method, path in (
        ("GET", "/admin/keys"),
        ("POST", "/admin/keys"),
        ("GET", "/admin/models"),
        ("DELETE", "/admin/keys/not-admin"),
        ("GET", "/admin/instances"),
    ):
        assert httpx.request(method, f"{secure.base_url}{path}", timeout=10).status_code == 401
        r = httpx.request(method, f"{secure.base_url}{path}", headers=bearer(key), timeout=10)
        assert r.status_code == 403, (method, path)
        assert r.json()["error"]["type"] == "permission_error"


def test_listing_keys_shows_no_secret_and_a_deleted_key_stops_working(secure: LocalCluster) -> None:
    key = make_key(secure, "short-lived", models=["a", "b"], requests_per_minute=100)
    listed = httpx.get(f"{secure.base_url}/admin/keys", headers=secure.admin_headers, timeout=10).json()
    mine = next(k for k in listed if k["name"] == "short-lived")
    assert mine["models"] == ["a", "b"] and mine["requests_per_minute"] == 100
    assert key not in str(listed) and "key" not in mine
    again = httpx.post(
        f"{secure.base_url}/admin/keys", json={"name": "short-lived"}, headers=secure.admin_headers, timeout=10
    )
    assert again.status_code == 409
    assert httpx.get(f"{secure.base_url}/v1/models", headers=bearer(key), timeout=10).status_code == 200
    r = httpx.delete(f"{secure.base_url}/admin/keys/short-lived", headers=secure.admin_headers, timeout=10)
    assert r.status_code == 200
    assert httpx.get(f"{secure.base_url}/v1/models", headers=bearer(key), timeout=10).status_code == 401
    # Deleted through one replica, refused by the other: no replica caches keys.
    assert httpx.get(f"{second_gateway(secure)}/v1/models", headers=bearer(key), timeout=10).status_code == 401


def test_a_key_limited_to_some_models_gets_403_for_another(secure: LocalCluster) -> None:
    key = make_key(secure, "only-other", models=["some-other-model"])
    r = httpx.post(f"{secure.base_url}/v1/chat/completions", json=CHAT, headers=bearer(key), timeout=30)
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "model_not_allowed" and r.json()["error"]["param"] == "model"
    models = httpx.get(f"{secure.base_url}/v1/models", headers=bearer(key), timeout=10).json()["data"]
    assert DEFAULT_MODEL_NAME not in [m["id"] for m in models]
    allowed = make_key(secure, "only-default", models=[DEFAULT_MODEL_NAME])
    r = httpx.post(f"{secure.base_url}/v1/chat/completions", json=CHAT, headers=bearer(allowed), timeout=120)
    assert r.status_code == 200, r.text


def test_requests_per_minute_are_limited_across_two_gateway_replicas(secure: LocalCluster) -> None:
    key = make_key(secure, "three-a-minute", requests_per_minute=3)
    urls = [secure.base_url, second_gateway(secure), secure.base_url]
    for url in urls:
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=bearer(key), timeout=120)
        assert r.status_code == 200, r.text
    for url in (second_gateway(secure), secure.base_url):
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, headers=bearer(key), timeout=30)
        assert r.status_code == 429, r.text
        assert 1 <= int(r.headers["Retry-After"]) <= 120
        error = r.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
        assert "requests per minute" in error["message"]
    # Another key is not held back by this one's count.
    other = make_key(secure, "unlimited")
    r = httpx.post(f"{secure.base_url}/v1/chat/completions", json=CHAT, headers=bearer(other), timeout=120)
    assert r.status_code == 200


def test_tokens_per_minute_reserve_max_tokens_and_settle_with_what_was_generated(secure: LocalCluster) -> None:
    body = {
        "model": DEFAULT_MODEL_NAME,
        "prompt": "The capital of France is",
        "max_tokens": 300,
        "temperature": 0,
        "stop": [".", "\n"],
    }
    # All four answers from the continuous-batching core: the start tier's greedy text can
    # differ from the core's in its last digits, and so end a token earlier or later.
    on_the_core(secure, DEFAULT_MODEL_NAME)
    probe = httpx.post(f"{secure.base_url}/v1/completions", json=body, headers=secure.admin_headers, timeout=120)
    assert probe.status_code == 200, probe.text
    p, c = probe.json()["usage"]["prompt_tokens"], probe.json()["usage"]["completion_tokens"]
    assert c < 300
    # Room for one reservation, then (only if the first was settled to p + c) for a second.
    key = make_key(secure, "tokens", tokens_per_minute=2 * p + c + 300)
    for _ in range(2):
        r = httpx.post(f"{secure.base_url}/v1/completions", json=body, headers=bearer(key), timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == c  # temperature 0: the same text
    r = httpx.post(f"{secure.base_url}/v1/completions", json=body, headers=bearer(key), timeout=30)
    assert r.status_code == 429
    assert "tokens per minute" in r.json()["error"]["message"] and r.headers["Retry-After"]
    # A request that could never fit says so, and when to retry is not promised.
    big = {**body, "max_tokens": 2 * p + c + 300}
    r = httpx.post(f"{secure.base_url}/v1/completions", json=big, headers=bearer(key), timeout=30)
    assert r.status_code == 429 and "Request too large" in r.json()["error"]["message"]
    assert "Retry-After" not in r.headers


def test_the_openai_client_works_with_a_valid_key_streamed_and_not(secure: LocalCluster) -> None:
    key = make_key(
        secure, "openai-client", models=[DEFAULT_MODEL_NAME], requests_per_minute=100, tokens_per_minute=100_000
    )
    client = openai.OpenAI(base_url=f"{secure.base_url}/v1", api_key=key, max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert r.choices[0].message.content
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
    )
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert [m.id for m in client.models.list()] == [DEFAULT_MODEL_NAME]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{secure.base_url}/v1", api_key="tsk-wrong", max_retries=0).models.list()
    with pytest.raises(openai.PermissionDeniedError):
        client.completions.create(model="another-model", prompt="x", max_tokens=1)


def test_keys_survive_a_restart_of_valkey(secure: LocalCluster) -> None:
    key = make_key(secure, "durable", requests_per_minute=1000)
    secure.restart("valkey")
    # While the gateway reconnects it answers 503 with Retry-After; then the key works again.
    for url in (secure.base_url, second_gateway(secure)):
        wait_for(
            lambda u=url: httpx.get(f"{u}/v1/models", headers=bearer(key), timeout=30).status_code == 200,
            30,
            f"the key to work on {url} after Valkey came back",
            every_s=0.2,
        )
    r = httpx.post(f"{second_gateway(secure)}/v1/chat/completions", json=CHAT, headers=bearer(key), timeout=120)
    assert r.status_code == 200, r.text
    names = [
        k["name"] for k in httpx.get(f"{secure.base_url}/admin/keys", headers=secure.admin_headers, timeout=10).json()
    ]
    assert "durable" in names
