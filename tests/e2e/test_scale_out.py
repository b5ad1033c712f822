"""Two nodes: the engines report measurements, the scheduler fits a performance model, and
when a request would miss its TTFT SLO queued behind the running instance (shadow
validation), the model scales out to the other node. Every request completes. The SLO is
derived from the measured first token, so that the queue misses it on any machine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from ops.localcluster import LocalCluster
from tests.conftest import running_cluster
from tests.helpers.cluster import metric, nodes_running, on_the_core, register, wait_for

NAME = "tight-ttft"
NODE1_BUDGET = 3 * 1024**3


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    # node-1 is its own share of the machine: one core, a smaller memory budget.
    # A scale-out fetches the blob from node-0's loader (FaaScale's multicast), which caches
    # it as soon as node-0's start is done.
    with running_cluster(
        tmp_path_factory.mktemp("two"),
        model_store,
        nodes=2,
        node_env={"node-1": {"TESSERA_CPU_CORES": "1", "TESSERA_MEMORY_BUDGET_BYTES": str(NODE1_BUDGET)}},
        timeout_s=120,
        TESSERA_MAX_INFLIGHT="16",
        TESSERA_MULTICAST_SCALE_OUT="true",
        TESSERA_FILL_DELAY_S="0",
    ) as c:
        register(c, NAME, keep_alive_s=600.0, ttft_slo_s=60.0, tpot_slo_s=1.0)
        yield c


# About a thousand tokens: a prefill that dominates a request's first token on any machine.
LONG_PROMPT = "Write a story about a cat. " * 150


async def test_a_queue_that_would_miss_the_ttft_slo_scales_out_to_the_other_node(two_nodes: LocalCluster) -> None:
    cluster = two_nodes
    client = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def ask(tokens: int) -> str:
        r = await client.completions.create(
            model=NAME, prompt=LONG_PROMPT, max_tokens=tokens, extra_body={"ignore_eos": True}
        )
        return r.choices[0].finish_reason

    async def ttft() -> float:
        t0 = time.perf_counter()
        stream = await client.completions.create(
            model=NAME, prompt=LONG_PROMPT, max_tokens=2, stream=True, extra_body={"ignore_eos": True}
        )
        first = None
        async for chunk in stream:
            # The first chunk, text or not: a sampled token may have none (an end-of-text token
            # under ignore_eos is skipped from the text), and CI once saw both of two so.
            if first is None and chunk.choices:
                first = time.perf_counter() - t0
        assert first is not None
        return first

    # Measurements on the continuous-batching core: the engine reports prefill and decode
    # times with its heartbeat.
    await asyncio.to_thread(on_the_core, cluster, NAME)
    for _ in range(2):
        assert await ask(4) == "length"
    assert len(nodes_running(cluster, NAME)) == 1
    wait_for(
        lambda: metric(cluster, "scheduler", "tessera_scheduler_profiled_models") >= 1,
        10,
        "the scheduler to fit a performance model",
    )
    # The SLO from this machine's own speed: one such prompt's first token comes well within
    # it, a queue of six prefilled one after another does not (the condition the test needs,
    # whatever the machine). Fixed, not grown with the prompt (≈ 2 s at its ≈ 1,000 tokens by
    # the default allowance): the test sets it from what it measured.
    slo = 2.5 * min([await ttft() for _ in range(2)])
    register(cluster, NAME, keep_alive_s=600.0, replace=True, ttft_slo_s=slo, ttft_slo_per_token_s=0.0, tpot_slo_s=1.0)
    before = metric(cluster, "scheduler", "tessera_scheduler_scale_outs_total")
    wait_for(
        lambda: metric(cluster, "loader@node-0", "tessera_loader_host_cache_entries") >= 1,
        30,
        "node-0's loader to hold the blob in host memory",
    )
    results = await asyncio.gather(*(ask(8) for _ in range(6)))
    assert results == ["length"] * 6
    assert metric(cluster, "scheduler", "tessera_scheduler_scale_outs_total") >= before + 1
    # A scale-out for the requests after these may still be starting when they are answered.
    wait_for(lambda: nodes_running(cluster, NAME) == {"node-0", "node-1"}, 60, "the instance on node-1")
    # node-1's loader received the blob from node-0's over TCP, every block checked, not from
    # the store; the start staged that copy.
    assert metric(cluster, "loader@node-1", "tessera_loader_multicast_blocks_total", source="planned") > 0
    assert metric(cluster, "loader@node-0", "tessera_loader_served_blocks_total") > 0
    # Each node has its own memory budget and cores; node-1's worker runs on its one core.
    assert metric(cluster, "memory_manager@node-1", "tessera_memory_budget_bytes") == NODE1_BUDGET
    assert metric(cluster, "memory_manager@node-0", "tessera_memory_budget_bytes") != NODE1_BUDGET

    def node1_pid() -> int:
        status = httpx.get(f"{cluster.base_url}/admin/instances", timeout=10).json()
        (pid,) = [i["worker_pid"] for n in status["nodes"] if n["node_id"] == "node-1" for i in n["instances"]]
        return int(pid)  # 0 until a heartbeat after its start names the worker

    pid = wait_for(node1_pid, 10, "node-1's heartbeat to name its worker")
    allowed = next(
        line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Cpus_allowed_list")
    )
    assert allowed.split()[-1] == "1"
