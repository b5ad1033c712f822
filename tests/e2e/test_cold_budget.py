"""A request's cold-start budget on a cluster of its own, where nothing else holds the model's
weights (issue 35, part 2): a start predicted longer than the budget is refused at once with
503 and a Retry-After within 2x of the start's measured time, the start goes ahead, and a retry
once it is ready is served warm."""

from __future__ import annotations

import math
import time

import httpx
import openai

from ops.localcluster import LocalCluster
from tests.helpers.cluster import cold_starts, loaded_models, register, wait_for

NAME = "budget-smollm"
HI = [{"role": "user", "content": "Hi"}]


def chat(cluster: LocalCluster, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(
        f"{cluster.base_url}/v1/chat/completions",
        json={"model": NAME, "messages": HI, "max_tokens": 2},
        headers=headers or {},
        timeout=300,
    )


def instances(cluster: LocalCluster) -> dict[str, object]:
    return dict(httpx.get(f"{cluster.base_url}/admin/instances", timeout=10).json())


def cold_from_the_store(cluster: LocalCluster, artifact_id: str) -> None:
    """Every cache of the model dropped (its next start reads the store), the scheduler's view
    no longer holding its weights resident anywhere, and a worker prewarmed again in place of
    the one that held them: both starts compared below load into a prewarmed worker (a start
    that spawns its worker takes a second or more longer, in its load phase)."""
    httpx.post(f"{cluster.base_url}/admin/cache/evict?tier=all", timeout=30).raise_for_status()

    def cold_and_prewarmed() -> bool:
        nodes = instances(cluster)["nodes"]
        return all(artifact_id not in n["resident"] and n["prewarmed"] > 0 for n in nodes)  # type: ignore[attr-defined]

    wait_for(cold_and_prewarmed, 60, "the view to drop the evicted weights and a worker to be prewarmed")


def start_ready_s(start: dict[str, object]) -> float:
    phases = start["phases"]
    return float(phases["init_s"] + phases["load_s"] + phases["profile_s"])  # type: ignore[index]


def test_a_start_over_budget_is_refused_at_once_and_goes_ahead(own_cluster: LocalCluster) -> None:
    cluster = own_cluster
    record = register(cluster, NAME, keep_alive_s=1.0)
    aid = str(record["artifact"]["artifact_id"])  # type: ignore[index]
    # Two starts from the store measured (the scheduler's load-time model is their median),
    # each then back to zero.
    for n in (1, 2):
        cold_from_the_store(cluster, aid)
        assert chat(cluster).status_code == 200
        wait_for(lambda: len(cold_starts(cluster, NAME)) == n, 30, f"start {n} to be recorded")  # noqa: B023
        wait_for(lambda: NAME not in loaded_models(cluster), 30, f"{NAME} to scale to zero")
    register(cluster, NAME, keep_alive_s=300.0, replace=True)  # the started instance stays for the retry
    cold_from_the_store(cluster, aid)

    refused = chat(cluster, {"X-Tessera-Max-Wait": "0.1"})
    refused_at = time.time()
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "model_starting" and "predicted ready in" in error["message"]
    retry_after_s = int(refused.headers["retry-after-ms"]) / 1000
    assert int(refused.headers["Retry-After"]) == math.ceil(retry_after_s)

    # The start went ahead without the request: its instance became ready after the 503.
    def loaded_at() -> float | None:
        for node in instances(cluster)["nodes"]:  # type: ignore[attr-defined]
            for inst in node["instances"]:
                if inst["model"] == NAME:
                    return float(inst["loaded_at"])
        return None

    assert wait_for(loaded_at, 120, f"{NAME} to be started") > refused_at

    # The retry, with the same budget (through the official client), is served warm.
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    retry = client.chat.completions.with_raw_response.create(
        model=NAME,
        messages=HI,  # type: ignore[arg-type]
        max_tokens=2,
        extra_body={"tessera": {"max_wait_s": 0.1}},
    )
    assert retry.http_response.status_code == 200 and retry.parse().model == NAME
    assert "x-tessera-cold-start" not in retry.headers

    # The refusal's Retry-After was the start's time, within 2x of what starts from the store
    # measure: checked on the exact `retry-after-ms` (OpenAI's, which its clients read first),
    # whose whole seconds rounded up `Retry-After` is (a start here takes under a second). A
    # prediction is as good as the starts it comes from: a read from a cold disk varies from
    # one start to the next (0.27 s and 0.63 s seen in one run), so the bounds are those of the
    # three starts measured, this one included.
    starts = wait_for(lambda: (s := cold_starts(cluster, NAME)) and len(s) == 3 and s, 30, "the third start")
    measured = [start_ready_s(s) for s in starts]
    assert min(measured) / 2 <= retry_after_s <= 2 * max(measured), (retry_after_s, measured)
