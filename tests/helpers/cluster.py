"""Helpers for tests against the real local cluster: metrics, waits with deadlines."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ops.localcluster import LocalCluster

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T | None],
    timeout_s: float,
    what: str,
    every_s: float = 0.1,
    detail: Callable[[], object] | None = None,
) -> T:
    """Poll `condition` until it returns something truthy; fail with `what` (and what `detail`
    says it last saw) at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            seen = f"; last seen: {detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}{seen}")
        time.sleep(every_s)  # sync-ok: polling a condition with a deadline


def metric(cluster: LocalCluster, process: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` (with these labels) on one process's /metrics."""
    port = cluster.procs[process].http_port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def loaded_models(cluster: LocalCluster) -> set[str]:
    status = httpx.get(f"{cluster.base_url}/admin/instances", timeout=10).json()
    return {i["model"] for n in status["nodes"] for i in n["instances"]}


def cold_starts(cluster: LocalCluster, model: str) -> list[dict[str, object]]:
    starts = httpx.get(f"{cluster.base_url}/admin/coldstarts?limit=200", timeout=10).json()
    return [s for s in starts if s["model"] == model]


def register(
    cluster: LocalCluster,
    name: str,
    keep_alive_s: float = 300.0,
    source: str | None = None,
    replace: bool = False,
    weight_format: str | None = None,
    **slo: float,
) -> dict[str, object]:
    """Register `name` (the default model unless `source`, a GGUF or a model directory;
    `replace`: over a registration of the same name; `weight_format`: a checkpoint's); `slo`:
    ttft_slo_s, ttft_slo_per_token_s, tpot_slo_s."""
    from ops.localcluster import default_model_path

    def post() -> httpx.Response | None:
        r = httpx.post(
            f"{cluster.base_url}/admin/models",
            json={
                "name": name,
                "source": source or str(default_model_path()),
                "keep_alive_s": keep_alive_s,
                "replace": replace,
                **({"weight_format": weight_format} if weight_format else {}),
                **slo,
            },
            timeout=600,
        )
        # A loader that has not subscribed yet answers 503 (no responders): ask again.
        return None if r.status_code == 503 else r

    r = wait_for(post, 30, "the loader to take the registration", every_s=0.5)
    assert r.status_code == 201, r.text
    return dict(r.json())


def on_the_core(cluster: LocalCluster, model: str, timeout_s: float = 120.0) -> None:
    """Start `model` (its first requests run on the start tier) and wait until its
    continuous-batching core serves it: greedy text is the core's from then on."""
    r = httpx.post(
        f"{cluster.base_url}/v1/chat/completions",
        headers=cluster.admin_headers,
        timeout=300,
        json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200, r.text

    def steady() -> bool:
        status = httpx.get(f"{cluster.base_url}/admin/instances", headers=cluster.admin_headers, timeout=10).json()
        return any(i["model"] == model and i["tier"] == "steady" for n in status["nodes"] for i in n["instances"])

    wait_for(steady, timeout_s, f"the continuous-batching core to serve {model}")


def engine_workers(cluster: LocalCluster, library: str, node: str = "node-0") -> list[int]:
    """The node's engine's child processes that map `library` (a file name's part: "libtorch",
    "vllm"): which runtime its workers run."""
    engine = cluster.procs[f"engine@{node}"].pid
    children = [
        int(pid) for task in Path(f"/proc/{engine}/task").iterdir() for pid in (task / "children").read_text().split()
    ]
    found = []
    for pid in children:
        try:
            if library in Path(f"/proc/{pid}/maps").read_text():
                found.append(pid)
        except OSError:
            continue  # ended meanwhile
    return found


def nodes_running(cluster: LocalCluster, model: str) -> set[str]:
    """The nodes with an instance of `model`, as the scheduler sees them."""
    status = httpx.get(f"{cluster.base_url}/admin/instances", timeout=10).json()
    return {n["node_id"] for n in status["nodes"] for i in n["instances"] if i["model"] == model}
