"""Scale to zero and back: an idle instance is unloaded after its keep-alive, the next request
cold-starts it, every start records its phases, and a burst during a start shares that start."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai

from ops.localcluster import LocalCluster
from tests.helpers.cluster import cold_starts, loaded_models, metric, register, wait_for

PHASES = ("init_s", "load_s", "profile_s", "prefill_s")


def blob_files(record: dict[str, object]) -> dict[str, tuple[int, int]]:
    """The compiled blobs of a registration's artifact, with their sizes and mtimes."""
    compiled = Path(record["artifact"]["path"]) / "compiled"  # type: ignore[index]
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in compiled.rglob("*") if p.is_file()}


def ask(client: openai.OpenAI, model: str) -> str:
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    return r.choices[0].message.content or ""


def test_idle_model_is_unloaded_after_keep_alive_and_comes_back(cluster: LocalCluster, client: openai.OpenAI) -> None:
    name = "s2z-smollm"
    record = register(cluster, name, keep_alive_s=1.0)
    blobs = blob_files(record)
    assert blobs, "registration materializes the compiled model"
    loads_before = metric(cluster, "engine@node-0", "tessera_coldstart_phase_seconds_count", phase="load")

    assert ask(client, name)
    wait_for(lambda: name not in loaded_models(cluster), 30, f"{name} to scale to zero")
    assert ask(client, name)  # cold start from zero

    starts = wait_for(lambda: (s := cold_starts(cluster, name)) and len(s) >= 2 and s, 30, "two cold starts")
    assert len(starts) == 2
    for start in starts:
        phases = start["phases"]
        assert set(PHASES) <= set(phases)
        assert phases["load_s"] > 0 and phases["prefill_s"] > 0
        assert start["total_s"] >= sum(phases[p] for p in PHASES) * 0.99
    assert metric(cluster, "engine@node-0", "tessera_coldstart_phase_seconds_count", phase="load") == loads_before + 2
    # Materialized state was restored, not rebuilt: OpenVINO imported the blob, which no start
    # rewrote (MEDUSA: nothing a start derives is derived again). A start may add a file (the
    # loader writes a form's block set the first time a node asks for it), never change one.
    assert all(start["loaded_from_cache"] for start in starts)
    assert blobs.items() <= blob_files(record).items()
    log = (cluster.home / "logs" / "engine@node-0.log").read_text()
    logged = [json.loads(line) for line in log.splitlines() if line.startswith("{") and name in line]
    assert sum(1 for e in logged if e.get("message", "").startswith(f"cold start of {name}")) == 2


async def test_requests_arriving_during_a_cold_start_share_one_start(
    cluster: LocalCluster, aclient: openai.AsyncOpenAI
) -> None:
    name = "burst-smollm"
    await asyncio.to_thread(register, cluster, name)
    replies = await asyncio.gather(
        *(
            aclient.chat.completions.create(model=name, messages=[{"role": "user", "content": f"Hi {i}"}], max_tokens=4)
            for i in range(5)
        )
    )
    assert all(r.choices[0].message.content is not None for r in replies)
    starts = await asyncio.to_thread(wait_for, lambda: cold_starts(cluster, name), 30, "the cold start to be recorded")
    assert len(starts) == 1
