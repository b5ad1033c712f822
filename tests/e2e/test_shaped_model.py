"""A model of a size people run, not the 98 MB default (issue 33): a GGUF shaped like a real
model (random weights, the real tokenizer: `bench/shaped_models.py`) registers with default
settings, serves, scales to zero and comes back, inside the node's default memory budget.

SmolLM2-360M's shape by default (a 209 MB GGUF: the suite stays minutes long on two cores);
`TESSERA_TEST_SHAPE=smollm2-1.7b` or `llama3-8b` runs the same test at those sizes (the
measured figures at every size are `bench/models.py`'s).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench import shaped_models
from ops.localcluster import LocalCluster
from services.memory_manager.settings import MemoryManagerSettings
from tests.conftest import start_cluster
from tests.helpers.cluster import cold_starts, loaded_models, register, wait_for

SHAPE = os.environ.get("TESSERA_TEST_SHAPE", "smollm2-360m")
MODEL = "shaped"
TOKENS = 8


@pytest.fixture(scope="module")
def shaped_gguf() -> Path:
    return shaped_models.ensure(SHAPE)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    """A cluster of its own: the memory the node books is this model's alone."""
    c = start_cluster(tmp_path_factory.mktemp("shaped"), model_store)
    try:
        yield c
    finally:
        c.stop()


def _node_status(cluster: LocalCluster) -> dict[str, object]:
    nodes = httpx.get(f"{cluster.base_url}/admin/instances", timeout=10).json()["nodes"]
    assert len(nodes) == 1
    return dict(nodes[0])


def _ask(cluster: LocalCluster) -> dict[str, object]:
    r = httpx.post(
        f"{cluster.base_url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": TOKENS,
            "ignore_eos": True,
        },
        timeout=600,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_shaped_model_registers_serves_scales_to_zero_and_comes_back_resident(
    node: LocalCluster, shaped_gguf: Path
) -> None:
    record = register(node, MODEL, keep_alive_s=1.0, source=str(shaped_gguf))
    artifact = record["artifact"]
    assert isinstance(artifact, dict)
    params = shaped_models.params_of(SHAPE)
    # The weights as served are a 4- or 8-bit form of the parameters: more than half a byte each.
    assert artifact["weight_bytes"] >= params // 2
    budget = MemoryManagerSettings().memory_budget_bytes
    assert artifact["weight_bytes"] < budget

    answer = _ask(node)
    assert answer["usage"]["completion_tokens"] == TOKENS  # type: ignore[index]
    status = _node_status(node)
    assert status["memory_budget_bytes"] == budget
    assert status["kv_on_demand"] is True  # OpenVINO's cache grows as rows fill: no KV floor booked
    used = int(status["memory_used_bytes"])  # type: ignore[call-overload]
    assert artifact["weight_bytes"] <= used <= budget

    # Idle past its keep-alive: scaled to zero, its weights kept resident on the node.
    wait_for(lambda: MODEL not in loaded_models(node), 60, f"{MODEL} to scale to zero")
    assert artifact["artifact_id"] in _node_status(node)["resident"]  # type: ignore[operator]
    starts_before = len(cold_starts(node, MODEL))
    answer = _ask(node)
    assert answer["usage"]["completion_tokens"] == TOKENS  # type: ignore[index]
    starts = cold_starts(node, MODEL)
    assert len(starts) == starts_before + 1
    assert starts[0]["source"] == "resident"
