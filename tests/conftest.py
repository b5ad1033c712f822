"""Session fixtures: one real local cluster (NATS, Valkey, every service, the real model)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
import pytest

from ops.localcluster import DEFAULT_MODEL_NAME, SERVICES, LocalCluster, default_model_path
from shared.artifact import TORCH_MANIFEST
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


@pytest.fixture(scope="session")
def torch_checkpoint_f32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's GGUF materialized once into a float32 torch checkpoint (the host's
    dtype), for the tests that run the torch engine without a cluster. Writing one takes about
    20 s of both cores, so the suite's workers share it: the first writes it (renamed into place
    whole), the others wait on the lock and read it. Tests only read it."""
    import torch
    from filelock import FileLock

    from services.loader.torch_checkpoint import materialize_into

    base = tmp_path_factory.getbasetemp()
    # Under pytest-xdist each worker's base is a folder of the run's own: its parent is shared.
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    dest = shared / "default-torch-f32"
    with FileLock(f"{dest}.lock"):
        if not (dest / TORCH_MANIFEST).is_file():
            materialize_into(default_model_path(), dest, torch.float32)
    return dest


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
