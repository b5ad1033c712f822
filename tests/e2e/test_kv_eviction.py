"""A node out of KV memory. Eviction on an underestimate (LLM-Mesh §6.4): requests outgrow what
their instance's cache was sized for (eq. 2 with a short mean output), the node cannot grow
it, and the request with the most headroom leaves the batch; the gateway resumes it on the
other node from the text it had streamed, so both clients get their whole completions. And a
request the node cannot hold at all, refused after waiting for room, goes to the other node."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from ops.localcluster import LocalCluster
from shared.messages import Artifact
from tests.conftest import running_cluster
from tests.helpers.cluster import metric, on_the_core, register

MIN_TOKENS = 24
TOKENS = 120
PROMPT = (
    "Describe, in the plainest words you can find, how a lighthouse keeper spends a long "
    "winter night on a rocky island far from the coast, what she sees, and what she hears."
)


@pytest.fixture(scope="module")
def tight_node(
    tmp_path_factory: pytest.TempPathFactory, model_store: Path, cluster: LocalCluster
) -> Iterator[LocalCluster]:
    # The session cluster has converted the default GGUF: its weights' size sets the budget.
    (meta,) = [p for p in model_store.glob("*/artifact.msgpack") if (p.parent / "compiled").is_dir()][:1]
    artifact = msgspec.msgpack.decode(meta.read_bytes(), type=Artifact)
    # node-0 holds the weights, the KV floor and 100 tokens more: two requests of ~45 prompt
    # tokens fit while they are short, not once both have generated a few dozen tokens.
    budget = artifact.weight_bytes + (MIN_TOKENS + 100) * artifact.kv_bytes_per_token
    # A request the node cannot hold waits 2 s for room (not the default 30 s) before its 503.
    with running_cluster(
        tmp_path_factory.mktemp("evict"),
        model_store,
        nodes=2,
        node_env={"node-0": {"TESSERA_MEMORY_BUDGET_BYTES": str(budget)}},
        TESSERA_KV_MIN_TOKENS=str(MIN_TOKENS),
        TESSERA_MEMORY_WAIT_S="2",
    ) as c:
        c.budget = budget  # type: ignore[attr-defined]
        register(c, "grow", keep_alive_s=600.0, ttft_slo_s=60.0, tpot_slo_s=5.0)
        yield c


def nodes_of(c: LocalCluster, model: str) -> set[str]:
    status = httpx.get(f"{c.base_url}/admin/instances", timeout=10).json()
    return {n["node_id"] for n in status["nodes"] if any(i["model"] == model for i in n["instances"])}


async def test_requests_outgrowing_an_unexpandable_cache_evict_the_one_with_most_headroom(
    tight_node: LocalCluster,
) -> None:
    c = tight_node
    client = openai.AsyncOpenAI(base_url=f"{c.base_url}/v1", api_key="unused", max_retries=0, timeout=180)

    async def ask(tokens: int) -> openai.types.Completion:
        return await client.completions.create(
            model="grow", prompt=PROMPT, max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True}
        )

    await ask(4)  # starts the instance (on node-0, the first node) and makes Ō = 4 tokens
    assert nodes_of(c, "grow") == {"node-0"}
    # Both requests must run side by side for their caches to outgrow the node together: on
    # the continuous-batching core they do (the start tier's batch may run them one after the
    # other, on a fast machine, and then nothing outgrows anything).
    await asyncio.to_thread(on_the_core, c, "grow")
    evicted = metric(c, "engine@node-0", "tessera_engine_kv_evictions_total")
    resumed = metric(c, "gateway", "tessera_gateway_resumed_total")
    first, second = await asyncio.gather(ask(TOKENS), ask(TOKENS))
    for r in (first, second):
        assert r.choices[0].finish_reason == "length"
        assert r.usage is not None and r.usage.completion_tokens == TOKENS
    assert metric(c, "engine@node-0", "tessera_engine_kv_evictions_total") == evicted + 1
    assert metric(c, "gateway", "tessera_gateway_resumed_total") == resumed + 1
    assert "node-1" in nodes_of(c, "grow")  # where the evicted request went on
    assert metric(c, "memory_manager@node-0", "tessera_memory_denied_total") >= 1


async def test_a_request_the_node_cannot_hold_is_refused_there_and_served_by_the_other(
    tight_node: LocalCluster,
) -> None:
    c = tight_node
    client = openai.AsyncOpenAI(base_url=f"{c.base_url}/v1", api_key="unused", max_retries=0, timeout=180)
    refused = metric(c, "engine@node-0", "tessera_engine_requests_total", finish_reason="error")
    resumed = metric(c, "gateway", "tessera_gateway_resumed_total")
    # ~600 prompt tokens: past the 124 tokens of KV node-0 has room for, whatever it reserved.
    r = await client.completions.create(
        model="grow", prompt="lighthouse keeper " * 200, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None and r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 400
    assert metric(c, "engine@node-0", "tessera_engine_requests_total", finish_reason="error") == refused + 1
    assert metric(c, "gateway", "tessera_gateway_resumed_total") == resumed + 1
    assert metric(c, "memory_manager@node-0", "tessera_memory_used_bytes") <= c.budget  # type: ignore[attr-defined]
