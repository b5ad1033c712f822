"""Batching through the whole cluster: concurrent requests share batches, a row that is
cancelled leaves the others whole, and an idle worker uses no CPU (the start tier's batch on
the model alone: tests/unit/test_start_batch.py)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import httpx
import openai

from ops.localcluster import LocalCluster
from tests.helpers.cluster import metric, register, wait_for

ENGINE = "engine@node-0"


async def test_concurrent_requests_share_batches_and_a_cancelled_row_leaves_the_rest_whole(
    own_cluster: LocalCluster,
) -> None:
    cluster = own_cluster
    name = "batched"
    await asyncio.to_thread(register, cluster, name)
    client = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    await client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    before = await asyncio.to_thread(metric, cluster, ENGINE, "tessera_engine_batched_requests_total")
    alone = await asyncio.to_thread(metric, cluster, ENGINE, "tessera_engine_batched_requests_total", batch="1")
    cancelled = await asyncio.to_thread(
        metric, cluster, ENGINE, "tessera_engine_requests_total", finish_reason="cancelled"
    )
    n = 24

    async def complete(i: int) -> int:
        r = await client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": f"Count to {i + 3}."}],
            max_tokens=n,
            extra_body={"ignore_eos": True},
        )
        assert r.usage is not None
        return r.usage.completion_tokens

    async def abandon() -> None:
        stream = await client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Tell a long story."}],
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break  # its first text, then the client goes away
        await stream.close()

    seen: list[dict] = []  # the instance as the scheduler sees it, while the requests run

    async def watch(until: asyncio.Future) -> None:
        async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as http:
            while not until.done():
                status = (await http.get("/admin/instances")).json()
                seen.extend(i for node in status["nodes"] for i in node["instances"] if i["model"] == name)
                await asyncio.sleep(0.05)  # sync-ok: sampling, not waiting for an event

    work = asyncio.ensure_future(asyncio.gather(*(complete(i) for i in range(6)), abandon()))
    await watch(work)
    results = await work
    assert results[:6] == [n] * 6
    # Heartbeats tell placement which requests run in the batch and the tokens their rows hold
    # (what a request joining the batch re-prefills): several rows, each past its prompt.
    assert max(i["running"] for i in seen) >= 2
    assert all(i["running"] <= i["active"] for i in seen)
    assert any(i["held_tokens"] > 10 * i["running"] > 0 for i in seen)
    after = await asyncio.to_thread(metric, cluster, ENGINE, "tessera_engine_batched_requests_total")
    alone_after = await asyncio.to_thread(metric, cluster, ENGINE, "tessera_engine_batched_requests_total", batch="1")
    assert after - before == 7
    assert alone_after - alone < 7, "no request shared a batch"
    # The abandoned stream's row was stopped, not run to its 200 tokens.
    await asyncio.to_thread(
        wait_for,
        lambda: metric(cluster, ENGINE, "tessera_engine_requests_total", finish_reason="cancelled") > cancelled,
        30,
        "the abandoned request to be cancelled in the engine",
    )


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_worker_waits_without_using_the_cpu(own_cluster: LocalCluster) -> None:
    """The worker blocks on its pipe between batches (a poll loop would burn a core)."""
    cluster = own_cluster
    register(cluster, "idle-worker")
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    client.chat.completions.create(model="idle-worker", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    # Idle also means its tier-up is done (it runs once the node is idle).
    wait_for(lambda: metric(cluster, ENGINE, "tessera_engine_bound_workers", tier="start") == 0, 60, "the tier-up")

    def worker_pid() -> int:
        """The worker's pid once a heartbeat has named it (0 until then)."""
        status = httpx.get(f"{cluster.base_url}/admin/instances", timeout=10).json()
        return next(
            (int(i["worker_pid"]) for n in status["nodes"] for i in n["instances"] if i["model"] == "idle-worker"), 0
        )

    pid = wait_for(worker_pid, 30, "a heartbeat naming the worker")
    before, t0 = cpu_s(pid), time.monotonic()
    time.sleep(1.0)  # sync-ok: a CPU measurement window, not a wait for anything
    used = cpu_s(pid) - before
    assert used < 0.3 * (time.monotonic() - t0), f"an idle worker used {used:.2f} s of CPU in a second"
