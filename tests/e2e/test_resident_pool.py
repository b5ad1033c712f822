"""Tangram-style reuse: a model scaled to zero stays resident (counted in /metrics) and its
next start skips the load; evicting it frees that memory and the next start comes from the
store, still restoring the materialized blob."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from ops.localcluster import LocalCluster
from tests.helpers.cluster import cold_starts, loaded_models, metric, register, wait_for

ENGINE, MEMORY, LOADER = "engine@node-0", "memory_manager@node-0", "loader@node-0"


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
    first_worker = wait_for(lambda: (i := instance_of(cluster, name)) and i["worker_pid"], 30, "its worker")
    wait_for(lambda: name not in loaded_models(cluster), 30, f"{name} to scale to zero")
    # Its instance and KV cache are gone; its weights are still held, and counted.
    assert metric(cluster, ENGINE, "tessera_engine_pool_idle_bytes") >= weights
    used_resident = metric(cluster, MEMORY, "tessera_memory_used_bytes")
    assert used_resident >= weights

    hits = metric(cluster, ENGINE, "tessera_engine_pool_hits_total")
    stages = metric(cluster, LOADER, "tessera_loader_stages_total")
    ask(client, name)
    assert metric(cluster, ENGINE, "tessera_engine_pool_hits_total") == hits + 1
    # Nothing was loaded: the loader staged nothing, and the worker that kept the weights serves.
    assert metric(cluster, LOADER, "tessera_loader_stages_total") == stages
    assert wait_for(lambda: (i := instance_of(cluster, name)) and i["worker_pid"], 30, "its worker") == first_worker
    starts = wait_for(lambda: (s := cold_starts(cluster, name)) and len(s) >= 2 and s, 30, "two starts")
    newest, first = starts[0], starts[1]
    assert first["source"] == "store"
    assert newest["source"] == "resident"

    wait_for(lambda: name not in loaded_models(cluster), 30, f"{name} to scale to zero again")
    evicted = httpx.post(f"{cluster.base_url}/admin/cache/evict?tier=all", timeout=30).json()
    assert sum(e["freed_bytes"] for e in evicted) >= weights
    assert metric(cluster, ENGINE, "tessera_engine_pool_idle_bytes") == 0
    assert metric(cluster, MEMORY, "tessera_memory_used_bytes") <= used_resident - weights

    ask(client, name)  # from the model store on disk
    starts = wait_for(lambda: (s := cold_starts(cluster, name)) and len(s) >= 3 and s, 30, "a third start")
    assert starts[0]["source"] == "store"
    assert starts[0]["loaded_from_cache"] is True


def instance_of(cluster: LocalCluster, model: str) -> dict[str, object] | None:
    status = httpx.get(f"{cluster.base_url}/admin/instances", timeout=10).json()
    return next((i for n in status["nodes"] for i in n["instances"] if i["model"] == model), None)


def test_a_start_binds_a_prewarmed_worker_and_the_pool_refills(own_cluster: LocalCluster) -> None:
    cluster = own_cluster
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    wait_for(lambda: metric(cluster, ENGINE, "tessera_engine_prewarmed_workers") == 1, 60, "a warm worker")
    assert metric(cluster, ENGINE, "tessera_engine_prewarmed_rss_bytes") > 10 * 2**20  # runtime loaded
    unwarmed = metric(cluster, ENGINE, "tessera_engine_unwarmed_starts_total")
    httpx.post(f"{cluster.base_url}/admin/cache/evict?tier=all", timeout=30)

    register(cluster, "warm-bind")
    ask(client, "warm-bind")
    assert metric(cluster, ENGINE, "tessera_engine_unwarmed_starts_total") == unwarmed
    inst = wait_for(lambda: (i := instance_of(cluster, "warm-bind")) and i["worker_pid"] and i, 30, "its worker")
    engine_pid = cluster.procs[ENGINE].pid
    assert inst["worker_pid"] not in (0, engine_pid)
    # The pool refills in the background: a new worker, bound to nothing, is warm again.
    wait_for(lambda: metric(cluster, ENGINE, "tessera_engine_prewarmed_workers") == 1, 60, "the pool to refill")


def test_a_worker_killed_mid_stream_gives_an_openai_error_and_the_next_request_recovers(
    own_cluster: LocalCluster,
) -> None:
    import os
    import signal

    cluster = own_cluster
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    register(cluster, "worker-victim")
    ask(client, "worker-victim")
    # The scheduler learns the worker's pid from the engine's next heartbeat.
    pid = wait_for(
        lambda: int((instance_of(cluster, "worker-victim") or {}).get("worker_pid", 0)), 30, "the worker pid"
    )
    assert pid > 1 and pid != os.getpid()  # never signal a process group or ourselves
    stream = client.chat.completions.create(
        model="worker-victim",
        messages=[{"role": "user", "content": "Tell a long story."}],
        max_tokens=3000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    with pytest.raises(openai.APIError) as e:
        for i, _ in enumerate(stream):
            if i == 2:
                os.kill(pid, signal.SIGKILL)
    assert "died" in str(e.value.message)
    ask(client, "worker-victim")  # started again on a fresh worker
    assert int(instance_of(cluster, "worker-victim")["worker_pid"]) != pid  # type: ignore[index]


async def test_a_burst_of_first_requests_to_a_model_at_zero_triggers_one_start(own_cluster: LocalCluster) -> None:
    import asyncio

    cluster = own_cluster
    name = "burst16"
    await asyncio.to_thread(register, cluster, name, 1.0)
    await asyncio.to_thread(wait_for, lambda: name not in loaded_models(cluster), 30, "nothing loaded")
    aclient = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    replies = await asyncio.gather(
        *(
            aclient.chat.completions.create(model=name, messages=[{"role": "user", "content": f"Hi {i}"}], max_tokens=3)
            for i in range(16)
        )
    )
    assert len(replies) == 16 and all(r.choices[0].message.content is not None for r in replies)
    starts = await asyncio.to_thread(wait_for, lambda: cold_starts(cluster, name), 30, "the start record")
    assert len(starts) == 1


LOADER = "loader@node-0"


def test_host_cache_serves_starts_and_repairs_a_corrupted_block(own_cluster: LocalCluster) -> None:
    cluster = own_cluster
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    # Every name on this GGUF shares one worker: remove the other tests' names so that none
    # holds it, and the starts below really go through the caches.
    for m in httpx.get(f"{cluster.base_url}/admin/models", timeout=10).json():
        httpx.delete(f"{cluster.base_url}/admin/models/{m['name']}", timeout=10)
    wait_for(lambda: not loaded_models(cluster), 30, "every instance to stop")
    name = "cached-smollm"
    record = register(cluster, name, keep_alive_s=1.0)
    aid = record["artifact"]["artifact_id"]  # type: ignore[index]
    httpx.post(f"{cluster.base_url}/admin/cache/evict?tier=host", timeout=30)
    assert metric(cluster, LOADER, "tessera_loader_host_cache_bytes") == 0

    def restart_from(tier: str) -> dict[str, object]:
        """Scale the model to zero, drop caches down to `tier`, start it again; its record."""
        wait_for(lambda: name not in loaded_models(cluster), 30, f"{name} to scale to zero")
        before = len(cold_starts(cluster, name))
        httpx.post(f"{cluster.base_url}/admin/cache/evict?tier={tier}", timeout=30)
        ask(client, name)
        return wait_for(lambda: (s := cold_starts(cluster, name)) and len(s) > before and s[0], 30, "the start")

    ask(client, name)  # host cache empty: the start reads the store; the cache fills behind it
    wait_for(lambda: metric(cluster, LOADER, "tessera_loader_host_cache_bytes") > 0, 30, "the cache to fill")
    start = restart_from("resident")
    assert start["source"] == "host" and start["loaded_from_cache"] is True
    # The admin API (and `tessera status`) show what each node's host cache holds.
    (node0,) = [c for c in httpx.get(f"{cluster.base_url}/admin/cache", timeout=10).json() if c["node_id"] == "node-0"]
    (entry,) = [e for e in node0["entries"] if e["artifact_id"] == aid]
    assert entry["tier"] == "start" and entry["nbytes"] > 0 and node0["used_bytes"] >= entry["nbytes"]

    cached = next((cluster.host_cache / "node-0" / aid).rglob("*.blob"))  # type: ignore[operator]
    stored = next((Path(record["artifact"]["path"]) / "compiled").rglob(cached.name))  # type: ignore[index]
    data = bytearray(cached.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in one block
    cached.write_bytes(bytes(data))
    corrupt_before = metric(cluster, LOADER, "tessera_loader_corrupt_blocks_total")
    reimports_before = metric(cluster, ENGINE, "tessera_engine_reimports_total")
    start = restart_from("resident")
    assert start["source"] == "host"
    assert metric(cluster, LOADER, "tessera_loader_corrupt_blocks_total") == corrupt_before + 1
    assert cached.read_bytes() == stored.read_bytes()
    # The worker imported the copy while its blocks were checked: it imports it again, whole.
    assert metric(cluster, ENGINE, "tessera_engine_reimports_total") == reimports_before + 1

    start = restart_from("host")
    assert start["source"] == "store"


def test_a_start_serves_the_start_tier_then_tiers_up_with_the_same_output(own_cluster: LocalCluster) -> None:
    cluster = own_cluster
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    for m in httpx.get(f"{cluster.base_url}/admin/models", timeout=10).json():
        httpx.delete(f"{cluster.base_url}/admin/models/{m['name']}", timeout=10)
    wait_for(lambda: not loaded_models(cluster), 30, "every instance to stop")
    httpx.post(f"{cluster.base_url}/admin/cache/evict?tier=resident", timeout=30)
    name = "tiered-smollm"
    record = register(cluster, name, keep_alive_s=600.0)
    ups_before = metric(cluster, ENGINE, "tessera_engine_tier_ups_total", result="done")

    def tier_of_instance() -> str:
        nodes = httpx.get(f"{cluster.base_url}/admin/instances", timeout=10).json()["nodes"]
        return next((i["tier"] for n in nodes for i in n["instances"] if i["model"] == name), "")

    def first_token() -> tuple[str, float]:
        """The greedy first token and its log-probability (each tier computes its own)."""
        r = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Name three colours."}],
            max_tokens=1,
            temperature=0,
            logprobs=True,
        )
        (entry,) = r.choices[0].logprobs.content  # type: ignore[union-attr]
        return entry.token, entry.logprob

    on_start_tier = first_token()
    start = wait_for(lambda: (s := cold_starts(cluster, name)) and s[0], 30, "the cold start record")
    assert start["tier"] == "start"
    assert (Path(record["artifact"]["path"]) / "start" / "openvino_model.xml").is_file()  # type: ignore[index]
    # Idle: the worker loads the STEADY tier in the background and swaps to it.
    wait_for(lambda: tier_of_instance() == "steady", 60, "the worker to tier up")
    assert metric(cluster, ENGINE, "tessera_engine_tier_ups_total", result="done") == ups_before + 1
    # The node's heartbeat says how long the build took: placement prices a new instance's
    # build against its busy neighbours' TPOT (`policy.placement.CORE_BUILD_SLOWDOWN`).
    wait_for(
        lambda: all(
            n["core_build_s"] > 0 for n in httpx.get(f"{cluster.base_url}/admin/instances", timeout=10).json()["nodes"]
        ),
        10,
        "the heartbeat to carry the core build's seconds",
    )
    # Same weights, same values: the same next-token distribution on both tiers. Not the same
    # bits: the tiers' kernels differ (u8 and packed u4 weights, a stateful model and the paged
    # core), by how much depends on the CPU (bit for bit on one machine; on an AVX512_BF16
    # one, greedy text parted after ten tokens), so a near-tie may fall either way.
    token, logprob = first_token()
    assert logprob == pytest.approx(on_start_tier[1], abs=0.05), (on_start_tier, (token, logprob))
    assert len(cold_starts(cluster, name)) == 1  # the swap is not a start
