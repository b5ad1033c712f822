"""Session fixtures: one real local cluster (NATS, Valkey, every service, the real model)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from ops.localcluster import DEFAULT_MODEL_NAME, SERVICES, LocalCluster, default_model_path
from tests.helpers.checkpoints import export_ir, make_tiny_checkpoint
from tests.helpers.cluster import on_the_core
from tests.helpers.torch_threads import one_torch_thread

# The suite calls the API as any OpenAI client would, with api_key="unused": clusters run with
# auth off unless a test asks for it (tests/e2e/test_auth.py). The environment default also
# covers gateways built in-process and `tessera up` run as a subprocess.
os.environ.setdefault("TESSERA_AUTH", "off")

# Short timings so that tests of keep-alive and engine death finish quickly; the values are
# settings, not sleeps: tests wait on conditions with deadlines.
TEST_ENV = {
    "TESSERA_KEEP_ALIVE_CHECK_S": "0.1",
    "TESSERA_HEARTBEAT_INTERVAL_S": "0.2",
    "TESSERA_NODE_TIMEOUT_S": "2.0",
    "TESSERA_MAX_INFLIGHT": "6",
    "TESSERA_MAX_WAITING": "1",
    "TESSERA_LOG_LEVEL": "INFO",
    # Two idle 135M models resident per node, as before the product's default grew: the suite's
    # clusters share one machine's memory.
    "TESSERA_POOL_BUDGET_BYTES": str(2 * 1024**3),
}


@pytest.fixture(scope="session")
def model_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model store for every cluster of the session: the GGUF is converted once."""
    return tmp_path_factory.mktemp("store")


def start_cluster(
    home: Path,
    store: Path,
    auth: bool = False,
    *,
    nodes: int = 1,
    node_env: Mapping[str, Mapping[str, str]] | None = None,
    services: tuple[str, ...] = SERVICES,
    timeout_s: float = 90,
    **env: str,
) -> LocalCluster:
    """A started cluster with the suite's short timings (`TEST_ENV`) and `env` over them for
    every service; `node_env`: settings of one node's services (`node-0`, …)."""
    cluster = LocalCluster(
        home=home,
        env={**TEST_ENV, **env},
        store=store,
        auth=auth,
        nodes=nodes,
        node_env=node_env or {},
        services=services,
    )
    cluster.start(timeout_s=timeout_s)
    return cluster


@contextmanager
def running_cluster(home: Path, store: Path, **kwargs: Any) -> Iterator[LocalCluster]:
    """`start_cluster`'s cluster, stopped on the way out."""
    cluster = start_cluster(home, store, **kwargs)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    c = start_cluster(tmp_path_factory.mktemp("cluster"), model_store)
    try:
        c.register_default_model()
        # The default model served by its continuous-batching core, whichever test comes first:
        # a start's first tokens come from the start tier, whose greedy text may differ, and
        # tests compare greedy answers across requests (the suite runs modules in any order).
        on_the_core(c, DEFAULT_MODEL_NAME)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    """A cluster for one test module alone: for tests that restart or kill its processes, or
    that need a node where nothing else is loaded."""
    # Room for a burst of 16 concurrent first requests.
    c = start_cluster(tmp_path_factory.mktemp("own"), model_store, TESSERA_MAX_INFLIGHT="32")
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def auth_cluster(tmp_path_factory: pytest.TempPathFactory, model_store: Path) -> Iterator[LocalCluster]:
    """A cluster of one test module with API keys on and the default model registered."""
    c = start_cluster(tmp_path_factory.mktemp("auth"), model_store, auth=True)
    try:
        c.register_default_model()
        yield c
    finally:
        c.stop()


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """`build(dest)` run once for the whole run at `dest` (named `name`), and `dest`: the suite's
    workers (pytest-xdist) share it, the first building it while the others wait on its lock.
    For inputs that take seconds of both cores to make and that tests only read."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    # Under pytest-xdist each worker's base is a folder of the run's own: its parent is shared.
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    dest = shared / name
    done = shared / f"{name}.done"
    with FileLock(f"{dest}.lock"):
        if not done.is_file():
            shutil.rmtree(dest, ignore_errors=True)  # a worker that failed half-way
            build(dest)
            done.touch()
    return dest


@pytest.fixture(scope="session")
def torch_checkpoint_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's GGUF materialized into a float32 torch checkpoint (the host's dtype),
    for the tests that run the torch engine without a cluster (≈ 20 s of both cores a copy)."""
    import torch

    from services.loader.torch_checkpoint import materialize

    return built_once(
        tmp_path_factory, "default-torch-f32", lambda dest: materialize(default_model_path(), dest, torch.float32)
    )


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tests/helpers/checkpoints.py`'s tiny Hugging Face checkpoint (seeded: the same weights
    wherever it is made)."""
    return built_once(tmp_path_factory, "tiny-checkpoint", make_tiny_checkpoint)


@pytest.fixture(scope="session")
def tiny_ir_int8(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    """The tiny checkpoint exported by the loader's exporter at int8."""
    return built_once(tmp_path_factory, "tiny-ir-int8", lambda dest: export_ir(tiny_checkpoint, dest, "int8"))


@pytest.fixture(scope="module")
def torch_on_one_thread() -> Iterator[None]:
    """For a module that runs a torch model in the test process (`tests/helpers/torch_threads.py`
    says why): `pytestmark = pytest.mark.usefixtures("torch_on_one_thread")`."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def model() -> str:
    return DEFAULT_MODEL_NAME


@pytest.fixture(scope="session")
def client(cluster: LocalCluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def aclient(cluster: LocalCluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
