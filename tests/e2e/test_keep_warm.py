"""Keep warm (issue 35, part 1) on a node that holds three names: a pinned model starts at its
registration, outlives its keep-alive, survives the eviction another model's start would have
taken it in, comes back by itself after an engine restart, and scales to zero once unpinned; a
pinned set the node cannot hold is refused with a 409. The tests run in order on one cluster."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from typer.testing import CliRunner

from ops import cli
from ops.localcluster import LocalCluster, default_model_path
from tests.e2e.test_memory_pressure import budget_for_three, tight  # noqa: F401  (its cluster)
from tests.helpers.cluster import loaded_models, metric, register, wait_for

ENGINE = "engine@node-0"
WARM = "warm-pin"
OTHERS = ["warm-a", "warm-b", "warm-c"]


@pytest.fixture(scope="module")
def node(request: pytest.FixtureRequest) -> LocalCluster:
    """test_memory_pressure's node (`tight`): three names fit, a fourth does not (its `mem-*`
    names are registered there, never started here)."""
    cluster: LocalCluster = request.getfixturevalue("tight")
    return cluster


def ask(c: LocalCluster, model: str) -> httpx.Response:
    r = httpx.post(
        f"{c.base_url}/v1/completions",
        json={"model": model, "prompt": "The sky is", "max_tokens": 2},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r


def instance(c: LocalCluster, model: str) -> dict[str, Any] | None:
    status = httpx.get(f"{c.base_url}/admin/instances", timeout=10).json()
    return next((i for n in status["nodes"] for i in n["instances"] if i["model"] == model), None)


def worker_of(c: LocalCluster, model: str) -> int | None:
    found = instance(c, model)
    return None if found is None else int(found["worker_pid"])


def tessera(c: LocalCluster, *args: str) -> str:
    width = cli.console.width
    cli.console.width = 400  # no table cell cut (the console is the CLI's own, made at import)
    try:
        result = CliRunner().invoke(cli.app, [*args, "--url", c.base_url, "--home", str(c.home)])
    finally:
        cli.console.width = width
    assert result.exit_code == 0, result.output
    return result.output


def test_a_pinned_model_starts_at_registration_and_survives_an_eviction_that_would_take_it(
    node: LocalCluster,
) -> None:
    record = register(node, WARM, keep_alive_s=1.0, min_instances=1)
    assert (record["min_instances"], record["priority"]) == (1, 0)
    # As its engine's heartbeat shows it (the scheduler's own entry, until then, has no worker).
    first = wait_for(
        lambda: i if (i := instance(node, WARM)) and i["worker_pid"] else None, 120, f"{WARM} to start with no request"
    )
    started = time.monotonic()
    for name in OTHERS:
        register(node, name, keep_alive_s=600.0)
    ask(node, OTHERS[0])
    ask(node, OTHERS[1])
    evictions = metric(node, ENGINE, "tessera_engine_instance_evictions_total")
    # The node is full: the third name's start ends an idle instance. The pinned one, never
    # used and loaded first, is the cheapest by Tangram's cost: unpinned, it would go.
    ask(node, OTHERS[2])
    assert metric(node, ENGINE, "tessera_engine_instance_evictions_total") == evictions + 1
    loaded = wait_for(
        lambda: m if len(m := loaded_models(node) & {WARM, *OTHERS}) == 3 else None, 30, "the view to show three"
    )
    assert WARM in loaded and OTHERS[2] in loaded
    # The same instance all along (not ended and started again).
    assert instance(node, WARM)["loaded_at"] == first["loaded_at"]  # type: ignore[index]
    assert time.monotonic() - started > 1.0  # and it outlived its 1 s keep-alive


def test_a_pinned_set_the_node_cannot_hold_is_refused_with_a_409(node: LocalCluster) -> None:
    running = sorted(loaded_models(node) & set(OTHERS))
    assert len(running) == 2
    for name in running:  # three pinned names: they fit
        assert "pinned ×1" in tessera(node, "models", "pin", name)
    (left,) = set(OTHERS) - set(running)
    r = httpx.post(f"{node.base_url}/admin/models/{left}/pin", json={"priority": 5}, timeout=30)
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "insufficient_memory"
    assert "need" in error["message"] and f"have {budget_for_three()} bytes" in error["message"]
    assert httpx.get(f"{node.base_url}/admin/models/{left}", timeout=10).json()["min_instances"] == 0
    # A registration that would make such a set is refused before it is stored.
    r = httpx.post(
        f"{node.base_url}/admin/models",
        json={"name": "warm-d", "source": str(default_model_path()), "min_instances": 1},
        timeout=600,
    )
    assert r.status_code == 409 and r.json()["error"]["code"] == "insufficient_memory", r.text
    assert httpx.get(f"{node.base_url}/admin/models/warm-d", timeout=10).status_code == 404
    for name in running:
        assert "scales to zero" in tessera(node, "models", "unpin", name)
    listed = tessera(node, "models", "ls")
    assert "pinned ×1" in next(line for line in listed.splitlines() if WARM in line)


def test_a_pinned_model_comes_back_by_itself_after_an_engine_restart(node: LocalCluster) -> None:
    before = worker_of(node, WARM)
    assert before is not None
    node.restart(ENGINE)
    wait_for(lambda: worker_of(node, WARM) not in (None, before), 120, f"{WARM} to start again on the new engine")
    # Warm: the request after it is served with no cold start.
    assert "x-tessera-cold-start" not in ask(node, WARM).headers


def test_unpinned_it_scales_to_zero_again(node: LocalCluster) -> None:
    assert WARM in loaded_models(node)
    r = httpx.post(f"{node.base_url}/admin/models/{WARM}/unpin", timeout=30)
    assert r.status_code == 200 and r.json()["min_instances"] == 0
    wait_for(lambda: WARM not in loaded_models(node), 30, f"{WARM} to scale to zero after its 1 s keep-alive")
    client = openai.OpenAI(base_url=f"{node.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert client.completions.create(model=WARM, prompt="Hi", max_tokens=2).choices
