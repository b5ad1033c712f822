"""Tangram-style reuse: a model scaled to zero stays resident (counted in /metrics) and its
next start skips the load; evicting it frees that memory and the next start comes from the
store, still restoring the materialized blob."""

from __future__ import annotations

import httpx
import openai

from shared.localcluster import LocalCluster
from tests.helpers.cluster import cold_starts, loaded_models, metric, register, wait_for

ENGINE, MEMORY = "engine@node-0", "memory_manager@node-0"


def ask(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert r.choices[0].message.content is not None


def test_scaled_to_zero_model_stays_resident_until_evicted(own_cluster: LocalCluster) -> None:
    # A cluster of its own: every name on this GGUF shares one resident model, so no other
    # test's instance may hold it.
    cluster = own_cluster
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    name = "pool-smollm"
    record = register(cluster, name, keep_alive_s=1.0)
    weights = record["artifact"]["weight_bytes"]  # type: ignore[index]

    ask(client, name)
    wait_for(lambda: name not in loaded_models(cluster), 30, f"{name} to scale to zero")
    # Its instance and KV cache are gone; its weights are still held, and counted.
    assert metric(cluster, ENGINE, "tessera_engine_pool_idle_bytes") >= weights
    used_resident = metric(cluster, MEMORY, "tessera_memory_used_bytes")
    assert used_resident >= weights

    hits = metric(cluster, ENGINE, "tessera_engine_pool_hits_total")
    ask(client, name)
    assert metric(cluster, ENGINE, "tessera_engine_pool_hits_total") == hits + 1
    starts = wait_for(lambda: (s := cold_starts(cluster, name)) and len(s) >= 2 and s, 30, "two starts")
    newest, first = starts[0], starts[1]
    assert first["source"] == "store"
    assert newest["source"] == "resident"
    assert newest["phases"]["load_s"] < 0.05  # nothing was loaded

    wait_for(lambda: name not in loaded_models(cluster), 30, f"{name} to scale to zero again")
    evicted = httpx.post(f"{cluster.base_url}/admin/cache/evict", timeout=30).json()
    assert sum(e["freed_bytes"] for e in evicted) >= weights
    assert metric(cluster, ENGINE, "tessera_engine_pool_idle_bytes") == 0
    assert metric(cluster, MEMORY, "tessera_memory_used_bytes") <= used_resident - weights

    ask(client, name)  # from the model store on disk
    starts = wait_for(lambda: (s := cold_starts(cluster, name)) and len(s) >= 3 and s, 30, "a third start")
    assert starts[0]["source"] == "store"
    assert starts[0]["loaded_from_cache"] is True
