"""A node out of memory: a fourth model's start ends an idle instance (Tangram §3.2, minimal
cost) instead of failing, and when every instance is busy the start waits for one to go idle.
Every request completes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ops.localcluster import LocalCluster, default_model_path
from services.loader.convert import gguf_facts
from services.loader.store import kv_bytes_per_token
from tests.conftest import start_cluster
from tests.helpers.cluster import loaded_models, metric, register, wait_for

ENGINE, MEMORY = "engine@node-0", "memory_manager@node-0"
NAMES = [f"mem-{i}" for i in range(4)]


def budget_for_three() -> int:
    """Weights once (names on one GGUF share them; the GGUF's size bounds the IR's) and the
    full-context KV reservations of three names and a half: a fourth name does not fit.

    The budget counts what starts reserve, so the cluster runs with the footprint true-up off:
    it would grow the shared worker's reservation to its real size (≈ 10 times its weights)
    whenever it ran, and how many names fit would depend on when. The true-up is tested
    where a budget is sized for it (test_preemption, test_pool_budget)."""
    gguf = default_model_path()
    facts = gguf_facts(gguf)
    kv = kv_bytes_per_token(int(facts["layers"]), int(facts["kv_heads"]), int(facts["head_dim"]))
    return gguf.stat().st_size + int(3.5 * kv * int(facts["context_length"]))


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    c = start_cluster(
        tmp_path_factory.mktemp("tight"),
        model_store,
        TESSERA_MEMORY_BUDGET_BYTES=str(budget_for_three()),
        TESSERA_MAX_INFLIGHT="32",
        TESSERA_TRUE_UP_INTERVAL_S="0",
        # Each start books its whole context's KV cache ahead, as the budget counts (OpenVINO's
        # cache grows on demand: without a floor set, a start books its weights alone).
        TESSERA_KV_MIN_TOKENS=str(gguf_facts(default_model_path())["context_length"]),
    )
    try:
        for name in NAMES:
            register(c, name, keep_alive_s=600.0)  # no keep-alive scale-in during the test
        yield c
    finally:
        c.stop()


def test_a_fourth_model_ends_an_idle_instance_to_start(tight: LocalCluster) -> None:
    client = openai.OpenAI(base_url=f"{tight.base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    def ask(model: str) -> str:
        r = client.completions.create(model=model, prompt="The sky is", max_tokens=3)
        return r.choices[0].text

    for name in NAMES[:3]:
        ask(name)
    assert set(NAMES[:3]) <= loaded_models(tight)
    before = metric(tight, ENGINE, "tessera_engine_instance_evictions_total")
    ask(NAMES[3])
    assert metric(tight, ENGINE, "tessera_engine_instance_evictions_total") == before + 1
    # The cluster view follows the engines' heartbeats: it shows the eviction shortly.
    loaded = wait_for(
        lambda: m if len(m := loaded_models(tight) & set(NAMES)) == 3 else None, 10, "the view to show three instances"
    )
    assert NAMES[3] in loaded
    assert metric(tight, MEMORY, "tessera_memory_used_bytes") <= budget_for_three()
    assert metric(tight, MEMORY, "tessera_memory_denied_total") >= 1


async def test_with_every_instance_busy_a_start_waits_and_every_request_completes(tight: LocalCluster) -> None:
    client = openai.AsyncOpenAI(base_url=f"{tight.base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def ask(model: str) -> str:
        r = await client.completions.create(model=model, prompt="Once upon a time", max_tokens=12)
        return r.choices[0].finish_reason

    # Twice each of the four, all at once: at most three fit, so some start must wait for an
    # instance to finish and then take its place.
    results = await asyncio.gather(*(ask(n) for n in NAMES * 2), return_exceptions=True)
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures
    assert all(r in ("stop", "length") for r in results)
    assert metric(tight, MEMORY, "tessera_memory_used_bytes") <= budget_for_three()
