"""Destructive tests on a cluster of their own: restarts of Valkey and of every service, an
engine killed mid-stream, and NATS lost and regained."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from ops.localcluster import SERVICES, LocalCluster
from tests.helpers.cluster import register, wait_for


def chat(cluster: LocalCluster, model: str, **kw: object) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, **kw)


def test_registrations_survive_a_restart_of_valkey_and_every_service(own_cluster: LocalCluster) -> None:
    register(own_cluster, "persist-a", keep_alive_s=42)
    register(own_cluster, "persist-b")  # a second name on the same GGUF: same artifact
    models = {m["name"]: m for m in httpx.get(f"{own_cluster.base_url}/admin/models").json()}
    assert models["persist-a"]["artifact"]["artifact_id"] == models["persist-b"]["artifact"]["artifact_id"]

    own_cluster.restart("valkey")
    for name in list(own_cluster.procs):
        if name.split("@")[0] in SERVICES:
            own_cluster.restart(name)

    after = {m["name"]: m for m in httpx.get(f"{own_cluster.base_url}/admin/models").json()}
    assert after["persist-a"]["keep_alive_s"] == 42
    assert {"persist-a", "persist-b"} <= set(after)
    assert chat(own_cluster, "persist-a").choices[0].message.content is not None


def test_a_second_name_on_the_same_gguf_is_not_converted_again(own_cluster: LocalCluster) -> None:
    r = register(own_cluster, "persist-c")
    assert r["converted"] is False


def test_removed_model_is_gone_from_the_api(own_cluster: LocalCluster) -> None:
    register(own_cluster, "to-remove")
    assert httpx.delete(f"{own_cluster.base_url}/admin/models/to-remove").status_code == 200
    r = httpx.post(
        f"{own_cluster.base_url}/v1/chat/completions",
        json={"model": "to-remove", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 404
    assert httpx.delete(f"{own_cluster.base_url}/admin/models/to-remove").status_code == 404


def test_registering_a_file_that_is_not_gguf_is_a_clear_400(own_cluster: LocalCluster, tmp_path: Path) -> None:
    bogus = tmp_path / "fake.gguf"
    bogus.write_bytes(b"not a model")
    r = httpx.post(f"{own_cluster.base_url}/admin/models", json={"name": "bogus", "source": str(bogus)}, timeout=60)
    assert r.status_code == 400
    assert "GGUF" in r.json()["error"]["message"]


def test_engine_killed_mid_stream_gives_an_openai_error_not_a_hang(own_cluster: LocalCluster) -> None:
    register(own_cluster, "victim")
    client = openai.OpenAI(base_url=f"{own_cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model="victim",
        messages=[{"role": "user", "content": "Tell a long story."}],
        max_tokens=3000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    with pytest.raises(openai.APIError) as e:
        for i, _chunk in enumerate(stream):
            if i == 3:
                own_cluster.procs["engine@node-0"].kill()
    assert "stopped responding" in str(e.value.message)

    # A fresh engine comes up; the next request cold-starts there and succeeds.
    own_cluster.restart("engine@node-0")
    r = wait_for(lambda: _try_chat(own_cluster, "victim"), 60, "a request to succeed on the new engine", every_s=0.5)
    assert r.choices[0].message.content is not None


def _try_chat(cluster: LocalCluster, model: str) -> openai.types.chat.ChatCompletion | None:
    try:
        return chat(cluster, model)
    except openai.APIStatusError as e:
        assert e.status_code == 503, e  # only "not there yet" is acceptable while it comes back
        return None


def _nats_check(cluster: LocalCluster) -> bool:
    return bool(httpx.get(f"{cluster.base_url}/readyz", timeout=5).json()["checks"]["nats"])


def test_services_report_lost_nats_in_readyz_and_reconnect(own_cluster: LocalCluster) -> None:
    register(own_cluster, "after-nats")
    own_cluster.procs["nats"].stop()
    wait_for(lambda: not _nats_check(own_cluster), 30, "the gateway to report NATS lost")
    assert httpx.get(f"{own_cluster.base_url}/readyz", timeout=5).status_code == 503
    own_cluster.restart("nats")
    for name, proc in own_cluster.procs.items():
        if proc.http_port is not None:
            wait_for(lambda n=name: own_cluster.ready(n), 30, f"{name} to report ready again")
    r = wait_for(lambda: _try_chat(own_cluster, "after-nats"), 60, "a request after NATS came back", every_s=0.5)
    assert r.choices[0].message.content is not None


def _valkey_check(cluster: LocalCluster) -> bool:
    return bool(httpx.get(f"{cluster.base_url}/readyz", timeout=5).json()["checks"]["valkey"])


def test_lost_valkey_shows_in_readyz_and_service_resumes(own_cluster: LocalCluster) -> None:
    register(own_cluster, "after-valkey")
    own_cluster.procs["valkey"].stop()
    wait_for(lambda: not _valkey_check(own_cluster), 30, "the gateway to report Valkey lost")
    r = httpx.get(f"{own_cluster.base_url}/v1/models", timeout=30)
    assert r.status_code == 503 and r.headers["Retry-After"]  # an OpenAI-format error, not a hang
    assert r.json()["error"]["code"] == "unavailable"
    own_cluster.restart("valkey")
    wait_for(lambda: _valkey_check(own_cluster), 30, "the gateway to reconnect to Valkey")
    assert "after-valkey" in [m["id"] for m in httpx.get(f"{own_cluster.base_url}/v1/models").json()["data"]]
