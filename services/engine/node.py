"""One engine node's state, shared by its parts (`memory.py`, `starts.py`, `generation.py`,
`service.py`): the workers bound to artifacts (`Bound`), the model names serving on them
(`Served`), and the few actions every part takes on them: reserving and releasing memory with
the node's memory manager, cancelling a request, unloading an instance, evicting residents.

Instances run in worker processes (`worker_pool.py`), taken pre-warmed from a pool (TIDAL §5). A
worker is bound to one artifact (a compiled model) and serves every model name registered on
it, each with its own KV cache. When a name scales to zero its KV cache goes; the worker and
its weights stay resident until evicted at the lowest cost (Tangram §3.1–3.2), and evicting
ends the process, which hands its memory back whole.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from policy.affinity import reusable_shares
from policy.eviction import Resident, choose_evictions, over_budget
from policy.kv_account import KvAccount
from policy.kv_watermark import floor_tokens
from services.engine.core import CORE_MAX_SEQS
from services.engine.metrics import (
    ARENA_BYTES,
    BOUND_BY_TIER,
    INSTANCES,
    PIPELINED,
    POOL_EVICTIONS,
    POOL_IDLE_BYTES,
    PREWARMED,
    PREWARMED_BYTES,
    RESIDENT_BYTES,
    STAGE_WORKERS,
    WORKER_RSS_BYTES,
    forget_kv_gauges,
)
from services.engine.node_arena import NodeArena
from services.engine.settings import EngineSettings
from services.engine.step_gate import StepGate
from services.engine.worker_pool import Cancelled, Worker, WorkerPool
from services.engine.worker_wire import Done
from shared import subjects
from shared.artifact import reads_torch_checkpoint, stored_torch_checkpoints
from shared.bus import Bus
from shared.messages import (
    Artifact,
    ColdStartPhases,
    InstanceReady,
    InstanceView,
    NodeStatus,
    PerfReport,
    Release,
    Reserve,
    ReserveDone,
    ReserveResult,
    Tier,
)

log = logging.getLogger(__name__)
NODE_ARENA = "node-arena"
"""The node's one tensor arena among the idle holders of tensors (`idle_tensors`)."""
ARENA_REGION = "weights:node-arena"
"""The node arena's reservation with the memory manager: what its tensors take, held or
idle (a model's own reservation, `weights:<artifact>`, is then its worker's memory alone)."""

PERF_SAMPLES = 16
"""Measurements kept per artifact (the newest): enough to fit, small for a heartbeat."""


@dataclass
class Bound:
    """A worker bound to one artifact: the unit that stays resident and is evicted."""

    worker: Worker
    artifact: Artifact
    loaded_from_cache: bool
    resident: Resident
    source: str
    """Where its load read the blob: "host" (the loader's cache), "store", or "arena" (a
    torch worker rebound from another model, its shared tensors already there)."""
    stage_s: float = 0.0
    worker_load_s: float = 0.0
    load_threads: int = 0
    """The threads the worker's load ran on (`start_cores`: a share of the node's beside busy
    instances)."""
    weights_reserved: int = 0
    """What the node's memory manager holds for the worker beside KV caches: the artifact's
    weights at first, trued up to the worker's measured footprint (`policy/footprint.py`)."""
    kv_allocated_bytes: int = 0
    """The worker's KV cache as its core last reported it (inside its RSS, or on a GPU inside
    `device_bytes`; the instances' KV reservations count it)."""
    device_bytes: int = 0
    """On a GPU, what its worker holds on the device outside the node's arena, as it last
    reported (0 on the host, and before its first request ends)."""
    tensors: frozenset[str] = frozenset()
    """Content hashes of what its worker's own tensor arena holds (a torch worker without the
    node's arena; empty on OpenVINO's): another model sharing them may be bound to this worker
    once it is idle."""


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
    active: int = 0
    drained: asyncio.Event = field(default_factory=asyncio.Event)
    """Clear while it has requests in flight (`active`), set when the last one ends."""
    requests: set[str] = field(default_factory=set)
    """Its requests in flight (ids)."""
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
    """Requests evicted to make room in its KV cache (§6.4): they end PREEMPTED, to resume elsewhere."""


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
            # Its iterations decoded the batch it ran in (rows that end early leave it, so
            # this overstates a long row's batch: the iteration time errs long, the safe way).
            mean_length = done.prompt_tokens + done.completion_tokens // 2
            self.decode.append((done.batch, mean_length, round(done.decode_s / (done.completion_tokens - 1), 5)))


@dataclass
class PendingColdStart:
    t0: float
    phases: ColdStartPhases
    source: str


class EngineNode:
    def __init__(self, settings: EngineSettings, bus: Bus) -> None:
        self.settings = settings
        self.bus = bus
        self.node = settings.node_id
        self.instances: dict[str, Served] = {}
        self.bound: dict[str, Bound] = {}
        # One iteration at a time per share of cores one instance's threads fill.
        cores = len(os.sched_getaffinity(0))
        if settings.cpu_quota > 0:
            cores = min(cores, max(1, int(settings.cpu_quota)))
        capacity = max(1, cores // max(1, settings.inference_threads))
        self.gate = StepGate(multiprocessing.get_context("spawn"), capacity) if settings.interleave else None
        self.workers = WorkerPool(
            settings.worker_pool_size,
            settings.device,
            settings.inference_threads,
            refill_delay_s=settings.worker_refill_delay_s,
            prefault_bytes=settings.worker_prefault_mb << 20,
            max_batch=settings.max_batch,
            join_recompute_tokens=settings.join_recompute_tokens,
            gate=self.gate,
            backend=settings.engine_backend,
            arena_bytes=settings.torch_arena_bytes,
            kv_tokens=settings.torch_kv_tokens,
            arena=(
                NodeArena.make(settings.torch_arena_bytes, settings.device)
                if settings.engine_backend == "torch" and settings.torch_shared_arena
                else None
            ),
        )
        self._starting: dict[str, asyncio.Future[InstanceReady]] = {}
        self._artifact_locks: dict[str, asyncio.Lock] = {}
        self._cold: dict[str, PendingColdStart] = {}
        self._cancels: dict[str, tuple[Cancelled, Bound]] = {}
        self._perf: dict[str, Samples] = {}
        """Recent measurements per artifact, sent with every heartbeat."""
        self._arena_wanted: Counter[str] = Counter()
        """Digests the starts under way will bind in the node's arena: counted in its
        reservation until they are in (once, however many starts want them), and never evicted
        for memory meanwhile (one start's tensors for another's reservation)."""
        self._arena_sizes: dict[str, int] = {}
        """Bytes of each digest a start has wanted (a digest's size never changes)."""
        self._arena_granted = 0
        """The arena's reservation as the memory manager last granted it."""
        self._footprints: dict[str, int] = {}
        """Per artifact, the weights reservation its last worker was trued up to: what the
        next start reserves."""
        self.tensor_bytes: dict[str, dict[str, int]] = {}
        """A torch node's artifacts (started here, or in the store): content hash → bytes of
        each tensor."""
        self._core_build_s = 0.0
        """How long the last core build on this node took (`TieredUp.load_s`): what a new
        instance's build costs its neighbours' decode rounds, as placement prices it."""
        self._memory_seen = (0, 0)
        """The node's memory budget and use as its memory manager last answered (0, 0: not yet)."""
        self._went_idle = asyncio.Event()
        """Set when an instance stops serving: a start waiting for memory tries again."""
        self._heartbeat_task: asyncio.Task[None] | None = None
        self.beat_due = asyncio.Event()
        """Set when a request ends: the heartbeat goes out early, since the scheduler may hold
        requests in line for the room it freed."""
        self._tier_up_task: asyncio.Task[None] | None = None
        self._true_up_task: asyncio.Task[None] | None = None
        self._preemptions: set[asyncio.Task[None]] = set()
        """Preemptions the scheduler ordered, under way (kept from the collector)."""
        self.stage_workers: dict[str, tuple[Worker, str]] = {}
        """Workers running pipeline stages (`pipelines.py`) and their artifact, by stage address
        (a worker runs every stage of one artifact on this node)."""
        self._stage_memory: dict[str, str] = {}
        """Each stage's reservation with the node's memory manager (its owner), by address."""
        self.pipelined: dict[str, tuple[tuple[str, str], ...]] = {}
        """Models served through a pipeline here: each stage's (node, address)."""
        self._background: set[asyncio.Task[None]] = set()
        """Retirements of pipelined instances under way (kept from the collector)."""

    async def _reserve_memory(self, owner: str, nbytes: int) -> ReserveResult:
        result = await self.bus.request(
            subjects.memory_reserve(self.node),
            Reserve(owner=owner, nbytes=nbytes),
            ReserveResult,
            timeout=self.settings.memory_request_timeout_s,
        )
        self._memory_seen = (result.budget_bytes, result.used_bytes)
        return result

    async def _release_memory(self, owner: str) -> None:
        """Release and wait for the answer: a reservation sent next must see it (messages on
        two subjects may be handled in either order)."""
        try:
            result = await self.bus.request(
                subjects.memory_release(self.node),
                Release(owner=owner),
                ReserveResult,
                timeout=self.settings.memory_request_timeout_s,
            )
            self._memory_seen = (result.budget_bytes, result.used_bytes)
        except Exception:
            log.warning("could not release memory of %s", owner)

    async def _memory_done(self, owner: str) -> None:
        """Tell the memory manager the load or resize granted for `owner` is finished."""
        try:
            await self.bus.publish(subjects.memory_done(self.node), ReserveDone(owner=owner))
        except Exception:
            log.warning("could not report memory of %s done", owner)

    def _kv_account(self, artifact: Artifact) -> KvAccount:
        floor = floor_tokens(self.settings.kv_min_tokens, artifact.context_length)
        return KvAccount(artifact.kv_bytes_per_token, floor, self.settings.kv_watermark)

    @property
    def on_cuda(self) -> bool:
        """Its models run on a CUDA GPU (`TESSERA_DEVICE=CUDA`): the memory budget is the
        device's."""
        return self.settings.device.upper().startswith("CUDA")

    def _available(self) -> int:
        """Bytes the node could still grant, as its memory manager last answered (the station
        has the last word: a grow it refuses falls back to the requirement)."""
        budget, used = self._memory_seen
        return max(0, budget - used) if budget else 0

    async def _sync_arena(self) -> None:
        """The node arena's reservation (`ARENA_REGION`) moved to what it takes now, with what
        starts under way are about to copy into it: shrunk after an eviction or a start's end
        (what it placed may have evicted idle tensors, or its load failed)."""
        arena = self.workers.arena
        if arena is None:
            return
        target = self._arena_target()
        if target == 0:
            await self._release_memory(ARENA_REGION)
            self._arena_granted = 0
            return
        result = await self._reserve_memory(ARENA_REGION, target)
        await self._memory_done(ARENA_REGION)
        if result.granted:
            self._arena_granted = target
        else:
            log.warning("the node arena takes %d bytes, more than the memory manager grants it", target)

    def _arena_target(self) -> int:
        """What the node's arena reservation should be: what it takes, with what the starts
        under way will copy into it."""
        arena = self.workers.arena
        if arena is None:
            return 0
        return arena.committed_bytes({d: self._arena_sizes[d] for d in self._arena_wanted})

    async def _evict(self, keys: list[str]) -> int:
        """Stop the residents `keys`; on a node with one arena, their tensors go too, but those
        another model holds or a start under way will bind (`_arena_wanted`: the model a start
        makes room for needs them)."""
        freed = 0
        for key in keys:
            bound = self.bound.pop(key, None)
            if bound is None:  # gone while an earlier one stopped (rebound to another model)
                continue
            await asyncio.to_thread(bound.worker.stop)  # the process's memory goes with it
            if self.workers.arena is not None:  # and the weights it alone held in the node's arena
                self.workers.arena.evict_idle(
                    {d: n for d, n in self.tensor_bytes.get(key, {}).items() if d not in self._arena_wanted}
                )
            freed += bound.resident.nbytes
            await self._release_memory(f"weights:{key}")
            POOL_EVICTIONS.inc()
            log.info("evicted resident model %s (%d bytes)", key, bound.resident.nbytes)
        if freed and self.workers.arena is not None:
            await self._sync_arena()  # once, for all it evicted there
        self._update_gauges()
        return freed

    async def _unload(self, inst: Served) -> None:
        del self.instances[inst.model]
        forget_kv_gauges(inst.model)
        self._cold.pop(inst.model, None)
        inst.bound.worker.drop_session(inst.model)  # its KV cache
        await self._release_memory(f"{inst.model}:kv")
        if inst.bound.source == "pipeline":  # it holds no weights: its worker and stages go
            self.replaced(inst)
        else:
            await self._release(inst.bound)

    def replaced(self, old: Served | None) -> None:
        """`old` takes no more requests: a pipelined instance retires (`pipelines.py`)."""

    async def _lose_worker(self, bound: Bound) -> None:
        """A worker died: its instances are gone; the next request starts them again."""
        for inst in [i for i in self.instances.values() if i.bound is bound]:
            del self.instances[inst.model]
            forget_kv_gauges(inst.model)
            await self._release_memory(f"{inst.model}:kv")
            self.replaced(inst)  # a pipelined one: its stages end too
        if self.bound.get(bound.artifact.artifact_id) is bound:
            del self.bound[bound.artifact.artifact_id]
            await self._release_memory(f"weights:{bound.artifact.artifact_id}")
        self._update_gauges()
        await self.bus.publish(subjects.node_heartbeat(), self.status())  # tell the scheduler now

    def _cancel(self, request_id: str, by_client: bool) -> None:
        """Stop a request, queued or running, on its worker."""
        entry = self._cancels.get(request_id)
        if entry is not None:
            cancelled, bound = entry
            cancelled.flag = True
            cancelled.by_client = cancelled.by_client or by_client
            bound.worker.cancel(request_id)

    def idle_tensors(self) -> dict[str, frozenset[str]]:
        """Each idle bound worker (by its artifact) with what its tensor arena holds (nothing on
        an OpenVINO worker); on a node with one arena, what that arena holds, whoever loaded it."""
        idle = {aid: b.tensors for aid, b in self.bound.items() if b.resident.users == 0 and not b.worker.dead}
        if self.workers.arena is not None:
            held = self.workers.arena.digests()
            idle = {aid: held for aid in idle}
            if held:
                idle[NODE_ARENA] = held
        return idle

    def _residency(self) -> tuple[tuple[str, ...], tuple[tuple[str, float], ...]]:
        """Artifacts a start here would read nothing of, and those it would read part of (with
        the share of their bytes it would not read). The first: those of idle bound workers,
        and on a torch node those whose every tensor the node's arena (or an idle worker's own)
        holds (a model whose worker stopped, or one with another's weights: a start binds
        them, Tangram §3.1). The second: a torch node's artifacts (those of the store too,
        `learn_artifacts`) part of whose tensors it holds, such as a fine-tune beside its
        base."""
        idle = self.idle_tensors()
        shares = (
            reusable_shares(idle, {a: t for a, t in self.tensor_bytes.items() if a not in self.bound}) if idle else {}
        )
        resident = (set(idle) - {NODE_ARENA}) | {aid for aid, share in shares.items() if share >= 1.0}
        partial = tuple(sorted((aid, round(share, 4)) for aid, share in shares.items() if share < 1.0))
        return tuple(sorted(resident)), partial

    async def learn_artifacts(self) -> None:
        """On a torch node: the tensors of each artifact in the model store with a torch
        checkpoint, read once each (an artifact never changes), so that the status says which
        share of each an idle arena holds before the model was ever started here."""
        if self.settings.engine_backend != "torch":
            return
        found = await asyncio.to_thread(stored_torch_checkpoints, self.settings.model_store, set(self.tensor_bytes))
        self.tensor_bytes.update(found)

    def status(self) -> NodeStatus:
        resident, reusable = self._residency()
        return NodeStatus(
            node_id=self.node,
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
                )
                for i in self.instances.values()
            ),
            starting=tuple(self._starting),
            memory_budget_bytes=self._memory_seen[0],
            memory_used_bytes=self._memory_seen[1],
            kind="gpu" if self.settings.device.upper().startswith(("GPU", "CUDA")) else "cpu",
            resident=resident,
            reusable=reusable,
            perf=tuple(
                PerfReport(artifact_id=aid, prefill=tuple(p.prefill), decode=tuple(p.decode))
                for aid, p in self._perf.items()
            ),
            # The continuous-batching core (`core.py`) serves every instance once built; the
            # start tier's batch before it lasts a couple of seconds. A torch worker's batch
            # (`torch_engine/batching.py`) steps at most `max_batch` requests at once.
            max_batch=self.settings.max_batch
            if reads_torch_checkpoint(self.settings.engine_backend)
            else CORE_MAX_SEQS,
            join_recompute_tokens=self.settings.join_recompute_tokens,
            prewarmed=len(self.workers.idle),
            continuous_batching=True,
            core_build_s=self._core_build_s if self.settings.start_tier else 0.0,
        )

    def _update_gauges(self) -> None:
        INSTANCES.set(len(self.instances))
        PIPELINED.set(sum(1 for i in self.instances.values() if i.bound.source == "pipeline"))
        STAGE_WORKERS.set(len({id(w) for w, _ in self.stage_workers.values()}))
        RESIDENT_BYTES.set(sum(b.resident.nbytes for b in self.bound.values()))
        POOL_IDLE_BYTES.set(sum(b.resident.nbytes for b in self.bound.values() if b.resident.users == 0))
        PREWARMED.set(len(self.workers.idle))
        PREWARMED_BYTES.set(self.workers.idle_rss_bytes())
        if self.workers.arena is not None:
            held, idle = self.workers.arena.held_bytes()
            ARENA_BYTES.labels("held").set(held)
            ARENA_BYTES.labels("idle").set(idle)
        WORKER_RSS_BYTES.set(sum(b.worker.rss_bytes() for b in self.bound.values()))
        for tier in Tier:
            BOUND_BY_TIER.labels(tier).set(sum(1 for b in self.bound.values() if b.worker.tier == tier))

    def _node_idle_since(self) -> float | None:
        """time.time() since which nothing has run on this node (None: something runs or starts)."""
        if self._starting or any(i.active for i in self.instances.values()):
            return None
        return max((i.last_used for i in self.instances.values()), default=0.0)

    async def _release(self, bound: Bound) -> None:
        """An instance stopped using the worker: it stays resident within the pool budget."""
        bound.resident.users -= 1
        bound.resident.last_used = time.time()
        residents = [b.resident for b in self.bound.values()]
        excess = over_budget(residents, self.settings.pool_budget_bytes)
        if excess:
            await self._evict(choose_evictions(residents, excess, time.time()))
        self._update_gauges()
