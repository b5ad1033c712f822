"""`TESSERA_START_CPU_SHARE` on the real engine: a start beside an instance that is decoding
loads on a share of the node's cores (TIDAL §5: the pre-warm off the busy instances' path),
and a start on an idle node on all of them. The share is the runtime's thread count (the CPU
plugin sets its own threads' affinity); the worker reads it back from the compiled model, and
the start's record carries it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from ops.localcluster import LocalCluster, default_model_path
from tests.conftest import start_cluster
from tests.helpers.background_client import complete_in_background
from tests.helpers.cluster import cold_starts, register, wait_for

SHARE = 0.5
ENGINE = "engine@node-0"


@pytest.fixture(scope="module")
def shared_node(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("share"), model_store, TESSERA_START_CPU_SHARE=str(SHARE))
    try:
        yield c
    finally:
        c.stop()


def node_cores(cluster: LocalCluster) -> int:
    return len(os.sched_getaffinity(cluster.procs[ENGINE].pid))


def test_a_start_beside_a_busy_instance_loads_on_its_share_of_the_cores(
    shared_node: LocalCluster, tmp_path: Path
) -> None:
    cluster = shared_node
    cores = node_cores(cluster)
    if cores < 2:
        pytest.skip("the engine runs on one core: a share of it is all of it")
    # A second artifact (the same weights, other bytes): its start loads a worker of its own.
    other = tmp_path / "other.gguf"
    shutil.copyfile(default_model_path(), other)
    with other.open("ab") as f:
        f.write(b"\x00tessera-test-share")
    register(cluster, "busy")
    register(cluster, "beside", source=str(other))
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=300)

    # The first start, on an idle node, has every core.
    client.completions.create(model="busy", prompt="Hello", max_tokens=1)
    (first,) = wait_for(lambda: cold_starts(cluster, "busy"), 30, "the first start's record")
    every = first["load_threads"]
    assert isinstance(every, int) and 1 <= every <= cores
    if every < 2:
        pytest.skip("the engine gives a start one thread: a share of it is all of it")

    # A long stream keeps "busy" decoding while "beside" starts.
    streaming = complete_in_background(
        client, stream=True, model="busy", prompt="Count: 1, 2, 3,", max_tokens=4000, extra_body={"ignore_eos": True}
    )
    try:
        wait_for(lambda: streaming.text or streaming.done.is_set(), 120, "the stream's first text")
        assert not streaming.done.is_set(), streaming
        client.completions.create(model="beside", prompt="Hello", max_tokens=1)
        (beside,) = wait_for(lambda: cold_starts(cluster, "beside"), 30, "the second start's record")
        assert not streaming.done.is_set(), "the stream ended before the start: nothing was busy"
    finally:
        streaming.stop.set()
    streaming.ended(120)
    assert beside["source"] != "resident"
    assert beside["load_threads"] == min(every, max(1, int(cores * SHARE)))
