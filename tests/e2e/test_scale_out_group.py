"""Three nodes: an operator scales a running model out to every node at once
(`POST /admin/models/{name}/scale`); the scheduler starts it on both new nodes together and
one PipeCast plan brings its blob to both (FaaScale §4-5), from the model's node and from the
store, so the model's node serves its uplink once, not twice."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ops.localcluster import LocalCluster
from tests.conftest import running_cluster
from tests.helpers.cluster import metric, nodes_running, register, wait_for

NAME = "burst"


@pytest.fixture(scope="module")
def three_nodes(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    with running_cluster(
        tmp_path_factory.mktemp("three"),
        model_store,
        nodes=3,
        timeout_s=180,
        TESSERA_MULTICAST_SCALE_OUT="true",
        TESSERA_FILL_DELAY_S="0",
    ) as c:
        register(c, NAME, keep_alive_s=600.0)
        yield c


def scale(cluster: LocalCluster, name: str, body: object) -> httpx.Response:
    return httpx.post(f"{cluster.base_url}/admin/models/{name}/scale", json=body, timeout=30)


def test_a_model_scaled_out_to_two_nodes_at_once_reaches_both_along_one_plan(three_nodes: LocalCluster) -> None:
    c = three_nodes
    first = httpx.post(
        f"{c.base_url}/v1/completions", json={"model": NAME, "prompt": "Hello", "max_tokens": 2}, timeout=120
    )
    assert first.status_code == 200, first.text
    (home,) = nodes_running(c, NAME)
    wait_for(
        lambda: metric(c, f"loader@{home}", "tessera_loader_host_cache_entries") >= 1,
        30,
        f"{home}'s loader to hold the blob in host memory",
    )

    r = scale(c, NAME, {"instances": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    new = {f"node-{i}" for i in range(3)} - {home}
    assert body["running"] == [home] and set(body["started"]) == new
    wait_for(lambda: nodes_running(c, NAME) == {"node-0", "node-1", "node-2"}, 120, "the model on every node")

    # Each new node's loader received the blob, every block checked, from the plan. One plan
    # over both, with two sources (the home node and the store, FaaScale §4.2's k = 2): each
    # feeds one of them, so the home node's uplink carried one copy, not one per new node.
    planned = {n: metric(c, f"loader@{n}", "tessera_loader_multicast_blocks_total", source="planned") for n in new}
    assert all(v > 0 for v in planned.values()), planned
    served = metric(c, f"loader@{home}", "tessera_loader_served_blocks_total")
    assert 0 < served < sum(planned.values()), (served, planned)
    assert metric(c, "scheduler", "tessera_scheduler_scale_outs_total") >= 2

    # As many run already: nothing more starts; each new instance answers.
    again = scale(c, NAME, {"instances": 3}).json()
    assert sorted(again["running"]) == ["node-0", "node-1", "node-2"] and again["started"] == []
    for _ in range(3):
        ok = httpx.post(
            f"{c.base_url}/v1/completions", json={"model": NAME, "prompt": "Hi", "max_tokens": 2}, timeout=60
        )
        assert ok.status_code == 200, ok.text


def test_a_bad_scale_request_is_an_openai_error(three_nodes: LocalCluster) -> None:
    missing = scale(three_nodes, "no-such-model", {"instances": 2})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "name"
    zero = scale(three_nodes, NAME, {"instances": 0})
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "instances"
