"""Engine bus handlers: start and stop instances, generate, cancel, heartbeat, cold-start log.

Instances run in worker processes (`workers.py`), taken pre-warmed from a pool (TIDAL §5). A
worker is bound to one artifact (a compiled model) and serves every model name registered on
it, each with its own KV cache. When a name scales to zero its KV cache goes; the worker and
its weights stay resident until evicted at the lowest cost (Tangram §3.1–3.2), and evicting
ends the process, which hands its memory back whole.

A cold start is timed in four phases (ARCHITECTURE, "A cold start"): Init (memory admission
and binding a worker), Load (restoring the materialized compiled model), Profile (KV sizing
and its reservation), Prefill (the first token of the request that caused the start).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import multiprocessing
import os
import time
from collections import deque
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from policy.defrag import Neighbour, choose_preemption
from policy.eviction import Resident, choose_evictions, over_budget
from policy.kv_account import KvAccount
from policy.kv_watermark import Action, KvPlan, floor_tokens
from services.engine.core import CORE_MAX_SEQS
from services.engine.metrics import (
    BATCHED_REQUESTS,
    BOUND_BY_TIER,
    COLD_START_SECONDS,
    COLD_WORKERS,
    DECODED_TOKENS,
    GATE_WAIT,
    INSTANCE_EVICTIONS,
    INSTANCES,
    KV_ALLOCATED,
    KV_EVICTIONS,
    KV_RESERVED,
    KV_RESIZES,
    KV_UNDERESTIMATES,
    PHASE_SECONDS,
    POOL_EVICTIONS,
    POOL_HITS,
    POOL_IDLE_BYTES,
    PREEMPTIONS,
    PREWARMED,
    PREWARMED_BYTES,
    QUEUE_WAIT,
    REIMPORTS,
    REQUESTS,
    RESIDENT_BYTES,
    TIER_UP_SECONDS,
    TIER_UPS,
    TTFT,
    WORKER_RSS_BYTES,
    forget_kv_gauges,
)
from services.engine.settings import EngineSettings
from services.engine.step_gate import StepGate
from services.engine.worker import Chunk, Done, Loaded, Run, TieredUp
from services.engine.workers import Cancelled, Worker, WorkerDied, WorkerPool
from shared import subjects
from shared.artifact import has_tier
from shared.bus import Bus, decode
from shared.errors import TesseraError
from shared.messages import (
    Artifact,
    Cancel,
    ColdStartPhases,
    ColdStartRecorded,
    ErrorCode,
    Evicted,
    EvictResidents,
    Failed,
    Finished,
    FinishReason,
    Generate,
    GenerateAccepted,
    InstanceReady,
    InstanceStopped,
    InstanceView,
    NodeStatus,
    PerfReport,
    PreemptInstance,
    Rejected,
    Release,
    RelocateAnswer,
    RelocateQuery,
    Reserve,
    ReserveDone,
    ReserveResult,
    StageArtifact,
    Staged,
    StartInstance,
    StopInstance,
    Tier,
    TokenChunk,
    VerifyStaged,
)

log = logging.getLogger(__name__)

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
    """Where its load read the blob: "host" (the loader's cache) or "store"."""
    stage_s: float = 0.0
    worker_load_s: float = 0.0


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
    active: int = 0
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
class _Samples:
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


class EngineService:
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
        )
        self._starting: dict[str, asyncio.Future[InstanceReady]] = {}
        self._artifact_locks: dict[str, asyncio.Lock] = {}
        self._cold: dict[str, PendingColdStart] = {}
        self._cancels: dict[str, tuple[Cancelled, Bound]] = {}
        self._perf: dict[str, _Samples] = {}
        """Recent measurements per artifact, sent with every heartbeat."""
        self._memory_seen = (0, 0)
        """The node's memory budget and use as its memory manager last answered (0, 0: not yet)."""
        self._went_idle = asyncio.Event()
        """Set when an instance stops serving: a start waiting for memory tries again."""
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._tier_up_task: asyncio.Task[None] | None = None
        self._preemptions: set[asyncio.Task[None]] = set()
        """Preemptions the scheduler ordered, under way (kept from the collector)."""

    async def start(self) -> None:
        await self.bus.subscribe(subjects.engine_start(self.node), self.on_start)
        await self.bus.subscribe(subjects.engine_stop(self.node), self.on_stop)
        await self.bus.subscribe(subjects.engine_preempt(self.node), self.on_preempt)
        await self.bus.subscribe(subjects.engine_generate(self.node), self.on_generate)
        await self.bus.subscribe(subjects.engine_cancel(self.node), self.on_cancel)
        await self.bus.subscribe(subjects.engine_evict(self.node), self.on_evict)
        # A restarted engine holds nothing: drop whatever an earlier run had reserved.
        await self._release_memory("*")
        self.workers.refill()
        self._heartbeat_task = asyncio.create_task(self._heartbeat())
        if self.settings.start_tier:
            self._tier_up_task = asyncio.create_task(self._tier_ups())

    async def close(self) -> None:
        for task in (self._heartbeat_task, self._tier_up_task):
            if task:
                task.cancel()
        for cancelled, _ in self._cancels.values():
            cancelled.flag = True
        self.workers.close()
        for bound in self.bound.values():
            bound.worker.stop()

    # --- status ------------------------------------------------------------------------------

    def status(self) -> NodeStatus:
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
            resident=tuple(aid for aid, b in self.bound.items() if b.resident.users == 0),
            perf=tuple(
                PerfReport(artifact_id=aid, prefill=tuple(p.prefill), decode=tuple(p.decode))
                for aid, p in self._perf.items()
            ),
            # The continuous-batching core (`core.py`) serves every instance once built; the
            # start tier's batch before it lasts a couple of seconds.
            max_batch=CORE_MAX_SEQS,
            join_recompute_tokens=self.settings.join_recompute_tokens,
            prewarmed=len(self.workers.idle),
            continuous_batching=True,
        )

    def _update_gauges(self) -> None:
        INSTANCES.set(len(self.instances))
        RESIDENT_BYTES.set(sum(b.resident.nbytes for b in self.bound.values()))
        POOL_IDLE_BYTES.set(sum(b.resident.nbytes for b in self.bound.values() if b.resident.users == 0))
        PREWARMED.set(len(self.workers.idle))
        PREWARMED_BYTES.set(self.workers.idle_rss_bytes())
        WORKER_RSS_BYTES.set(sum(b.worker.rss_bytes() for b in self.bound.values()))
        for tier in Tier:
            BOUND_BY_TIER.labels(tier).set(sum(1 for b in self.bound.values() if b.worker.tier == tier))

    def _node_idle_since(self) -> float | None:
        """time.time() since which nothing has run on this node (None: something runs or starts)."""
        if self._starting or any(i.active for i in self.instances.values()):
            return None
        return max((i.last_used for i in self.instances.values()), default=0.0)

    async def _tier_ups(self) -> None:
        """Tier up one START worker at a time, once the whole node has been idle for
        `tier_up_idle_s`: the tier-up takes ≈ 1 core-second, which on a node with other
        instances decoding would be taken from them (measured on 1-core nodes: neighbours'
        TPOT past their SLO). A busy node keeps serving from START meanwhile."""
        period = min(0.1, self.settings.tier_up_idle_s)
        while True:
            await asyncio.sleep(period)
            try:
                idle_since = self._node_idle_since()
                if idle_since is None or time.time() - idle_since < self.settings.tier_up_idle_s:
                    continue
                workers = [b.worker for b in self.bound.values() if not b.worker.dead]
                if any(w.tiering for w in workers):
                    continue
                todo = next((w for w in workers if w.tier == Tier.START and not w.tier_up_failed), None)
                if todo is not None:
                    todo.tier_up()
            except Exception:
                log.exception("tier-up check failed")

    async def _heartbeat(self) -> None:
        while True:
            try:
                self._update_gauges()
                if self.bus.connected.is_set():
                    await self.bus.publish(subjects.node_heartbeat(), self.status())
            except Exception:
                log.exception("heartbeat failed")
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    # --- memory ------------------------------------------------------------------------------

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

    async def _evict_idle_instances(self, need: int) -> bool:
        """Make room by ending instances that serve nothing now, before their keep-alive
        (Tangram §3.2: minimal-cost eviction; here of whole instances, whose KV cache and,
        for the last name on a worker, weights go). False if the idle ones cannot free enough."""
        now = time.time()
        idle = [i for i in self.instances.values() if i.active == 0]
        kv = {i.model: i.kv.reserved_bytes for i in idle}
        users = {aid: b.resident.users for aid, b in self.bound.items()}
        candidates = []
        for i in idle:
            sole = users.get(i.bound.artifact.artifact_id, 0) == 1
            frees = kv[i.model] + (i.bound.resident.nbytes if sole else 0)
            # Its restart costs a resident start at least, a full load if its weights go too.
            reload_s = i.bound.resident.reload_s if sole else 0.1
            candidates.append(Resident(i.model, frees, reload_s, i.loaded_at, i.last_used))
        victims = choose_evictions(candidates, need, now)
        if not victims:
            return False
        for model in victims:
            inst = self.instances.get(model)
            if inst is not None and inst.active == 0:
                log.info("unloading idle %s to make room", model, extra={"model": model})
                INSTANCE_EVICTIONS.inc()
                await self._unload(inst)
        return True

    async def _memory_done(self, owner: str) -> None:
        """Tell the memory manager the load or resize granted for `owner` is finished."""
        try:
            await self.bus.publish(subjects.memory_done(self.node), ReserveDone(owner=owner))
        except Exception:
            log.warning("could not report memory of %s done", owner)

    async def _reserve(self, owner: str, nbytes: int, preemptor: Served | None = None) -> None:
        """Reserve; if the node is full, evict idle residents at the lowest cost, then idle
        instances (whose memory then turns into residents, evicted in turn if need be). For
        the KV growth of a busy instance (`preemptor`), then preempt smaller neighbours whose
        requests validate elsewhere (LLM-Mesh §7.1). Else wait for an instance to go idle."""
        deadline = time.monotonic() + self.settings.memory_wait_s
        while True:
            self._went_idle.clear()
            result = await self._reserve_memory(owner, nbytes)
            for make_room in (self._evict_idle_residents, self._evict_idle_instances, self._evict_idle_residents):
                if result.granted:
                    return
                if await make_room(nbytes - (result.budget_bytes - result.used_bytes)):
                    result = await self._reserve_memory(owner, nbytes)
            if result.granted:
                return
            short = nbytes - (result.budget_bytes - result.used_bytes)
            if preemptor is not None and await self._preempt_for(preemptor, short):
                continue  # the preempted instances are idle now: the next pass evicts them
            # Everything that could go is busy: wait (up to a deadline) for an instance to
            # finish its requests, rather than refuse a start that will fit in a moment.
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self._went_idle.wait(), left)
            except TimeoutError:
                break
        raise TesseraError(
            ErrorCode.NO_CAPACITY,
            f"node {self.node} has {result.budget_bytes - result.used_bytes} bytes free, {nbytes} needed",
            retry_after_s=2,
        )

    # --- KV reservations (LLM-Mesh §6.2, §6.4) -------------------------------------------------

    def _kv_account(self, artifact: Artifact) -> KvAccount:
        floor = floor_tokens(self.settings.kv_min_tokens, artifact.context_length)
        return KvAccount(artifact.kv_bytes_per_token, floor, self.settings.kv_watermark)

    def _available(self) -> int:
        """Bytes the node could still grant, as its memory manager last answered (the station
        has the last word: a grow it refuses falls back to the requirement)."""
        budget, used = self._memory_seen
        return max(0, budget - used) if budget else 0

    async def _kv_resize(self, inst: Served, plan: KvPlan, required: int, wait: bool) -> bool:
        """Move `inst`'s reservation to `plan`: the recommended size, else (refused) the
        requirement, else, with `wait`, make room or wait for it like a start does. False when
        the node could not grant even the requirement."""
        owner = f"{inst.model}:kv"
        old = inst.kv.reserved_bytes
        targets = [plan.target_bytes] if plan.action is not Action.REFUSE else []
        if required not in targets and required > old:
            targets.append(required)
        granted = None
        for target in targets:
            if (await self._reserve_memory(owner, target)).granted:
                granted = target
                break
        if granted is None and wait and required > old:
            await self._reserve(owner, required, preemptor=inst)  # raises NO_CAPACITY once out of time
            granted = required
        if granted is None:
            return False
        await self._memory_done(owner)
        inst.kv.reserved_bytes = granted
        KV_RESERVED.labels(inst.model).set(granted)
        KV_RESIZES.labels("grow" if granted > old else "shrink").inc()
        return True

    async def _kv_admit(self, inst: Served, req: Generate) -> None:
        """Count the request into its instance's KV reservation, growing it first if it falls
        short (early, to the watermark). Raises NO_CAPACITY when the node cannot grant it."""
        ctx = inst.bound.artifact.context_length
        cap = req.params.max_tokens if req.params.max_tokens > 0 else ctx - req.prompt_tokens
        async with inst.kv_lock:
            plan = inst.kv.admit(req.request_id, req.prompt_tokens, cap, self._available(), time.monotonic())
            if plan.action is Action.KEEP:
                return
            try:
                await self._kv_resize(inst, plan, inst.kv.required(), wait=True)
            except BaseException:
                inst.kv.forget(req.request_id)
                raise

    async def _kv_progress(self, inst: Served, request_id: str, generated: int) -> None:
        """A request decoding past what eq. 2 assumed for it (the mean output): grow the
        reservation if the node can; if it cannot, count the underestimate and evict the
        request with the most headroom (§6.4): it ends PREEMPTED and the gateway resumes it
        on another node from the text it has streamed."""
        if inst.kv_lock.locked():
            return  # a resize is under way; the next chunk looks again
        async with inst.kv_lock:
            plan = inst.kv.progress(request_id, generated, self._available())
            if plan.action is Action.KEEP:
                return
            if await self._kv_resize(inst, plan, inst.kv.required(), wait=False):
                return
            KV_UNDERESTIMATES.inc()
            victim = inst.kv.evictee(inst.ttft_slo_s, inst.tpot_slo_s, time.monotonic())
            if victim is not None and victim not in inst.evicted:
                inst.evicted.add(victim)
                inst.kv.forget(victim)  # its rows leave the cache now; Ō learns nothing from it
                KV_EVICTIONS.inc()
                log.info(
                    "evicting %s from %s's KV cache (most headroom; the node cannot grow it)",
                    victim,
                    inst.model,
                    extra={"model": inst.model},
                )
                self._cancel(victim, by_client=False)

    async def _kv_complete(self, inst: Served, request_id: str, generated: int, finished: bool) -> None:
        """A request left: Ō learns its length, and the reservation shrinks if it is now well
        over what the rest need (lazily, below the watermark only)."""
        async with inst.kv_lock:
            plan = inst.kv.complete(request_id, generated, finished)
            if plan.action is Action.SHRINK and self.instances.get(inst.model) is inst:
                await self._kv_resize(inst, plan, plan.target_bytes, wait=False)

    # --- preemption (LLM-Mesh §7.1) ------------------------------------------------------------

    async def _preempt_for(self, preemptor: Served, need: int) -> bool:
        """Preempt neighbours of `preemptor` with a smaller batch, smallest first, whose requests
        validate on another node (the scheduler says which), until `need` bytes would be free.
        False when no such set frees enough (nothing is preempted then)."""
        users = {aid: b.resident.users for aid, b in self.bound.items()}
        neighbours = [
            Neighbour(
                i.model,
                i.active,
                i.kv.reserved_bytes + (i.bound.resident.nbytes if users.get(i.bound.artifact.artifact_id) == 1 else 0),
                relocatable=False,
            )
            for i in self.instances.values()
            if i is not preemptor and not i.preempted and 0 < i.active < preemptor.active
        ]
        if not neighbours:
            return False
        try:
            answer = await self.bus.request(
                subjects.relocatable(),
                RelocateQuery(node_id=self.node, models=tuple(n.key for n in neighbours)),
                RelocateAnswer,
                timeout=self.settings.memory_request_timeout_s,
            )
        except TesseraError as e:
            log.warning("no relocation check (%s): preempting nobody", e.message)
            return False
        ok = set(answer.relocatable)
        plan = choose_preemption(
            preemptor.active, need, [dataclasses.replace(n, relocatable=n.key in ok) for n in neighbours]
        )
        if plan is None or not plan.victims:
            return False
        for model in plan.victims:
            inst = self.instances.get(model)
            if inst is not None:
                await self._preempt(inst, preemptor)
        return True

    async def _preempt(self, inst: Served, preemptor: Served | None) -> None:
        """End `inst`'s requests as PREEMPTED (the gateway resumes each elsewhere) and unload it."""
        inst.preempted = True
        PREEMPTIONS.inc()
        log.info(
            "preempting %s (batch %d) for %s (batch %d)",
            inst.model,
            inst.active,
            preemptor.model if preemptor else "a neighbour",
            preemptor.active if preemptor else 0,
            extra={"model": inst.model},
        )
        for rid in list(inst.requests):
            self._cancel(rid, by_client=False)
        deadline = time.monotonic() + self.settings.memory_wait_s
        while inst.active > 0 and time.monotonic() < deadline:
            self._went_idle.clear()
            try:
                await asyncio.wait_for(self._went_idle.wait(), deadline - time.monotonic())
            except TimeoutError:
                break
        if inst.active == 0 and self.instances.get(inst.model) is inst:
            await self._unload(inst)

    async def _evict_idle_residents(self, need: int) -> bool:
        keys = choose_evictions((b.resident for b in self.bound.values()), need, time.time())
        if keys:
            await self._evict(keys)
        return bool(keys)

    # --- start / stop ------------------------------------------------------------------------

    async def on_start(self, msg: Msg) -> None:
        req = decode(msg.data, StartInstance)
        try:
            reply: InstanceReady | Rejected = await self.start_instance(req)
        except TesseraError as e:
            reply = Rejected(code=e.code, message=e.message, retry_after_s=e.retry_after_s)
        except Exception as e:
            log.exception("start of %s failed", req.model.name)
            reply = Rejected(code=ErrorCode.ENGINE_FAILED, message=f"start failed: {e}", retry_after_s=1)
        await self.bus.reply(msg, reply)

    async def start_instance(self, req: StartInstance) -> InstanceReady:
        name = req.model.name
        if name in self.instances:
            return InstanceReady(
                node_id=self.node,
                model=name,
                phases=ColdStartPhases(init_s=0, load_s=0, profile_s=0),
                already_running=True,
                loaded_from_cache=self.instances[name].bound.loaded_from_cache,
            )
        if name in self._starting:  # a second start of the same model waits for the first
            return await asyncio.shield(self._starting[name])
        fut: asyncio.Future[InstanceReady] = asyncio.get_running_loop().create_future()
        self._starting[name] = fut
        try:
            ready = await self._cold_start(req)
            fut.set_result(ready)
            return ready
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved here: waiters re-raise it themselves
            raise
        finally:
            del self._starting[name]

    async def _cold_start(self, req: StartInstance) -> InstanceReady:
        record = req.model
        t0 = time.monotonic()
        bound, hit, t1 = await self._acquire(record.artifact)
        t2 = time.monotonic()
        try:
            # Profile: KV sizing was measured once at registration (bytes per token); here it
            # only becomes a reservation for a full context.
            kv = self._kv_account(record.artifact)
            kv.reserved_bytes = kv.required()  # eq. 2 with nothing running: the L_min floor
            await self._reserve(f"{record.name}:kv", kv.reserved_bytes)
            await self._memory_done(f"{record.name}:kv")  # allocated on demand by the runtime
        except BaseException:
            await self._release(bound)
            raise
        t3 = time.monotonic()
        phases = ColdStartPhases(init_s=t1 - t0, load_s=t2 - t1, profile_s=t3 - t2)
        now = time.time()
        self.instances[record.name] = Served(
            record.name, bound, now, now, kv, record.ttft_slo_s, record.tpot_slo_s, warm_since=float("inf")
        )
        KV_RESERVED.labels(record.name).set(kv.reserved_bytes)
        self._cold[record.name] = PendingColdStart(t0, phases, "resident" if hit else bound.source)
        self._update_gauges()
        log.info(
            "instance of %s ready",
            record.name,
            extra={
                "model": record.name,
                "init_s": phases.init_s,
                "load_s": phases.load_s,
                "profile_s": phases.profile_s,
                "resident": hit,
                "worker_pid": bound.worker.pid,
            },
        )
        if not bound.loaded_from_cache:
            log.warning("%s was compiled at start: its materialized blob is missing", record.name)
        return InstanceReady(
            node_id=self.node, model=record.name, phases=phases, loaded_from_cache=bound.loaded_from_cache
        )

    def _start_cores(self) -> tuple[int, ...] | None:
        """A bounded share of cores for a start while other instances are generating, so that
        their decode keeps its pace; all cores when nothing else runs."""
        if not any(i.active for i in self.instances.values()):
            return None
        cores = sorted(os.sched_getaffinity(0))
        share = max(1, int(len(cores) * self.settings.start_cpu_share))
        return tuple(cores[-share:]) if share < len(cores) else None

    async def _acquire(self, artifact: Artifact) -> tuple[Bound, bool, float]:
        """A worker bound to the artifact: the resident one, or a pre-warmed one loaded now.
        Returns it, whether it was resident, and when Init ended (monotonic)."""
        aid = artifact.artifact_id
        async with self._artifact_locks.setdefault(aid, asyncio.Lock()):
            now = time.time()
            bound = self.bound.get(aid)
            if bound is not None and not bound.worker.dead:
                r = bound.resident
                r.users += 1
                r.uses += 1
                r.last_used = now
                POOL_HITS.inc()
                return bound, True, time.monotonic()
            await self._reserve(f"weights:{aid}", artifact.weight_bytes)
            try:
                worker, warm = await self.workers.take()
                if not warm:
                    COLD_WORKERS.inc()
                t_load = time.monotonic()
                tier = self._start_tier(artifact)
                staged = await self._stage(artifact, tier)
                stage_s = time.monotonic() - t_load
                worker.on_tier_up = functools.partial(self._on_tier_up, artifact)
                try:
                    loaded, waited_s = await self._load(worker, artifact, tier, staged)
                except BaseException:
                    await asyncio.to_thread(worker.stop)
                    raise
                stage_s += waited_s
                await self._memory_done(f"weights:{aid}")
            except BaseException:
                await self._release_memory(f"weights:{aid}")
                raise
            resident = Resident(aid, artifact.weight_bytes, loaded.load_s, now, now, users=1)
            source = "host" if staged and staged.hit else "store"
            bound = self.bound[aid] = Bound(
                worker, artifact, loaded.loaded_from_cache, resident, source, stage_s, loaded.load_s
            )
            return bound, False, t_load

    async def _load(
        self, worker: Worker, artifact: Artifact, tier: Tier, staged: Staged | None
    ) -> tuple[Loaded, float]:
        """Import the staged blob into the worker. On a deferred-verify hit the loader checks
        the copy's blocks meanwhile; a copy found corrupt (or not confirmed) is imported
        again once repaired, so nothing is served from bytes that failed their check.
        Returns the load and how long it then waited for the check."""
        cores = self._start_cores()
        timeout = self.settings.load_timeout_s
        if staged is None or staged.verified:
            return await worker.load(artifact, cores, staged.cache_dir if staged else None, timeout, tier), 0.0
        check = asyncio.ensure_future(self._verified(artifact))
        try:
            loaded = await worker.load(artifact, cores, staged.cache_dir, timeout, tier)
        except BaseException:
            check.cancel()
            raise
        t0 = time.monotonic()
        checked = await check
        waited = time.monotonic() - t0
        if checked is not None and checked.repaired_blocks == 0:
            return loaded, waited
        REIMPORTS.inc()
        log.warning(
            "the host-cache copy of %s failed its check (%s); importing it again",
            artifact.artifact_id,
            f"{checked.repaired_blocks} block(s) repaired" if checked else "unconfirmed",
        )
        again = await worker.load(artifact, cores, checked.cache_dir if checked else None, timeout, tier)
        return again, waited

    async def _verified(self, artifact: Artifact) -> Staged | None:
        try:
            reply = await self.bus.request(
                subjects.loader_verify(self.node),
                VerifyStaged(artifact_id=artifact.artifact_id),
                Staged | Rejected,
                timeout=self.settings.load_timeout_s,
            )
        except TesseraError as e:
            log.warning("no block check of %s (%s)", artifact.artifact_id, e.message)
            return None
        return reply if isinstance(reply, Staged) else None

    def _start_tier(self, artifact: Artifact) -> Tier:
        """START when the artifact has one (materialized since tiers exist) and it is enabled."""
        if self.settings.start_tier and has_tier(artifact, self.settings.device, Tier.START):
            return Tier.START
        return Tier.STEADY

    def _on_tier_up(self, artifact: Artifact, msg: TieredUp) -> None:
        self._update_gauges()
        if msg.error:
            TIER_UPS.labels("failed").inc()
            log.warning("tier-up of %s failed, staying on the start tier: %s", artifact.artifact_id, msg.error)
            return
        TIER_UPS.labels("done").inc()
        TIER_UP_SECONDS.observe(msg.load_s)
        log.info(
            "%s tiered up to %s in %.2fs",
            artifact.artifact_id,
            msg.tier,
            msg.load_s,
            extra={"artifact": artifact.artifact_id},
        )

    async def _stage(self, artifact: Artifact, tier: Tier) -> Staged | None:
        """The verified blob in host memory, from this node's loader; None (read the store's
        copy) if the loader cannot be reached, so a start never depends on the cache."""
        try:
            staged = await self.bus.request(
                subjects.loader_stage(self.node),
                StageArtifact(artifact=artifact, device=self.settings.device, tier=tier, defer_verify=True),
                Staged | Rejected,
                timeout=self.settings.load_timeout_s,
            )
        except TesseraError as e:
            log.warning("host cache unavailable (%s); loading %s from the store", e.message, artifact.artifact_id)
            return None
        if isinstance(staged, Rejected):
            log.warning("host cache refused %s (%s); loading from the store", artifact.artifact_id, staged.message)
            return None
        return staged

    async def _release(self, bound: Bound) -> None:
        """An instance stopped using the worker: it stays resident within the pool budget."""
        bound.resident.users -= 1
        bound.resident.last_used = time.time()
        residents = [b.resident for b in self.bound.values()]
        excess = over_budget(residents, self.settings.pool_budget_bytes)
        if excess:
            await self._evict(choose_evictions(residents, excess, time.time()))
        self._update_gauges()

    async def _evict(self, keys: list[str]) -> int:
        freed = 0
        for key in keys:
            bound = self.bound.pop(key)
            await asyncio.to_thread(bound.worker.stop)  # the process's memory goes with it
            freed += bound.resident.nbytes
            await self._release_memory(f"weights:{key}")
            POOL_EVICTIONS.inc()
            log.info("evicted resident model %s (%d bytes)", key, bound.resident.nbytes)
        self._update_gauges()
        return freed

    async def on_evict(self, msg: Msg) -> None:
        req = decode(msg.data, EvictResidents)
        keys = [
            k for k, b in self.bound.items() if b.resident.users == 0 and (not req.artifact_id or k == req.artifact_id)
        ]
        freed = await self._evict(keys)
        await self.bus.reply(msg, Evicted(node_id=self.node, artifact_ids=tuple(keys), freed_bytes=freed))

    async def on_stop(self, msg: Msg) -> None:
        req = decode(msg.data, StopInstance)
        inst = self.instances.get(req.model)
        if inst is None:
            reply = InstanceStopped(node_id=self.node, model=req.model, stopped=False, reason="not loaded")
        elif inst.active > 0 or inst.last_used > req.idle_since:
            reply = InstanceStopped(node_id=self.node, model=req.model, stopped=False, reason="busy")
        else:
            await self._unload(inst)
            log.info("instance of %s unloaded (idle)", req.model, extra={"model": req.model})
            reply = InstanceStopped(node_id=self.node, model=req.model, stopped=True)
        await self.bus.reply(msg, reply)

    async def on_preempt(self, msg: Msg) -> None:
        """The scheduler makes room for a bigger neighbour (LLM-Mesh §7.1): the instance's
        requests end PREEMPTED now, and it unloads once they have."""
        req = decode(msg.data, PreemptInstance)
        inst = self.instances.get(req.model)
        if inst is None or inst.preempted:
            reply = InstanceStopped(node_id=self.node, model=req.model, stopped=False, reason="not loaded")
        else:
            task = asyncio.create_task(self._preempt(inst, self.instances.get(req.for_model)))
            self._preemptions.add(task)
            task.add_done_callback(self._preemptions.discard)
            reply = InstanceStopped(node_id=self.node, model=req.model, stopped=True, reason="preempted")
        await self.bus.reply(msg, reply)

    async def _unload(self, inst: Served) -> None:
        del self.instances[inst.model]
        forget_kv_gauges(inst.model)
        self._cold.pop(inst.model, None)
        inst.bound.worker.drop_session(inst.model)  # its KV cache
        await self._release_memory(f"{inst.model}:kv")
        await self._release(inst.bound)

    async def _lose_worker(self, bound: Bound) -> None:
        """A worker died: its instances are gone; the next request starts them again."""
        for inst in [i for i in self.instances.values() if i.bound is bound]:
            del self.instances[inst.model]
            forget_kv_gauges(inst.model)
            await self._release_memory(f"{inst.model}:kv")
        if self.bound.get(bound.artifact.artifact_id) is bound:
            del self.bound[bound.artifact.artifact_id]
            await self._release_memory(f"weights:{bound.artifact.artifact_id}")
        self._update_gauges()
        await self.bus.publish(subjects.node_heartbeat(), self.status())  # tell the scheduler now

    # --- generation --------------------------------------------------------------------------

    async def on_cancel(self, msg: Msg) -> None:
        self._cancel(decode(msg.data, Cancel).request_id, by_client=True)

    def _cancel(self, request_id: str, by_client: bool) -> None:
        """Stop a request, queued or running, on its worker."""
        entry = self._cancels.get(request_id)
        if entry is not None:
            cancelled, bound = entry
            cancelled.flag = True
            cancelled.by_client = cancelled.by_client or by_client
            bound.worker.cancel(request_id)

    async def on_generate(self, msg: Msg) -> None:
        req = decode(msg.data, Generate)
        inst = self.instances.get(req.model)
        if inst is None or inst.preempted:
            await self.bus.reply(
                msg,
                Failed(
                    request_id=req.request_id,
                    code=ErrorCode.INSTANCE_NOT_LOADED,
                    message=f"{req.model} is not loaded on {self.node}",
                ),
            )
            return
        cancelled = Cancelled()
        self._cancels[req.request_id] = (cancelled, inst.bound)
        inst.requests.add(req.request_id)
        inst.prompts[req.request_id] = req.prompt_tokens
        inst.active += 1
        inst.last_used = time.time()
        await self.bus.reply(msg, GenerateAccepted(request_id=req.request_id))
        try:
            try:
                await self._kv_admit(inst, req)
            except TesseraError as e:
                REQUESTS.labels("error").inc()
                await self.bus.publish(
                    req.stream_subject, Failed(request_id=req.request_id, code=e.code, message=e.message)
                )
                return
            await self._generate(inst, req, cancelled)
        finally:
            inst.active -= 1
            inst.requests.discard(req.request_id)
            inst.prompts.pop(req.request_id, None)
            inst.held.pop(req.request_id, None)
            inst.evicted.discard(req.request_id)
            inst.last_used = time.time()
            del self._cancels[req.request_id]
            if inst.active == 0:
                self._went_idle.set()  # a start waiting for memory may take this one's

    async def _generate(self, inst: Served, req: Generate, cancelled: Cancelled) -> None:
        received = time.monotonic()
        run = Run(
            req.request_id,
            inst.model,
            req.prompt_ids,
            req.params,
            self.settings.stream_interval_s,
            inst.kv.reserved_tokens,
            received,
            inst.ttft_slo_s,
            inst.tpot_slo_s,
        )
        generated = 0
        final: Finished | Failed = Finished(
            request_id=req.request_id,
            finish_reason=FinishReason.CANCELLED,
            prompt_tokens=req.prompt_tokens,
            completion_tokens=0,
        )
        try:

            def started(batch: int) -> None:
                QUEUE_WAIT.observe(time.monotonic() - received)
                BATCHED_REQUESTS.labels(str(batch)).inc()
                inst.held[req.request_id] = req.prompt_tokens

            async for out in inst.bound.worker.generate(run, cancelled, started):
                if isinstance(out, Chunk):
                    DECODED_TOKENS.inc(out.tokens)
                    generated += out.tokens
                    if req.request_id in inst.held:
                        inst.held[req.request_id] = req.prompt_tokens + generated
                    await self._kv_progress(inst, req.request_id, generated)
                    await self.bus.publish(
                        req.stream_subject,
                        TokenChunk(request_id=req.request_id, text=out.text, tokens=out.tokens, logprobs=out.logprobs),
                    )
                elif isinstance(out, Done):
                    if received >= inst.warm_since and not out.beside_build:
                        # Requests that arrived before the start's first token shared the
                        # fresh worker's first pass and the start itself: their times are no
                        # measure of the model (on 2/3-core nodes they made the scheduler
                        # predict a 2 s prefill and scale out for it).
                        self._perf.setdefault(inst.bound.artifact.artifact_id, _Samples()).add(out)
                    if self.gate is not None:
                        GATE_WAIT.observe(out.gated_s)
                    if out.kv_allocated_bytes:
                        KV_ALLOCATED.labels(inst.model).set(out.kv_allocated_bytes)
                    final = Finished(
                        request_id=req.request_id,
                        finish_reason=out.finish_reason,
                        prompt_tokens=req.prompt_tokens,
                        completion_tokens=out.completion_tokens,
                    )
                    if out.first_token_at is not None:
                        TTFT.observe(out.first_token_at - received)
                        await self._maybe_record_cold_start(inst, out.first_token_at)
            if (
                (inst.preempted or req.request_id in inst.evicted)
                and isinstance(final, Finished)
                and final.finish_reason is FinishReason.CANCELLED
                and not cancelled.by_client
            ):
                why = (
                    f"the instance of {inst.model} on {self.node} was preempted"
                    if inst.preempted
                    else f"evicted from the KV cache of {inst.model} on {self.node}, which could not grow"
                )
                final = Failed(request_id=req.request_id, code=ErrorCode.PREEMPTED, message=why)
                REQUESTS.labels("preempted").inc()
            else:
                REQUESTS.labels(final.finish_reason.value).inc()
        except WorkerDied as e:
            log.error("worker of %s died during %s", inst.model, req.request_id)
            REQUESTS.labels("error").inc()
            final = Failed(
                request_id=req.request_id,
                code=ErrorCode.ENGINE_FAILED,
                message=f"the worker serving {inst.model} died ({e}); retry the request",
            )
            await self._lose_worker(inst.bound)
        except Exception as e:
            log.exception("generation %s failed", req.request_id)
            REQUESTS.labels("error").inc()
            final = Failed(request_id=req.request_id, code=ErrorCode.ENGINE_FAILED, message=str(e))
        await self.bus.publish(req.stream_subject, final)
        finished = isinstance(final, Finished) and final.finish_reason is not FinishReason.CANCELLED
        await self._kv_complete(inst, req.request_id, generated, finished)

    async def _maybe_record_cold_start(self, inst: Served, first_token_at: float) -> None:
        pending = self._cold.pop(inst.model, None)
        if pending is None:
            return
        inst.warm_since = first_token_at
        self.workers.start_done()
        p = pending.phases
        ready_at = pending.t0 + p.init_s + p.load_s + p.profile_s
        phases = ColdStartPhases(
            init_s=p.init_s,
            load_s=p.load_s,
            profile_s=p.profile_s,
            prefill_s=max(0.0, first_token_at - ready_at),
        )
        total = first_token_at - pending.t0
        for name in ("init", "load", "profile", "prefill"):
            PHASE_SECONDS.labels(name).observe(getattr(phases, f"{name}_s"))
        COLD_START_SECONDS.observe(total)
        event = ColdStartRecorded(
            node_id=self.node,
            model=inst.model,
            started_at=time.time() - (time.monotonic() - pending.t0),
            phases=phases,
            total_s=total,
            loaded_from_cache=inst.bound.loaded_from_cache,
            source=pending.source,
            stage_s=0.0 if pending.source == "resident" else inst.bound.stage_s,
            worker_load_s=0.0 if pending.source == "resident" else inst.bound.worker_load_s,
            tier=inst.bound.worker.tier or "",
        )
        log.info(
            "cold start of %s: %.2fs",
            inst.model,
            total,
            extra={
                "model": inst.model,
                "phases": {
                    "init_s": phases.init_s,
                    "load_s": phases.load_s,
                    "profile_s": phases.profile_s,
                    "prefill_s": phases.prefill_s,
                },
                "source": pending.source,
                "tier": inst.bound.worker.tier,
            },
        )
        await self.bus.publish(subjects.cold_start_recorded(), event)
