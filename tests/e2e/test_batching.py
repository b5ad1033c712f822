"""Batching (services/engine/batch.py) on the real model: padded rows decode as they would
alone, concurrent requests share batches, and a row that ends or is cancelled leaves the
others whole."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import msgspec
import openai
import openvino as ov
import pytest

from ops.localcluster import LocalCluster
from services.engine.batch import BatchItem, generate_batch
from services.engine.instance import LoadedModel
from services.engine.stops import StopMatcher
from shared.messages import Artifact, SamplingParams
from tests.helpers.cluster import metric, register, wait_for

ENGINE = "engine@node-0"


class TokenSink:
    """Collects a row's token ids (instead of text)."""

    def __init__(self, out: list[int]) -> None:
        self.out = out

    def write(self, tokens: Sequence[int]) -> None:
        self.out.extend(tokens)

    def end(self) -> None:
        pass


@pytest.fixture(scope="module")
def loaded(cluster: LocalCluster, model_store: Path) -> LoadedModel:
    """The default model as registered (the session cluster registered it), loaded here."""
    (meta,) = [p for p in model_store.glob("*/artifact.msgpack") if (p.parent / "compiled").is_dir()][:1]
    artifact = msgspec.structs.replace(msgspec.msgpack.decode(meta.read_bytes(), type=Artifact), path=str(meta.parent))
    return LoadedModel.load(ov.Core(), artifact, "CPU", 2)


def item(i: int, prompt: list[int], max_tokens: int) -> BatchItem:
    return BatchItem(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def tokens_of(
    loaded: LoadedModel,
    prompts: list[list[int]],
    max_tokens: list[int],
    join_at: dict[int, list[BatchItem]] | None = None,
) -> dict[str, list[int]]:
    """Each row's tokens; `join_at`: after that many decode steps, these requests join."""
    items = [item(i, p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))]
    late = [it for its in (join_at or {}).values() for it in its]
    out: dict[str, list[int]] = {it.request_id: [] for it in [*items, *late]}
    steps = [0]

    def sink(emit: object, request_id: str, stops: StopMatcher) -> TokenSink:
        return TokenSink(out[request_id])

    def join(rows: object) -> list[BatchItem]:
        steps[0] += 1
        return (join_at or {}).get(steps[0], [])

    results = generate_batch(
        lambda rows: loaded.compiled.create_infer_request(),
        items,
        loaded.eos_ids,
        sink,
        lambda *a: None,
        lambda rid: False,
        join=join,
    )
    assert [r.completion_tokens for r in results] == [*max_tokens, *(it.params.max_tokens for it in late)]
    return out


def test_padded_rows_decode_as_they_would_alone(loaded: LoadedModel) -> None:
    # Prompts of different lengths: the shorter ones are left-padded. A wrong mask or position
    # would change their tokens from the first one on.
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 11173, 30], [1, 4093, 1115, 2], list(range(100, 140))]
    max_tokens = [8, 3, 8]  # the middle row leaves the batch early
    alone: dict[str, list[int]] = {}
    for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
        alone[f"r{i}"] = tokens_of(loaded, [p], [m])["r0"]
    together = tokens_of(loaded, prompts, max_tokens)
    assert together == alone
    # Joining a running batch re-prefills its rows with their output so far: the running rows
    # go on with the tokens they would have had, the newcomers get theirs.
    joined = tokens_of(
        loaded,
        prompts[:1],
        max_tokens[:1],
        join_at={2: [item(1, prompts[1], max_tokens[1])], 4: [item(2, prompts[2], max_tokens[2])]},
    )
    assert joined == alone


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
