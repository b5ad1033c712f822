"""A tier-up that fails leaves the worker serving from the START tier, and is not retried (each
attempt would take another core-second from the node)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai

from ops.localcluster import LocalCluster, default_model_path
from tests.helpers.cluster import metric, register, wait_for

ENGINE = "engine@node-0"


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
