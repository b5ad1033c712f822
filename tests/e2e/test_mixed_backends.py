"""A cluster whose nodes run different engines (node-0 OpenVINO, node-1 torch), as a CPU+GPU
cluster does: a model registered by the OpenVINO node's loader has no torch checkpoint, and
its first start on the torch node has that node's loader write one before the worker binds
it; both nodes then serve the model."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

pytest.importorskip("torch", reason="the torch engine needs torch (the `test` extra installs it)")

from ops.localcluster import LocalCluster, default_model_path
from shared.artifact import has_torch_checkpoint, torch_checkpoint
from shared.messages import Artifact
from tests.conftest import running_cluster
from tests.helpers.cluster import engine_workers, nodes_running, register, wait_for

NAME = "mixed"


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    with running_cluster(
        tmp_path_factory.mktemp("mixed"),
        model_store,
        nodes=2,
        node_env={"node-1": {"TESSERA_ENGINE_BACKEND": "torch"}},
        timeout_s=180,
    ) as c:
        yield c


def test_a_model_registered_by_an_openvino_loader_starts_on_a_torch_node(mixed: LocalCluster, tmp_path: Path) -> None:
    # An artifact of its own (the default GGUF with bytes appended), so that no other test's
    # torch checkpoint of the default model is found in the shared store.
    source = tmp_path / "mixed.gguf"
    shutil.copyfile(default_model_path(), source)
    with source.open("ab") as f:
        f.write(b"tessera-mixed")
    artifact = msgspec.convert(register(mixed, NAME, source=str(source))["artifact"], Artifact)
    # Either loader may have taken the import; as the OpenVINO node's would, none is written.
    shutil.rmtree(torch_checkpoint(artifact), ignore_errors=True)
    assert not has_torch_checkpoint(artifact)

    scaled = httpx.post(f"{mixed.base_url}/admin/models/{NAME}/scale", json={"instances": 2}, timeout=30)
    assert scaled.status_code == 200 and sorted(scaled.json()["started"]) == ["node-0", "node-1"], scaled.text
    wait_for(lambda: nodes_running(mixed, NAME) == {"node-0", "node-1"}, 240, "the model on both nodes")
    assert has_torch_checkpoint(artifact), "the torch node's loader wrote the checkpoint"
    assert engine_workers(mixed, "libtorch", node="node-1"), "node-1 serves it with torch"
    assert not engine_workers(mixed, "libtorch", node="node-0"), "node-0 serves it with OpenVINO"
    for _ in range(2):
        r = httpx.post(
            f"{mixed.base_url}/v1/completions", json={"model": NAME, "prompt": "Hello", "max_tokens": 2}, timeout=60
        )
        assert r.status_code == 200, r.text
