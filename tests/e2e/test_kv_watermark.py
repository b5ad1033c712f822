"""KV reservations follow the requests running (LLM-Mesh §6.2): with a small L_min, concurrent
requests grow their instance's reservation through the node's reservation station (resize
instructions), and once they have left it shrinks back, lazily, by the watermark rule."""

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
from tests.helpers.cluster import metric, register, wait_for

ENGINE, MEMORY = "engine@node-0", "memory_manager@node-0"
MIN_TOKENS = 24
PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle on a "
    "stormy night, and tell what the message says and what she does next."
)


def per_token() -> int:
    facts = gguf_facts(default_model_path())
    return kv_bytes_per_token(int(facts["layers"]), int(facts["kv_heads"]), int(facts["head_dim"]))


@pytest.fixture(scope="module")
def small_floor(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("kv"), model_store, TESSERA_KV_MIN_TOKENS=str(MIN_TOKENS))
    try:
        register(c, "kvw", keep_alive_s=600.0)
        yield c
    finally:
        c.stop()


async def test_concurrent_requests_grow_the_kv_reservation_and_it_shrinks_after(small_floor: LocalCluster) -> None:
    client = openai.AsyncOpenAI(base_url=f"{small_floor.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    c = per_token()

    async def ask() -> openai.types.Completion:
        return await client.completions.create(
            model="kvw", prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True}
        )

    await ask()  # starts the instance at the floor
    assert metric(small_floor, ENGINE, "tessera_engine_kv_reserved_bytes", model="kvw") >= c * MIN_TOKENS
    before = metric(small_floor, MEMORY, "tessera_memory_operations_total", kind="resize")
    results = await asyncio.gather(*(ask() for _ in range(4)))
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12 for r in results)
    prompt_tokens = results[0].usage.prompt_tokens
    assert prompt_tokens > MIN_TOKENS  # so that eq. 2 is over the floor as soon as one runs

    assert metric(small_floor, ENGINE, "tessera_engine_kv_resizes_total", direction="grow") >= 1
    # Every resize went through the node's reservation station, and none was over budget.
    assert metric(small_floor, MEMORY, "tessera_memory_operations_total", kind="resize") > before
    assert metric(small_floor, MEMORY, "tessera_memory_denied_total") == 0
    # All have left: Ō = 12, nothing runs; the reservation goes back near the floor (it
    # shrinks after the last one's stream ended, so look until it has).
    # The first request's own shrink counts too, so wait for the band itself: each request's
    # shrink runs after its `Finished` is published, so the client can read the gauge first.
    reserved = wait_for(
        lambda: (
            r
            if c * MIN_TOKENS
            <= (r := metric(small_floor, ENGINE, "tessera_engine_kv_reserved_bytes", model="kvw"))
            <= c * MIN_TOKENS * 1.2 + c
            else None
        ),
        10,
        "the reservation to shrink back near the floor",
    )
    assert metric(small_floor, ENGINE, "tessera_engine_kv_resizes_total", direction="shrink") >= 1
    used = metric(small_floor, MEMORY, "tessera_memory_used_bytes")
    assert used >= reserved
