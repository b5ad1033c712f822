"""A worker tiers up only on an idle node (TESSERA_TIER_UP_IDLE_S), never while a request runs
there; a tier-up that fails leaves the worker serving from the START tier, and is not retried
(each attempt would take another core-second from the node)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from ops.localcluster import LocalCluster, default_model_path
from tests.conftest import start_cluster
from tests.helpers.cluster import metric, register, wait_for

ENGINE = "engine@node-0"
IDLE_S = 2.0


@pytest.fixture(scope="module")
def patient(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    """A node that tiers up after IDLE_S idle: long enough for one request to follow another
    with no tier-up between them."""
    c = start_cluster(tmp_path_factory.mktemp("patient"), model_store, TESSERA_TIER_UP_IDLE_S=str(IDLE_S))
    try:
        yield c
    finally:
        c.stop()


def tier_of(cluster: LocalCluster, model: str) -> str:
    status = httpx.get(f"{cluster.base_url}/admin/instances", timeout=10).json()
    return next((i["tier"] for n in status["nodes"] for i in n["instances"] if i["model"] == model), "")


def test_a_busy_node_keeps_serving_from_the_start_tier_and_tiers_up_once_idle(patient: LocalCluster) -> None:
    cluster = patient
    register(cluster, "patient", keep_alive_s=600.0)
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    ups = metric(cluster, ENGINE, "tessera_engine_tier_ups_total", result="done")
    # The start, then at once a long stream: the node is never idle long enough, so every
    # look while it streams finds the START tier and no tier-up (one would take a few
    # core-seconds, far less than the stream: a node that tiered up while busy shows it here).
    assert client.completions.create(model="patient", prompt="Hi", max_tokens=2).choices[0].text is not None
    stream = client.completions.create(
        model="patient",
        prompt="Tell me a long story about the sea.",
        max_tokens=256,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen: list[tuple[str, float]] = []
    for _ in stream:
        seen.append(
            (tier_of(cluster, "patient"), metric(cluster, ENGINE, "tessera_engine_tier_ups_total", result="done"))
        )
    assert len(seen) > 10 and set(seen) == {("start", ups)}, seen[-3:]
    # Idle now: it tiers up.
    wait_for(lambda: tier_of(cluster, "patient") == "steady", 60, "the tier-up once the node is idle")
    assert metric(cluster, ENGINE, "tessera_engine_tier_ups_total", result="done") == ups + 1


def failed_tier_ups(cluster: LocalCluster) -> float:
    return metric(cluster, ENGINE, "tessera_engine_tier_ups_total", result="failed")


def test_a_failed_tier_up_keeps_the_start_tier_serving_and_is_not_retried(
    own_cluster: LocalCluster, tmp_path: Path
) -> None:
    cluster = own_cluster
    # Its own artifact (the GGUF with bytes appended), so that breaking it breaks nobody else's.
    variant = tmp_path / "tier-up-variant.gguf"
    variant.write_bytes(default_model_path().read_bytes() + b"tier-up-test")
    reg = register(cluster, "tier-up-broken", source=str(variant))
    artifact = Path(str(reg["artifact"]["path"]))  # type: ignore[index]
    # Break the STEADY tier: no compiled blob, and an IR that does not parse.
    for blob in (artifact / "compiled" / "cpu").glob("*.blob"):
        blob.unlink()
    (artifact / "openvino_model.xml").write_text("<not an IR")
    before = failed_tier_ups(cluster)
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    def ask() -> str | None:
        r = client.chat.completions.create(
            model="tier-up-broken", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        return r.choices[0].message.content

    assert ask()
    wait_for(lambda: failed_tier_ups(cluster) >= before + 1, 60, "the tier-up to fail")
    time.sleep(1.5)  # sync-ok: an idle window in which a retry would have been asked for (asserts an absence)
    assert failed_tier_ups(cluster) == before + 1
    assert ask()  # still served, from the START tier
    status = httpx.get(f"{cluster.base_url}/admin/instances", timeout=10).json()
    (tier,) = [i["tier"] for n in status["nodes"] for i in n["instances"] if i["model"] == "tier-up-broken"]
    assert tier == "start"
