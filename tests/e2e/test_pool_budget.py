"""The engine's resident pool under its byte budget (TESSERA_POOL_BUDGET_BYTES, Tangram §3.1):
models scaled to zero stay resident only while their weights fit it; past it, one is evicted
(Tangram's choice, `policy/eviction.py`) and its next start loads from the store."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import msgspec
import openai
import pytest

from ops.localcluster import LocalCluster, default_model_path
from shared.messages import Artifact
from tests.conftest import start_cluster
from tests.helpers.cluster import cold_starts, loaded_models, metric, register, wait_for

ENGINE = "engine@node-0"


@pytest.fixture(scope="module")
def small_pool(
    tmp_path_factory: pytest.TempPathFactory, model_store: Path, cluster: LocalCluster
) -> Iterator[tuple[LocalCluster, Path, int]]:
    """A node whose pool holds one model's weights and a half: the session cluster has
    converted the default GGUF, whose weights' size sets it."""
    (meta,) = [p for p in model_store.glob("*/artifact.msgpack") if (p.parent / "compiled").is_dir()][:1]
    weights = msgspec.msgpack.decode(meta.read_bytes(), type=Artifact).weight_bytes
    home = tmp_path_factory.mktemp("smallpool")
    # Another artifact of the same size: the bytes tests/e2e/test_preemption.py's "big" has
    # (one conversion per session).
    copy = home / "big.gguf"
    shutil.copyfile(default_model_path(), copy)
    with copy.open("ab") as f:
        f.write(b"\x00tessera-test-big")
    c = start_cluster(home, model_store, TESSERA_POOL_BUDGET_BYTES=str(weights * 3 // 2))
    try:
        yield c, copy, weights
    finally:
        c.stop()


def test_past_its_budget_the_pool_evicts_a_resident_and_its_next_start_loads_from_the_store(
    small_pool: tuple[LocalCluster, Path, int],
) -> None:
    cluster, copy, weights = small_pool
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    register(cluster, "one", keep_alive_s=1.0)
    register(cluster, "two", keep_alive_s=1.0, source=str(copy))

    def served_then_idle(name: str) -> None:
        r = client.completions.create(model=name, prompt="Hello", max_tokens=2)
        assert r.choices[0].text is not None
        wait_for(lambda: name not in loaded_models(cluster), 30, f"{name} to scale to zero")

    evictions = metric(cluster, ENGINE, "tessera_engine_pool_evictions_total")

    def pool_idle_bytes() -> float:
        return metric(cluster, ENGINE, "tessera_engine_pool_idle_bytes")

    served_then_idle("one")
    # One model's weights fit: it stays resident.
    wait_for(lambda: pool_idle_bytes() == weights, 30, "one's weights idle in the pool")
    assert metric(cluster, ENGINE, "tessera_engine_pool_evictions_total") == evictions

    served_then_idle("two")
    # Two do not: one of them went, and the pool holds what its budget allows.
    wait_for(
        lambda: metric(cluster, ENGINE, "tessera_engine_pool_evictions_total") == evictions + 1,
        30,
        "a resident model evicted",
    )
    assert pool_idle_bytes() == weights
    assert metric(cluster, ENGINE, "tessera_engine_resident_model_bytes") == weights

    # The one kept starts from memory; the one evicted loads again (from the loader's host
    # cache or the store).
    for name in ("one", "two"):
        client.completions.create(model=name, prompt="Hello", max_tokens=2)
    sources = {
        name: wait_for(lambda n=name: (s := cold_starts(cluster, n)) and len(s) == 2 and s, 30, "two starts")[0][
            "source"
        ]
        for name in ("one", "two")
    }
    assert sorted(s == "resident" for s in sources.values()) == [False, True], sources


def test_the_memory_budget_counts_what_the_workers_really_hold(small_pool: tuple[LocalCluster, Path, int]) -> None:
    """A bound worker holds far more than its artifact's weights (runtime, repacked weights,
    both tiers, heap): the engine trues its reservation up to its measured RSS (less its KV
    cache, which the KV reservation counts), so the node's memory manager sees what the
    worker really holds (policy/footprint.py)."""
    cluster, _, weights = small_pool
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    register(cluster, "held", keep_alive_s=600.0)
    assert client.completions.create(model="held", prompt="Hello", max_tokens=4).choices[0].text is not None

    def accounted() -> tuple[float, float] | None:
        rss = metric(cluster, ENGINE, "tessera_engine_bound_workers_rss_bytes")
        kv = metric(cluster, ENGINE, "tessera_engine_kv_allocated_bytes")
        used = metric(cluster, "memory_manager@node-0", "tessera_memory_used_bytes")
        # Within the true-up's tolerance of what the workers hold (their RSS moves a little).
        return (used, rss) if rss > 0 and used >= 0.9 * (rss - kv) else None

    used, rss = wait_for(accounted, 30, "the memory manager to count the worker's real footprint")
    assert rss > 2 * weights  # what made the true-up necessary: weights alone undercount it
    assert used > 2 * weights
    assert metric(cluster, ENGINE, "tessera_engine_unaccounted_bytes") == 0
