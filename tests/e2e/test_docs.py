"""The docs cannot drift from the code: every shell block marked `runnable` (a fence opened
with ```` ```sh runnable ````) in the README and in `docs/` runs here, in order, file by file,
against a live cluster with keys on, in the environment the README tells a reader to set
(`TESSERA_URL`, `TESSERA_ADMIN_KEY`) and the files the docs name (`GGUF`: the default model's
file; `CHECKPOINT`: a Hugging Face checkpoint; `ADAPTER`: a PEFT LoRA adapter made on it). A
block passes when bash runs it to the end with `-euo pipefail`; the docs' curl lines carry
`-f`, so an HTTP error fails the block as a shell error does."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops.localcluster import LocalCluster, default_model_path
from tests.conftest import built_once, start_cluster
from tests.helpers.adapters import make_adapter

REPO = Path(__file__).resolve().parents[2]
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
RUNNABLE = re.compile(r"^```sh runnable\n(.*?)^```$", re.M | re.S)


def runnable_blocks(path: Path) -> list[str]:
    return RUNNABLE.findall(path.read_text())


def test_the_docs_mark_their_commands_runnable() -> None:
    """The README and each reader's doc that shows commands has blocks this suite runs (a
    renamed fence would silently run nothing)."""
    marked = {p.name for p in DOCS if runnable_blocks(p)}
    assert {"README.md", "api.md", "models.md", "operating.md"} <= marked


@pytest.fixture(scope="module")
def docs_cluster(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("docs-cluster"), model_store, auth=True)
    try:
        c.register_default_model()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    return built_once(tmp_path_factory, "docs-adapter", lambda dest: make_adapter(tiny_checkpoint, dest, seed=5))


@pytest.mark.parametrize("doc", [p for p in DOCS if runnable_blocks(p)], ids=lambda p: p.name)
def test_every_runnable_block_of_a_doc_runs(
    doc: Path, docs_cluster: LocalCluster, tiny_checkpoint: Path, adapter: Path
) -> None:
    assert docs_cluster.admin_key is not None
    env = {
        **os.environ,
        "TESSERA_URL": docs_cluster.base_url,
        "TESSERA_ADMIN_KEY": docs_cluster.admin_key,
        "GGUF": str(default_model_path()),
        "CHECKPOINT": str(tiny_checkpoint),
        "ADAPTER": str(adapter),
    }
    for i, block in enumerate(runnable_blocks(doc)):
        run = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, (
            f"{doc.name} block {i + 1} failed ({run.returncode}):\n{block}\n{run.stderr[-3000:]}"
        )
