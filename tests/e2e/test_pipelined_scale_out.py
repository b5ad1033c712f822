"""Three torch nodes: a model running on one is scaled out to the other two at once, its
torch checkpoint multicast to them from the node that holds it and from the store (two
sub-groups, FaaScale Algorithm 1). Before either new node holds the whole model, together they
hold every layer: each runs its layers as a stage and one serves the model through them
(§4.3, pipelined multicast inference), with the answer the whole model gives; once its own
replica is whole it switches to local execution and the pipeline's workers go.

Every uplink is shaped (`TESSERA_LINK_BPS`) so that the node-to-node half of the transfer
lasts seconds, as between hosts, not the loopback's memory copy."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

pytest.importorskip("torch", reason="the torch engine needs torch (the `test` extra installs it)")

from ops.localcluster import LocalCluster
from shared import subjects
from shared.bus import Bus, decode
from shared.messages import Failed, Finished, Generate, GenerateAccepted, StreamEvent, TokenChunk
from tests.conftest import running_cluster
from tests.helpers.bus_watch import Watch
from tests.helpers.cluster import cold_starts, metric, nodes_running, register, wait_for

NAME = "piped"
NODES = ("node-0", "node-1", "node-2")
LINK_BPS = 30e6
"""Each node's uplink: the 0.5 GB float32 checkpoint's half from the running node takes ≈ 9 s."""
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def torch_nodes(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    with running_cluster(
        tmp_path_factory.mktemp("pipelined"),
        model_store,
        nodes=len(NODES),
        timeout_s=240,
        TESSERA_ENGINE_BACKEND="torch",
        TESSERA_MULTICAST_SCALE_OUT="true",
        TESSERA_FILL_DELAY_S="0",
        TESSERA_LINK_BPS=str(LINK_BPS),
    ) as c:
        yield c


def on_engine(c: LocalCluster, node: str, like: Generate) -> tuple[str, Finished | Failed]:
    """`like` sent to one node's engine as the gateway sends it: the text streamed, and how it ended."""

    async def go() -> tuple[str, Finished | Failed]:
        bus = Bus("test-pipelined")
        await bus.connect(c.nats_url)
        try:
            rid = uuid.uuid4().hex
            stream = await bus.client.subscribe(subjects.token_stream(rid))
            req = msgspec.structs.replace(like, request_id=rid, stream_subject=subjects.token_stream(rid))
            accepted = await bus.request(subjects.engine_generate(node), req, GenerateAccepted | Failed, timeout=30)
            if isinstance(accepted, Failed):
                return "", accepted
            text = []
            while True:
                event = decode((await stream.next_msg(timeout=120)).data, StreamEvent)
                if isinstance(event, TokenChunk):
                    text.append(event.text)
                else:
                    return "".join(text), event
        finally:
            await bus.close()

    return asyncio.run(go())


def engines(c: LocalCluster, name: str) -> dict[str, float]:
    return {n: metric(c, f"engine@{n}", name) for n in NODES}


def test_new_nodes_serve_through_a_pipeline_before_their_replicas_are_whole(torch_nodes: LocalCluster) -> None:
    c = torch_nodes
    register(c, NAME, keep_alive_s=600.0)
    body = {"model": NAME, "messages": QUESTION, "max_tokens": 12, "temperature": 0, "repetition_penalty": 1.0}
    watch = Watch(c.nats_url)
    try:
        first = httpx.post(f"{c.base_url}/v1/chat/completions", json=body, timeout=300)
        (sent,) = [g for _, g in watch.generates if g.model == NAME]  # what the gateway sent
    finally:
        watch.close()
    assert first.status_code == 200, first.text
    expected = first.json()["choices"][0]["message"]["content"]
    (home,) = nodes_running(c, NAME)
    wait_for(
        lambda: metric(c, f"loader@{home}", "tessera_loader_host_cache_entries") >= 1,
        60,
        f"{home}'s loader to hold the torch checkpoint",
    )

    scaled = httpx.post(f"{c.base_url}/admin/models/{NAME}/scale", json={"instances": 3}, timeout=30)
    assert scaled.status_code == 200, scaled.text
    targets = set(NODES) - {home}
    head = wait_for(
        lambda: next((n for n, v in engines(c, "tessera_engine_pipelined_instances").items() if v >= 1), None),
        120,
        "a new node serving the model through a pipeline",
    )
    assert head in targets
    staging = [n for n, v in engines(c, "tessera_engine_stage_workers").items() if v >= 1]
    assert len(staging) >= 2, f"a pipeline of one node is no pipeline: {staging}"
    text, end = on_engine(c, head, sent)
    assert isinstance(end, Finished), end
    assert text == expected  # the stages together are the whole model

    # Mode switch: once the head's replica is whole its own instance serves, and the
    # pipeline's driver and stages stop.
    wait_for(
        lambda: (
            not any(engines(c, "tessera_engine_pipelined_instances").values())
            and not any(engines(c, "tessera_engine_stage_workers").values())
        ),
        180,
        "the pipeline to retire",
    )
    wait_for(lambda: nodes_running(c, NAME) == set(NODES), 120, "the model on every node")
    again, end = on_engine(c, head, sent)
    assert isinstance(end, Finished) and again == expected

    # The pipeline served before the head's replica was whole: its first token came before
    # the head's own start (which waited for every block) was ready.
    starts = wait_for(
        lambda: {s["source"]: s for s in cold_starts(c, NAME) if s["node_id"] == head} or None,
        30,
        "the head's cold starts",
    )
    assert {"pipeline", "host"} <= set(starts), starts
    piped, local = starts["pipeline"], starts["host"]
    served_at = float(piped["started_at"]) + float(piped["total_s"])  # type: ignore[arg-type]
    phases = local["phases"]
    assert isinstance(phases, dict)
    replica_at = float(local["started_at"]) + phases["init_s"] + phases["load_s"] + phases["profile_s"]  # type: ignore[arg-type]
    assert served_at < replica_at, (piped, local)
    assert metric(c, "scheduler", "tessera_scheduler_pipelines_total") >= 1
