"""Instances on one node take turns by headroom (LLM-Mesh §5.1, services/engine/step_gate.py):
while a model with a tight SLO decodes, a model with a lax one waits for its iterations, and
only runs once the urgent batch is done (its own deadline is far off). Left to the OS, the two
would decode side by side."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from ops.localcluster import LocalCluster, default_model_path
from tests.conftest import start_cluster
from tests.helpers.cluster import metric

ENGINE = "engine@node-0"


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    home = tmp_path_factory.mktemp("interleave")
    # A second artifact (another worker on the node): the GGUF with bytes appended.
    copy = home / "lax.gguf"
    shutil.copyfile(default_model_path(), copy)
    with copy.open("ab") as f:
        f.write(b"\x00tessera-test-lax")
    # One iteration at a time on any machine: the gate runs cpu_quota // inference_threads
    # iterations at once, so a node of 2 cores at 2 threads each has one turn to share (on
    # 4 or more cores the two would otherwise decode side by side and never wait).
    c = start_cluster(home, model_store, TESSERA_INFERENCE_THREADS="2", TESSERA_CPU_QUOTA="2")
    try:
        for name, source, ttft, tpot in (("urgent", default_model_path(), 1.0, 0.05), ("lax", copy, 60.0, 1.0)):
            r = httpx.post(
                f"{c.base_url}/admin/models",
                timeout=600,
                json={
                    "name": name,
                    "source": str(source),
                    "keep_alive_s": 600.0,
                    "ttft_slo_s": ttft,
                    "tpot_slo_s": tpot,
                },
            )
            assert r.status_code == 201, r.text
        yield c
    finally:
        c.stop()


async def test_the_lax_model_waits_for_the_urgent_models_iterations(two_models: LocalCluster) -> None:
    client = openai.AsyncOpenAI(base_url=f"{two_models.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    for name in ("urgent", "lax"):  # both started and warm
        await client.completions.create(model=name, prompt="Hello", max_tokens=2)
    waits_before = metric(two_models, ENGINE, "tessera_engine_gate_wait_seconds_sum")
    urgent_started = asyncio.Event()
    times: dict[str, list[float]] = {"urgent": [], "lax": []}

    async def stream(name: str, max_tokens: int) -> None:
        s = await client.completions.create(
            model=name,
            prompt="Tell me about the sea.",
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in s:
            if chunk.choices and chunk.choices[0].text:
                times[name].append(time.monotonic())
                urgent_started.set()

    async def lax_once_urgent_decodes() -> None:
        await urgent_started.wait()
        await stream("lax", 4)

    await asyncio.gather(stream("urgent", 48), lax_once_urgent_decodes())
    assert times["urgent"] and times["lax"]
    # The lax model's prefill waited at the gate until the urgent batch ended.
    assert times["lax"][0] > times["urgent"][-1], (
        f"lax first token {times['lax'][0] - times['urgent'][0]:.3f}s after urgent's first, "
        f"urgent's last at {times['urgent'][-1] - times['urgent'][0]:.3f}s"
    )
    assert metric(two_models, ENGINE, "tessera_engine_gate_wait_seconds_sum") > waits_before
