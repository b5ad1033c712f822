"""One engine node's state, shared by the engine's parts: workers bound to artifacts (`Bound`),
the model names serving on them (`Served`), the requests in flight, and what the node tells the
scheduler. A worker, taken pre-warmed from a pool (TIDAL §5), serves every model name registered
on its artifact, each with its own KV cache; scaled to zero, a name loses its cache while the
worker stays resident until evicted at the lowest cost (Tangram §3.1–3.2), its process ending."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from nats.aio.msg import Msg

from policy.adapter_turns import AdapterUse
from policy.affinity import reusable_shares
from policy.eviction import Resident
from policy.kv_account import KvAccount
from policy.kv_watermark import floor_tokens
from services.engine import metrics
from services.engine.settings import EngineSettings
from shared import subjects
from shared.adapters import StageAdapter
from shared.artifact import stored_torch_checkpoints
from shared.cache_messages import StageArtifact, Staged, VerifyStaged
from shared.errors import TesseraError
from shared.messages import (
    Artifact,
    ColdStartPhases,
    InstanceReady,
    InstanceView,
    ModelRecord,
    NodeStatus,
    PerfReport,
    Rejected,
    Tier,
)
from shared.pipeline_messages import EndStage

if TYPE_CHECKING:
    from services.engine.backends import Backend
    from services.engine.worker_pool import Worker, WorkerPool
    from services.engine.worker_wire import Done, Loaded

log = logging.getLogger(__name__)
NODE_ARENA = "node-arena"
"""The node's one tensor arena among the idle holders of tensors (`idle_tensors`)."""
ARENA_REGION = "weights:node-arena"
"""The node arena's reservation: its tensors, held or idle (a model's own, `weights:<artifact>`,
is then its worker's memory alone)."""
PERF_SAMPLES = 16
"""Measurements kept per artifact (the newest): enough to fit, small for a heartbeat."""


class Publisher(Protocol):
    """What the engine's parts send on the bus (`shared.bus.Bus`; a test's fake records it)."""

    async def publish(self, subject: str, message: Any) -> None: ...

    async def request(self, subject: str, message: Any, reply_type: Any, timeout: float) -> Any: ...

    async def reply(self, msg: Msg, message: Any) -> None: ...


class WorkerDied(Exception):
    """Its worker process ended under a request or a load."""


@dataclass
class Cancelled:
    """A request's cancel flag (it may be cancelled while still queued)."""

    flag: bool = False
    by_client: bool = False  # not a preemption

    def __call__(self) -> bool:
        return self.flag


async def every(period_s: float, step: Callable[[], Awaitable[None]], what: str) -> None:
    """`step` every `period_s`, for ever; a failure is logged and the next one tried."""
    while True:
        await asyncio.sleep(period_s)
        try:
            await step()
        except Exception:
            log.exception("%s failed", what)


@dataclass
class Bound:
    """A worker bound to one artifact: the unit that stays resident and is evicted."""

    worker: Worker
    artifact: Artifact
    loaded: Loaded
    """What its worker's load reported (`resident`: what a torch worker's own arena holds, which
    another model sharing it may be bound to once idle)."""
    resident: Resident
    source: str
    """Where its load read the blob: "host" (the loader's cache), "store", "arena" (a torch
    worker rebound, its shared tensors already there) or "pipeline"."""
    stage_s: float = 0.0
    weights_reserved: int = 0
    """Its weights' reservation, trued up to its measured footprint."""
    kv_allocated_bytes: int = 0
    """Its KV cache as last reported (inside its RSS, or on a GPU `device_bytes`)."""
    device_bytes: int = 0
    """On a GPU, what it holds on the device outside the node's arena, as last reported."""


@dataclass
class Served:
    """A model name serving on a bound worker (its KV cache lives in the worker)."""

    model: str
    bound: Bound
    loaded_at: float
    last_used: float
    kv: KvAccount
    ttft_slo_s: float = 0.0
    tpot_slo_s: float = 0.0
    ttft_slo_per_token_s: float = 0.0
    """A request's TTFT SLO is max(ttft_slo_s, prompt tokens × this): `policy/slo.py`."""
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when its last request in flight ends."""
    preempted: bool = False
    """Preempted (LLM-Mesh §7.1): its requests end as PREEMPTED, new ones go elsewhere."""
    warm_since: float = 0.0
    """time.monotonic() of its start's first token (inf until then): requests received from
    then on are measured for the performance model."""
    kv_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Serialises this cache's resizes (two requests growing it at once would both grow it)."""
    held: dict[str, int] = field(default_factory=dict)
    """Requests in the worker's running batch: the context tokens each row holds."""
    prompts: dict[str, int] = field(default_factory=dict)
    """Its requests in flight: their prompt tokens."""
    evicted: set[str] = field(default_factory=set)
    """Requests evicted from its KV cache (§6.4): they end PREEMPTED, to resume elsewhere."""
    start: PendingColdStart | None = None
    """Its own cold start until its first token (a pipelined instance's request is no measure of
    the replica that took its place)."""
    priority: int = 0
    pinned: bool = False
    """Kept warm (issue 35): never ended to make room, nor preempted for a lower priority."""
    adapters: dict[str, AdapterUse] = field(default_factory=dict)
    """LoRA adapters its worker has loaded, by name (`services/engine/adapters.py`)."""
    adapter_copies: dict[str, Staged] = field(default_factory=dict)
    """Their host-cache copies, by name: what its worker loads them from."""

    @property
    def active(self) -> int:
        return len(self.prompts)

    def keep(self, record: ModelRecord) -> None:
        """Take `record`'s keep-warm terms (at its start, and when the scheduler tells a pin);
        its worker's weights are evicted in its priority's turn once idle."""
        self.priority, self.pinned = record.priority, record.min_instances > 0
        self.bound.resident.priority = record.priority


@dataclass
class Samples:
    prefill: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=PERF_SAMPLES))
    decode: deque[tuple[int, int, float]] = field(default_factory=lambda: deque(maxlen=PERF_SAMPLES))

    def add(self, done: Done) -> None:
        if done.first_token_at is None:
            return
        # A batch prefills every row at once: the positions it computed took that long.
        self.prefill.append((done.prefill_tokens or done.prompt_tokens, round(done.prefill_s, 5)))
        if done.completion_tokens >= 2 and done.decode_s > 0:
            # Rows that end early leave the batch, so this overstates a long row's batch: the
            # iteration time errs long, the safe way.
            mean_length = done.prompt_tokens + done.completion_tokens // 2
            self.decode.append((done.batch, mean_length, round(done.decode_s / (done.completion_tokens - 1), 5)))


@dataclass
class PendingColdStart:
    t0: float
    phases: ColdStartPhases
    source: str


class Node:
    """The node's state, which every part reads and changes (one event loop: no part awaits
    between a check and its change), and what it tells the scheduler."""

    def __init__(self, settings: EngineSettings, backend: Backend, workers: WorkerPool, bus: Publisher) -> None:
        self.settings, self.backend, self.workers, self.bus = settings, backend, workers, bus
        self.id = settings.node_id
        self.on_cuda = settings.device.upper().startswith("CUDA")  # the budget is the device's
        self.instances: dict[str, Served] = {}
        self.bound: dict[str, Bound] = {}
        self.starting: dict[str, asyncio.Future[InstanceReady]] = {}
        self.cancels: dict[str, tuple[Cancelled, Bound]] = {}
        self.perf: dict[str, Samples] = {}
        """Recent measurements per artifact, sent with every heartbeat."""
        self.locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        """One per artifact (and `stages:<artifact>`): its starts and true-ups in turn."""
        self.tensor_bytes: dict[str, dict[str, int]] = {}
        """A tensor-arena node's artifacts (started here, or in the store): digest → bytes."""
        self.core_build_s = 0.0
        """The last core build's time here: what a new instance's build costs its neighbours."""
        self.memory_seen = (0, 0)
        """The memory budget and use as the memory manager last answered (0, 0: not yet)."""
        self.went_idle = asyncio.Event()
        """Set when an instance stops serving: a start waiting for memory tries again."""
        self.batch_grew = asyncio.Event()
        """Set when a request joins an instance: a KV growth waiting for memory tries again, as
        its batch may now outnumber a neighbour's it can preempt (LLM-Mesh §7.1)."""
        self.beat_due = asyncio.Event()
        """Set when a request ends: the scheduler may hold requests in line for its room."""
        self.stage_workers: dict[str, tuple[Worker, str, str]] = {}
        """Workers running pipeline stages, their artifact and reservation, by stage address."""
        self.pipelined: dict[str, tuple[tuple[str, str], ...]] = {}
        """Models served through a pipeline here: each stage's (node, address)."""
        self._background: set[asyncio.Task[None]] = set()
        self._export_gauges()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` in the background (kept from the collector until it ends)."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def clear_news(self) -> None:
        """Before a look at the node's room: `wait_news` then waits for what comes after it."""
        self.went_idle.clear()
        self.batch_grew.clear()

    async def wait_news(self, deadline: float) -> bool:
        """Until an instance goes idle or a batch grows (True), or time.monotonic() passes
        `deadline` (False)."""
        waits = [asyncio.ensure_future(e.wait()) for e in (self.went_idle, self.batch_grew)]
        try:
            done, _ = await asyncio.wait(
                waits, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for w in waits:
                w.cancel()
        return bool(done)

    def kv_reserved_on(self, bound: Bound) -> int:
        """What the KV reservations of the names served on `bound` (one worker's cache) add up to."""
        return sum(i.kv.reserved_bytes for i in self.instances.values() if i.bound is bound)

    def available(self) -> int:
        """Bytes the node could still grant, as its memory manager last answered."""
        budget, used = self.memory_seen
        return max(0, budget - used) if budget else 0

    def kv_account(self, artifact: Artifact) -> KvAccount:
        floor = floor_tokens(self.settings.kv_min_tokens, artifact.context_length, self.backend.kv_on_demand)
        return KvAccount(artifact.kv_bytes_per_token, floor, self.settings.kv_watermark)

    def serve(self, record: ModelRecord, bound: Bound, kv: KvAccount, start: PendingColdStart) -> None:
        """`record`'s model serves on `bound` from now, in place of the instance it had (a
        pipelined one bridging this start retires); `start` is recorded at its first token."""
        now = time.time()
        old = self.instances.get(record.name)
        slo = (record.ttft_slo_s, record.tpot_slo_s, record.ttft_slo_per_token_s)
        self.instances[record.name] = Served(
            record.name, bound, now, now, kv, *slo, warm_since=float("inf"), start=start
        )
        self.instances[record.name].keep(record)
        self.replaced(old)

    def cancel(self, request_id: str, by_client: bool) -> None:
        """Stop a request, queued or running, on its worker."""
        entry = self.cancels.get(request_id)
        if entry is not None:
            cancelled, bound = entry
            cancelled.flag = True
            cancelled.by_client = cancelled.by_client or by_client
            bound.worker.cancel(request_id)

    def runs_stages(self, worker: Worker) -> bool:
        return any(w is worker for w, _, _ in self.stage_workers.values())

    def replaced(self, old: Served | None) -> None:
        """`old` takes no more requests: a pipelined one retires once its requests in flight
        have ended, and each stage's node is told to stop its stage (FaaScale §4.3)."""
        if old is not None and old.bound.source == "pipeline":
            self.spawn(self._retire(old))

    async def _retire(self, inst: Served) -> None:
        stages = self.pipelined.pop(inst.model, ())
        if inst.active > 0:
            await inst.drained.wait()  # its last requests stream on from it meanwhile
        if not self.runs_stages(inst.bound.worker):  # else it goes with its last stage's end
            await asyncio.to_thread(inst.bound.worker.stop)
        aid = inst.bound.artifact.artifact_id
        for node, addr in stages:
            await self.bus.publish(subjects.engine_end_stage(node), EndStage(artifact_id=aid, addr=addr))
        log.info("%s switched from its pipeline to local execution", inst.model, extra={"model": inst.model})

    def idle_tensors(self) -> dict[str, frozenset[str]]:
        """Each idle bound worker (by artifact) with what its tensor arena holds; on a node with
        one arena, what that arena holds, whoever loaded it."""
        idle = {
            aid: frozenset(b.loaded.resident)
            for aid, b in self.bound.items()
            if b.resident.users == 0 and not b.worker.dead
        }
        if self.workers.arena is not None:
            held = self.workers.arena.digests()
            idle = {aid: held for aid in idle}
            if held:
                idle[NODE_ARENA] = held
        return idle

    async def learn_artifacts(self) -> None:
        """On a tensor-arena node: the tensors of each stored torch checkpoint, read once, so
        that the status says which share of each an idle arena holds before its first start."""
        if self.backend.tensor_arena:
            found = await asyncio.to_thread(stored_torch_checkpoints, self.settings.model_store, set(self.tensor_bytes))
            self.tensor_bytes.update(found)

    async def host_copy(
        self, subject: str, message: StageArtifact | VerifyStaged | StageAdapter, what: str
    ) -> Staged | None:
        """The loader's host-cache copy (staged, or checked) of an artifact or an adapter; None
        where the loader cannot be reached or refuses: the start then reads the store's copy,
        never depending on the cache."""
        try:
            reply = await self.bus.request(subject, message, Staged | Rejected, self.settings.load_timeout_s)
        except TesseraError as e:
            reply = Rejected(code=e.code, message=e.message)
        if isinstance(reply, Rejected):
            log.warning("no host-cache copy of %s (%s): reading the store's", what, reply.message)
            return None
        return reply

    async def beat(self) -> None:
        await self.bus.publish(subjects.node_heartbeat(), self.status())

    def holdings(self) -> tuple[set[str], dict[str, float]]:
        """Resident: artifacts a start would read nothing of (idle bound workers', and those
        whose every tensor an idle arena holds: Tangram §3.1); reusable: those it would read
        part of, with the share it would not (a fine-tune beside its base, in the store too)."""
        idle = self.idle_tensors()
        unbound = {a: t for a, t in self.tensor_bytes.items() if a not in self.bound}
        shares = reusable_shares(idle, unbound) if idle else {}
        return (set(idle) - {NODE_ARENA}) | {aid for aid, share in shares.items() if share >= 1.0}, shares

    def status(self) -> NodeStatus:
        resident, shares = self.holdings()
        return NodeStatus(
            node_id=self.id,
            sent_at=time.time(),
            instances=tuple(
                InstanceView(
                    model=i.model,
                    active=i.active,
                    last_used=i.last_used,
                    loaded_at=i.loaded_at,
                    weight_bytes=i.bound.artifact.weight_bytes,
                    worker_pid=i.bound.worker.pid,
                    tier=i.bound.worker.tier or "",
                    running=len(i.held),
                    held_tokens=sum(i.held.values()),
                    queued_tokens=sum(n for r, n in i.prompts.items() if r not in i.held),
                    adapters=tuple(sorted(i.adapters)),
                )
                for i in self.instances.values()
            ),
            starting=tuple(self.starting),
            memory_budget_bytes=self.memory_seen[0],
            memory_used_bytes=self.memory_seen[1],
            kind="gpu" if self.settings.device.upper().startswith(("GPU", "CUDA")) else "cpu",
            resident=tuple(sorted(resident)),
            reusable=tuple(sorted((aid, round(share, 4)) for aid, share in shares.items() if share < 1.0)),
            perf=tuple(
                PerfReport(artifact_id=aid, prefill=tuple(p.prefill), decode=tuple(p.decode))
                for aid, p in self.perf.items()
            ),
            max_batch=self.backend.batch_limit or self.settings.max_batch,
            join_recompute_tokens=self.settings.join_recompute_tokens,
            prewarmed=len(self.workers.idle),
            continuous_batching=True,
            core_build_s=self.core_build_s if self.settings.start_tier else 0.0,
            kv_on_demand=self.backend.kv_on_demand,
        )

    def _export_gauges(self) -> None:
        """The node's gauges, each read at a scrape (on this event loop)."""
        bound, instances, idle = self.bound.values, self.instances.values, self.workers.idle
        metrics.INSTANCES.set_function(lambda: len(self.instances))
        metrics.PIPELINED.set_function(lambda: sum(i.bound.source == "pipeline" for i in instances()))
        metrics.STAGE_WORKERS.set_function(lambda: len({id(w) for w, _, _ in self.stage_workers.values()}))
        metrics.RESIDENT_BYTES.set_function(lambda: sum(b.resident.nbytes for b in bound()))
        metrics.POOL_IDLE_BYTES.set_function(lambda: sum(b.resident.nbytes for b in bound() if b.resident.users == 0))
        metrics.PREWARMED.set_function(lambda: len(idle))
        metrics.PREWARMED_BYTES.set_function(lambda: sum(w.rss_bytes() for w in idle))
        metrics.WORKER_RSS_BYTES.set_function(lambda: sum(b.worker.rss_bytes() for b in bound()))
        if (arena := self.workers.arena) is not None:
            metrics.ARENA_BYTES.labels("held").set_function(lambda: arena.held_bytes()[0])
            metrics.ARENA_BYTES.labels("idle").set_function(lambda: arena.held_bytes()[1])
        for tier in Tier:
            metrics.BOUND_BY_TIER.labels(tier).set_function(functools.partial(self._bound_on, tier))

    def _bound_on(self, tier: Tier) -> int:
        return sum(b.worker.tier == tier for b in self.bound.values())

    def idle_since(self) -> float | None:
        """time.time() since which nothing has run on this node (None: something runs or starts)."""
        if self.starting or any(i.active for i in self.instances.values()):
            return None
        return max((i.last_used for i in self.instances.values()), default=0.0)
