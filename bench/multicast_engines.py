"""The engine half of `bench/multicast.py`: first tokens after a scale-out.

- `first_tokens`: every target's engine starts the model as the scheduler has it start in a
  scale-out (its stage waits for the multicast's blocks), then serves one token; the seconds
  from the multicast's order to each node's first token.
- `pipelined`: FaaScale §4.3 through the whole stack: a cluster of torch nodes in network
  namespaces, a model running on node-0 scaled out to the eight others by the scheduler
  (`POST /admin/models/NAME/scale`). The targets receive the torch checkpoint from node-0 and
  from the store (served over a shaped link like every node's, `StoreServer`); once together
  they hold every layer, some run stages and one serves the model through them. Measured:
  when that node served its first token, against when the last target held a whole replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx
import msgspec

from ops import netns
from ops.cli import unlabelled_samples
from ops.localcluster import LocalCluster
from services.loader.hostcache import block_set
from services.loader.peer import BlockServer, Holding, Link
from shared import subjects
from shared.artifact import torch_checkpoint
from shared.bus import Bus, decode
from shared.cache_messages import Evicted, EvictResidents
from shared.messages import (
    Artifact,
    Failed,
    Generate,
    GenerateAccepted,
    InstanceReady,
    InstanceStopped,
    ModelRecord,
    Rejected,
    SamplingParams,
    StartInstance,
    StopInstance,
    StreamEvent,
    Tier,
    TokenChunk,
)

PROMPT_IDS = (1, 504, 3458, 282, 4649, 314, 1345, 47)
"""The same eight-token prompt on every node (any ids do: one token is timed)."""
POLL_S = 0.05
T = TypeVar("T")


def record_of(name: str, artifact: Artifact, source: str) -> ModelRecord:
    return ModelRecord(
        name=name,
        source=source,
        artifact=artifact,
        ttft_slo_s=60.0,
        tpot_slo_s=10.0,
        keep_alive_s=3600.0,
        created_at=time.time(),
    )


async def first_token(bus: Bus, node: str, record: ModelRecord, timeout_s: float = 600.0) -> float:
    """Start the model on `node`'s engine and have it serve one token; time.perf_counter() of
    that token."""
    ready = await bus.request(
        subjects.engine_start(node), StartInstance(model=record), InstanceReady | Rejected, timeout=timeout_s
    )
    if isinstance(ready, Rejected):
        raise RuntimeError(f"{node} refused the start: {ready.message}")
    return await one_token(bus, node, record.name, timeout_s)


async def one_token(bus: Bus, node: str, model: str, timeout_s: float = 600.0) -> float:
    rid = uuid.uuid4().hex
    stream = await bus.client.subscribe(subjects.token_stream(rid))
    try:
        req = Generate(
            request_id=rid,
            model=model,
            prompt="",
            prompt_ids=PROMPT_IDS,
            prompt_tokens=len(PROMPT_IDS),
            params=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
            stream_subject=subjects.token_stream(rid),
        )
        accepted = await bus.request(subjects.engine_generate(node), req, GenerateAccepted | Failed, timeout=30)
        if isinstance(accepted, Failed):
            raise RuntimeError(f"{node}: {accepted.message}")
        first: float | None = None
        while True:  # to its end: the instance is idle when this returns (an unload may follow)
            event = decode((await stream.next_msg(timeout=timeout_s)).data, StreamEvent)
            if isinstance(event, Failed):
                raise RuntimeError(f"{node}: {event.message}")
            first = first or time.perf_counter()
            if not isinstance(event, TokenChunk):
                return first
    finally:
        await stream.unsubscribe()


async def first_tokens(bus: Bus, nodes: Sequence[str], record: ModelRecord) -> dict[str, float]:
    """Every node's first token, its start begun now (each start's stage waits for a multicast
    of the model under way): time.perf_counter() of each."""
    times = await asyncio.gather(*(first_token(bus, n, record) for n in nodes))
    return dict(zip(nodes, times, strict=True))


async def unload(bus: Bus, nodes: Sequence[str], record: ModelRecord) -> None:
    """Each node's instance and resident worker gone: the next start reads the host cache."""
    for n in nodes:
        stopped = await bus.request(
            subjects.engine_stop(n),
            StopInstance(model=record.name, idle_since=time.time()),
            InstanceStopped,
            timeout=30,
        )
        if not stopped.stopped and stopped.reason != "not loaded":
            raise RuntimeError(f"{n} did not unload {record.name}: {stopped.reason}")
        await bus.request(
            subjects.engine_evict(n), EvictResidents(artifact_id=record.artifact.artifact_id), Evicted, timeout=30
        )


class StoreServer:
    """The model store behind a shaped uplink, as a store other nodes reach over the network:
    the loaders' `TESSERA_STORE_ADDR`. Serves the torch checkpoint's block set."""

    def __init__(self, link_bps: float) -> None:
        self.server = BlockServer(Link(link_bps))

    async def start(self, host: str) -> str:
        """Listen on every address (the namespaces' bridge comes up later); where `host`'s
        side reaches it."""
        addr = await self.server.start("0.0.0.0", 0)
        return f"{host}:{addr.rsplit(':', 1)[1]}"

    def offer(self, artifact: Artifact, device: str) -> None:
        bs = block_set(artifact, device, Tier.TORCH)
        self.server.offer(Holding.complete(torch_checkpoint(artifact), bs))

    async def close(self) -> None:
        await self.server.close()


def _metric(c: LocalCluster, process: str, name: str) -> float:
    port = c.procs[process].http_port
    return unlabelled_samples(f"http://{c.host_of(process)}:{port}").get(name, 0.0)


class Background:
    """An event loop on a thread of its own, for the bus and the store server beside the
    synchronous driving of the cluster (its HTTP calls, its polling)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def spawn(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return self.spawn(coro).result(timeout_s)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def pipelined(
    link_bps: float, home: Path, targets: int, namespaces: bool, log: Callable[[str], None]
) -> dict[str, Any]:
    """A scale-out of a running torch model from node-0 to `targets` nodes, through the whole
    stack; see the module's docstring."""
    names = [f"node-{i}" for i in range(1 + targets)]
    mbit = link_bps * 8 / 1e6
    # The store serves from the root namespace: its link to the switch is shaped like a
    # node's (in namespaces), or its server paces itself (on the loopback).
    spaces = netns.NetNamespaces(str(home), names, mbit, root_mbit=mbit) if namespaces else None
    bg = Background()
    store = StoreServer(0.0 if spaces else link_bps)
    store_addr = bg.call(store.start(spaces.host_ip if spaces else "127.0.0.1"))
    cluster = LocalCluster(
        home=home,
        nodes=1 + targets,
        env={
            "TESSERA_ENGINE_BACKEND": "torch",
            "TESSERA_MULTICAST_SCALE_OUT": "true",
            "TESSERA_FILL_DELAY_S": "0",
            "TESSERA_STORE_ADDR": store_addr,
            # A warm worker for a stage beside the one the node's own start takes.
            "TESSERA_WORKER_POOL_SIZE": "2",
            **({} if spaces else {"TESSERA_LINK_BPS": str(link_bps)}),
        },
        netns=spaces,
    )
    bus = Bus("bench-pipelined")
    try:
        t = time.perf_counter()
        cluster.start(timeout_s=600)
        log(f"{1 + targets} torch nodes up in {time.perf_counter() - t:.1f}s")
        model = cluster.register_default_model(keep_alive_s=3600.0)
        artifact = msgspec.convert(model["artifact"], Artifact)
        store.offer(artifact, "CPU")
        name = str(model["name"])
        first = httpx.post(
            f"{cluster.base_url}/v1/completions",
            json={"model": name, "prompt": "Hello", "max_tokens": 1},
            headers=cluster.admin_headers,
            timeout=600,
        )
        first.raise_for_status()
        running = httpx.get(f"{cluster.base_url}/admin/instances", headers=cluster.admin_headers, timeout=10).json()
        (holder,) = [n["node_id"] for n in running["nodes"] if any(i["model"] == name for i in n["instances"])]
        until(lambda: _metric(cluster, f"loader@{holder}", "tessera_loader_host_cache_entries") >= 1, 120)
        news = [n for n in names if n != holder]
        bg.call(bus.connect(cluster.nats_url))
        t0 = time.perf_counter()
        scaled = httpx.post(
            f"{cluster.base_url}/admin/models/{name}/scale",
            json={"instances": 1 + targets},
            headers=cluster.admin_headers,
            timeout=60,
        )
        scaled.raise_for_status()
        replica_at: dict[str, float] = {}
        served: concurrent.futures.Future[float] | None = None
        head = ""
        deadline = t0 + 900
        while len(replica_at) < len(news):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"replicas after 900 s: {sorted(replica_at)}")
            for n in news:
                if n not in replica_at and _metric(cluster, f"loader@{n}", "tessera_loader_host_cache_entries") >= 1:
                    replica_at[n] = time.perf_counter()
                if not head and n not in replica_at:
                    if _metric(cluster, f"engine@{n}", "tessera_engine_pipelined_instances") >= 1:
                        head = n  # its request goes at once, while the replicas are timed on
                        served = bg.spawn(one_token(bus, head, name))
            time.sleep(POLL_S)  # sampling when each replica completes
        served_at = served.result(600) if served is not None else None
        if served_at is not None:
            log(f"{head} served a token through the pipeline at {served_at - t0:.2f}s")
        stages = sum(_metric(cluster, f"engine@{n}", "tessera_engine_stage_workers") for n in names)
        last = max(replica_at.values())
        log(f"last replica at {last - t0:.2f}s; pipeline head {head or 'none'}")
        return {
            "targets": targets,
            "link_mbps": link_bps * 8 / 1e6,
            "model_bytes": block_set(artifact, "CPU", Tier.TORCH).size,
            "replica_s": {n: round(v - t0, 3) for n, v in sorted(replica_at.items())},
            "last_replica_s": last - t0,
            "first_served_s": (served_at - t0) if served_at is not None else None,
            "first_served_before_replica_s": (last - served_at) if served_at is not None else None,
            "head": head,
            "stage_workers_at_last_replica": stages,
        }
    finally:
        try:
            bg.call(bus.close())
            bg.call(store.close())
        finally:
            bg.stop()
            cluster.stop()  # the namespaces go with it


def until(check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not so after {timeout_s:g}s")
        time.sleep(POLL_S)
