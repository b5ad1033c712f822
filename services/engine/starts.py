"""Starting and stopping instances: a start binds a pre-warmed worker to the artifact (or finds
it resident), restores its materialized compiled model, sizes and reserves its KV, and tiers
up from the start tier to the continuous-batching core; a stop, a preemption or an eviction
undoes it.

A cold start is timed in four phases (ARCHITECTURE, "A cold start"): Init (memory admission
and binding a worker), Load (restoring the materialized compiled model), Profile (KV sizing
and its reservation), Prefill (the first token of the request that caused the start).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from cuda_ext.allocator import ArenaFull
from policy.affinity import most_reused
from policy.eviction import Resident, choose_evictions
from policy.node_cpu import StartTierWorker, next_tier_up, start_cores
from policy.prefetch import admission_bytes
from services.engine.memory import KvMemory
from services.engine.metrics import (
    COLD_WORKERS,
    KV_RESERVED,
    POOL_HITS,
    REIMPORTS,
    TIER_UP_SECONDS,
    TIER_UPS,
)
from services.engine.node import ARENA_REGION, Bound, Node, PendingColdStart, Publisher, Served
from services.engine.settings import EngineSettings
from shared import subjects
from shared.artifact import has_torch_checkpoint, torch_tensor_bytes
from shared.bus import decode
from shared.errors import TesseraError
from shared.messages import (
    Artifact,
    ColdStartPhases,
    ErrorCode,
    Evicted,
    EvictResidents,
    ImportModel,
    InstanceReady,
    InstanceStopped,
    ModelImported,
    ModelRecord,
    PreemptInstance,
    Rejected,
    StageArtifact,
    Staged,
    StartInstance,
    StopInstance,
    Tier,
    VerifyStaged,
)

if TYPE_CHECKING:
    from services.engine.worker_pool import Worker, WorkerPool
    from services.engine.worker_wire import Loaded, TieredUp

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Starts:
    """Starts and stops of instances on the node, with the loader's copies and the memory
    their workers reserve."""

    settings: EngineSettings
    node: Node
    memory: KvMemory
    workers: WorkerPool
    bus: Publisher
    """The node's loader (staging, block checks, imports) and the replies to the scheduler."""
    _preemptions: set[asyncio.Task[None]] = field(default_factory=set, init=False)
    """Preemptions the scheduler ordered, under way (kept from the collector)."""

    async def tier_ups(self) -> None:
        """Tier up one START worker at a time, once the whole node has been idle for
        `tier_up_idle_s`: the tier-up takes ≈ 1 core-second, which on a node with other
        instances decoding would be taken from them (measured on 1-core nodes: neighbours'
        TPOT past their SLO). A busy node keeps serving from START meanwhile."""
        period = min(0.1, self.settings.tier_up_idle_s)
        while True:
            await asyncio.sleep(period)
            try:
                live = {aid: b.worker for aid, b in self.node.bound.items() if not b.worker.dead}
                key = next_tier_up(
                    [
                        StartTierWorker(aid, w.tier == Tier.START, w.tiering, w.tier_up_failed)
                        for aid, w in live.items()
                    ],
                    self.node.idle_since(),
                    time.time(),
                    self.settings.tier_up_idle_s,
                )
                if key is not None:
                    live[key].tier_up()
            except Exception:
                log.exception("tier-up check failed")

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
        if name in self.node.instances:
            return InstanceReady(
                node_id=self.node.id,
                model=name,
                phases=ColdStartPhases(init_s=0, load_s=0, profile_s=0),
                loaded_from_cache=self.node.instances[name].bound.loaded_from_cache,
            )
        if name in self.node.starting:  # a second start of the same model waits for the first
            return await asyncio.shield(self.node.starting[name])
        fut: asyncio.Future[InstanceReady] = asyncio.get_running_loop().create_future()
        self.node.starting[name] = fut
        try:
            ready = await self._cold_start(req)
            fut.set_result(ready)
            return ready
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # retrieved here: waiters re-raise it themselves
            raise
        finally:
            del self.node.starting[name]

    async def _cold_start(self, req: StartInstance) -> InstanceReady:
        record = req.model
        t0 = time.monotonic()
        await self._materialized(record)
        bound, hit, t1 = await self._acquire(record.artifact)
        t2 = time.monotonic()
        try:
            # Profile: KV sizing was measured once at registration (bytes per token); here it
            # only becomes a reservation for a full context.
            kv = self.node.kv_account(record.artifact)
            kv.reserved_bytes = kv.required()  # eq. 2 with nothing running: the L_min floor
            await self.memory.reserve(f"{record.name}:kv", kv.reserved_bytes)
            await self.memory.done(f"{record.name}:kv")  # allocated on demand by the runtime
        except BaseException:
            await self.memory.release_worker(bound)
            raise
        t3 = time.monotonic()
        phases = ColdStartPhases(init_s=t1 - t0, load_s=t2 - t1, profile_s=t3 - t2)
        self.node.serve(record, bound, kv, PendingColdStart(t0, phases, "resident" if hit else bound.source))
        KV_RESERVED.labels(record.name).set(kv.reserved_bytes)
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
            node_id=self.node.id, model=record.name, phases=phases, loaded_from_cache=bound.loaded_from_cache
        )

    async def _materialized(self, record: ModelRecord) -> None:
        """On a torch or vLLM node, a model registered by the loader of an OpenVINO node has no
        torch checkpoint yet: this node's loader writes it from the model's GGUF, once (the
        store keeps it for every node), before the first start here."""
        if not self.node.backend.reads_torch_checkpoint:
            return
        if await asyncio.to_thread(has_torch_checkpoint, record.artifact):
            return
        log.info("%s has no torch checkpoint yet: this node's loader writes it", record.name)
        reply = await self.bus.request(
            subjects.loader_import(self.node.id),
            ImportModel(source=record.source),
            ModelImported | Rejected,
            timeout=self.settings.load_timeout_s,
        )
        if isinstance(reply, Rejected):
            raise TesseraError(
                reply.code, f"{record.name} cannot start on a {self.node.backend.name} node: {reply.message}"
            )

    def _start_cores(self) -> tuple[int, ...] | None:
        """A bounded share of cores for a start while other instances are generating, so that
        their decode keeps its pace; all cores when nothing else runs."""
        busy = any(i.active for i in self.node.instances.values())
        return start_cores(sorted(os.sched_getaffinity(0)), self.settings.start_cpu_share, busy)

    async def _acquire(self, artifact: Artifact) -> tuple[Bound, bool, float]:
        """A worker bound to the artifact: the resident one, or a pre-warmed one loaded now.
        Returns it, whether it was resident, and when Init ended (monotonic)."""
        aid = artifact.artifact_id
        async with self.node.lock(aid):
            now = time.time()
            bound = self.node.bound.get(aid)
            if bound is not None and not bound.worker.dead:
                r = bound.resident
                r.users += 1
                r.uses += 1
                r.last_used = now
                POOL_HITS.inc()
                return bound, True, time.monotonic()
            arena = self.workers.arena
            if self.node.backend.tensor_arena and arena is None:
                # Without the node's one arena, reuse is only in an idle worker's own. With
                # it, any worker's load reuses what the node holds, and idle instances stay.
                rebound = await self._rebind(artifact)
                if rebound is not None:
                    return rebound, False, time.monotonic()
            tensors = await self._tensors(artifact) if arena is not None else {}
            self.memory.arena_wanted.update(tensors.keys())
            self.memory.arena_sizes.update(tensors)
            try:
                return await self._acquire_new(artifact, tensors, now)
            finally:
                self.memory.arena_wanted.subtract(tensors.keys())
                self.memory.arena_wanted += Counter()  # drops the digests no start wants now

    async def _acquire_new(self, artifact: Artifact, tensors: dict[str, int], now: float) -> tuple[Bound, bool, float]:
        """`_acquire` of a model not bound here: a pre-warmed worker loads it."""
        aid = artifact.artifact_id
        missing = await self._arena_room(aid, tensors) if tensors else 0
        in_arena = bool(tensors) and missing == 0
        if tensors:
            # Its weights are the arena's reservation; its own is its worker's memory.
            weights = self.memory.footprints.get(aid) or self._warm_worker_bytes() or artifact.weight_bytes
        else:
            weights = max(artifact.weight_bytes, self.memory.footprints.get(aid, 0))
        await self.memory.reserve(f"weights:{aid}", weights)
        try:
            if missing:
                self.memory.arena_granted = await self.memory.reserve(
                    ARENA_REGION, self.memory.arena_target, held=lambda: self.memory.arena_granted
                )
                await self.memory.done(ARENA_REGION)
            t_load = time.monotonic()
            tier = self.node.backend.start_tier_of(artifact, self.settings.device, self.settings.start_tier)
            # The blob first, then the worker: a stage that waits for a scale-out's
            # multicast leaves the warm worker to the pipeline stages meanwhile (a stage
            # answers at once otherwise, and taking a warm worker is instant).
            # Every tensor in the node's arena: the checkpoint's small files are read
            # where they are, and no copy of it is staged.
            staged = None if in_arena else await self._stage(artifact, tier)
            stage_s = time.monotonic() - t_load
            worker, warm = await self.workers.take()
            if not warm:
                COLD_WORKERS.inc()
            worker.on_tier_up = functools.partial(self._on_tier_up, artifact)
            try:
                loaded, waited_s = await self._load(worker, artifact, tier, staged)
            except BaseException:
                await asyncio.to_thread(worker.stop)
                raise
            stage_s += waited_s
            await self.memory.done(f"weights:{aid}")
        except BaseException as e:
            await self.memory.release(f"weights:{aid}")
            if isinstance(e, ArenaFull):  # room for its bytes, but no range long enough
                raise TesseraError(
                    ErrorCode.NO_CAPACITY,
                    f"artifact {aid} does not fit in node {self.node.id}'s tensor arena: {e}",
                    retry_after_s=2,
                ) from e
            raise
        finally:
            if tensors:  # what it placed (or, failing, left) there; a concurrent load may have evicted
                await self.memory.sync_arena()
        source = "arena" if in_arena else "host" if staged and staged.hit else "store"
        return self._bind(worker, artifact, loaded, source, stage_s, weights, now), False, t_load

    async def _arena_room(self, aid: str, tensors: dict[str, int]) -> int:
        """Room in the node's arena for the bytes of `tensors` it lacks, which it returns.
        Where what loads hold leaves too little: idle residents are stopped, the cheapest
        first (their tensors then make way as the load is placed, but for those it shares),
        then idle instances; else it waits for an instance to go idle, as a start waits for
        memory (`KvMemory.reserve`). NO_CAPACITY once the models in use still leave too little."""
        arena = self.workers.arena
        assert arena is not None
        deadline = time.monotonic() + self.settings.memory_wait_s

        def unshared(aid: str) -> int:
            """What stopping a model's worker could free in the arena: what it holds that
            neither this start, nor another start under way, nor a model in use holds too (its
            worker's own memory is no room here)."""
            kept = self.memory.arena_wanted.keys() | {
                d
                for k, b in self.node.bound.items()
                if k != aid and b.resident.users > 0
                for d in self.node.tensor_bytes.get(k, {})
            }
            return sum(n for d, n in self.node.tensor_bytes.get(aid, {}).items() if d not in tensors and d not in kept)

        def ended(inst: Served, sole: bool) -> int:
            # Its worker stays, an idle resident the next pass prices; only then can what it
            # alone holds go. One whose tensors this start shares makes no room at all.
            return unshared(inst.bound.artifact.artifact_id) if sole else 0

        # Again after each eviction: the evicted model's tensors may have been this one's too.
        while (missing := arena.missing_bytes(tensors)) > (room := arena.room_bytes(tensors)):
            self.node.went_idle.clear()
            residents = [dataclasses.replace(b.resident, nbytes=unshared(k)) for k, b in self.node.bound.items()]
            keys = choose_evictions(residents, missing - room, time.time())
            if keys:
                await self.memory.evict(keys)  # this start's tensors are wanted: they stay
                continue
            if await self.memory.evict_idle_instances(missing - room, ended):
                continue
            try:
                await asyncio.wait_for(self.node.went_idle.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise TesseraError(
                    ErrorCode.NO_CAPACITY,
                    f"artifact {aid} needs {missing} bytes of node {self.node.id}'s tensor arena; the "
                    f"models in use there leave {room}",
                    retry_after_s=2,
                ) from None
        return missing

    def _warm_worker_bytes(self) -> int:
        """A pre-warmed worker's own memory (its runtime, no model): what a worker bound to a
        model in the node's arena holds before its first true-up measures it."""
        return max((w.rss_bytes() for w in self.workers.idle), default=0)

    def _bind(
        self, worker: Worker, artifact: Artifact, loaded: Loaded, source: str, stage_s: float, weights: int, now: float
    ) -> Bound:
        """Record `worker` as bound to `artifact`, in use by the start that loaded it (`now`:
        when that start began, its resident's first use)."""
        aid = artifact.artifact_id
        bound = self.node.bound[aid] = Bound(
            worker,
            artifact,
            loaded.loaded_from_cache,
            Resident(aid, artifact.weight_bytes, loaded.load_s, now, now, users=1),
            source,
            stage_s,
            loaded.load_s,
            loaded.threads,
            weights,
            tensors=frozenset(loaded.resident),
        )
        return bound

    async def _rebind(self, artifact: Artifact) -> Bound | None:
        """Tangram §3.1 on a torch node: the idle worker whose arena holds the most of this
        model's tensors by content hash (a fine-tune's base, or the same weights under another
        artifact) is bound to it, reading only the rest; the model it held stops being
        resident (its tensors stay in that arena, idle, until evicted). None where no idle
        worker shares any tensor: a pre-warmed one loads it."""
        aid = artifact.artifact_id
        tensors = await self._tensors(artifact)
        choice = most_reused(self.node.idle_tensors(), tensors)
        if choice is None:
            return None
        key, shared = choice
        old = self.node.bound.pop(key)  # no await since the check: nobody took it meanwhile
        await self.memory.release(f"weights:{key}")
        weights = max(artifact.weight_bytes, self.memory.footprints.get(aid, 0))
        await self.memory.reserve(f"weights:{aid}", weights)
        try:
            old.worker.on_tier_up = functools.partial(self._on_tier_up, artifact)
            loaded, _ = await self._load(old.worker, artifact, Tier.TORCH, None)
            await self.memory.done(f"weights:{aid}")
        except BaseException:
            await self.memory.release(f"weights:{aid}")
            await asyncio.to_thread(old.worker.stop)  # bound to neither model now
            raise
        log.info(
            "%s bound to the idle worker of %s: %d of its bytes were in that worker's arena",
            aid,
            key,
            loaded.reused_bytes,
            extra={"artifact": aid, "reused_bytes": loaded.reused_bytes, "expected_bytes": shared},
        )
        bound = self._bind(old.worker, artifact, loaded, "arena", 0.0, weights, time.time())
        self.node.update_gauges()
        return bound

    async def _tensors(self, artifact: Artifact) -> dict[str, int]:
        """The artifact's torch tensors, digest → bytes in access order (read once: an
        artifact never changes)."""
        tensors = self.node.tensor_bytes.get(artifact.artifact_id)
        if not tensors:  # none yet: its checkpoint may be written since
            tensors = await asyncio.to_thread(torch_tensor_bytes, artifact)
            if tensors:
                self.node.tensor_bytes[artifact.artifact_id] = tensors
        return tensors

    async def _load(
        self, worker: Worker, artifact: Artifact, tier: Tier, staged: Staged | None
    ) -> tuple[Loaded, float]:
        """Import the staged blob into the worker. On a deferred-verify hit the loader checks
        the copy's blocks meanwhile; a copy found corrupt (or not confirmed) is imported
        again once repaired, so nothing is served from bytes that failed their check.
        Returns the load and how long it then waited for the check."""
        cores = self._start_cores()
        timeout = self.settings.load_timeout_s
        tensors = await self._tensors(artifact) if worker.arena is not None else None
        admit = self._admit_bytes(artifact, tensors)
        if staged is None or staged.verified:
            cache_dir = staged.cache_dir if staged else None
            return await worker.load(artifact, cores, cache_dir, timeout, tier, tensors=tensors, admit_bytes=admit), 0.0
        check = asyncio.ensure_future(self._verified(artifact))
        try:
            # Not streamed: nothing is served from the copy before its check.
            loaded = await worker.load(artifact, cores, staged.cache_dir, timeout, tier, tensors=tensors)
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
        # What the first load copied into the node's arena came from the failed copy: copied again.
        cache_dir = checked.cache_dir if checked else None
        again = await worker.load(artifact, cores, cache_dir, timeout, tier, tensors=tensors, discard=True)
        return again, waited

    def _admit_bytes(self, artifact: Artifact, tensors: dict[str, int] | None) -> int | None:
        """TIDAL Eq. 1 for a start into the node's arena: of the bytes it copies, those to be in
        before its first request runs (`policy.prefetch.admission_bytes`: M_prefetch on a GPU),
        the rest streaming in behind the forward pass. B_h2d is the node's measured fill
        bandwidth and T_TTFT the quickest prefill measured for the model here (else for any
        model here: the smaller, the more copied ahead)."""
        arena = self.workers.arena
        if arena is None or not tensors:
            return None
        own = self.node.perf.get(artifact.artifact_id)
        samples = own.prefill if own and own.prefill else [s for p in self.node.perf.values() for s in p.prefill]
        ttft = min((seconds for _, seconds in samples), default=None)
        return admission_bytes(arena.missing_bytes(tensors), ttft, arena.fill_bps, arena.handle.cuda)

    async def _verified(self, artifact: Artifact) -> Staged | None:
        try:
            reply = await self.bus.request(
                subjects.loader_verify(self.node.id),
                VerifyStaged(artifact_id=artifact.artifact_id),
                Staged | Rejected,
                timeout=self.settings.load_timeout_s,
            )
        except TesseraError as e:
            log.warning("no block check of %s (%s)", artifact.artifact_id, e.message)
            return None
        return reply if isinstance(reply, Staged) else None

    def _on_tier_up(self, artifact: Artifact, msg: TieredUp) -> None:
        self.node.update_gauges()
        if msg.error:
            TIER_UPS.labels("failed").inc()
            log.warning("tier-up of %s failed, staying on the start tier: %s", artifact.artifact_id, msg.error)
            return
        TIER_UPS.labels("done").inc()
        TIER_UP_SECONDS.observe(msg.load_s)
        self.node.core_build_s = msg.load_s
        log.info(
            "%s tiered up to %s in %.2fs",
            artifact.artifact_id,
            msg.tier,
            msg.load_s,
            extra={"artifact": artifact.artifact_id},
        )

    async def _stage(self, artifact: Artifact, tier: Tier) -> Staged | None:
        """The verified form in host memory (the compiled blob, or on a torch or vLLM node the
        torch checkpoint), from this node's loader; None (read the store's copy) if the loader
        cannot be reached, so a start never depends on the cache."""
        try:
            staged = await self.bus.request(
                subjects.loader_stage(self.node.id),
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

    async def on_evict(self, msg: Msg) -> None:
        req = decode(msg.data, EvictResidents)
        keys = [
            k
            for k, b in self.node.bound.items()
            if b.resident.users == 0 and (not req.artifact_id or k == req.artifact_id)
        ]
        freed = await self.memory.evict(keys)
        await self.bus.reply(msg, Evicted(node_id=self.node.id, artifact_ids=tuple(keys), freed_bytes=freed))

    async def on_stop(self, msg: Msg) -> None:
        req = decode(msg.data, StopInstance)
        inst = self.node.instances.get(req.model)
        if inst is None:
            reply = InstanceStopped(node_id=self.node.id, model=req.model, stopped=False, reason="not loaded")
        elif inst.active > 0 or inst.last_used > req.idle_since:
            reply = InstanceStopped(node_id=self.node.id, model=req.model, stopped=False, reason="busy")
        else:
            await self.memory.unload(inst)
            log.info("instance of %s unloaded (idle)", req.model, extra={"model": req.model})
            reply = InstanceStopped(node_id=self.node.id, model=req.model, stopped=True)
        await self.bus.reply(msg, reply)

    async def on_preempt(self, msg: Msg) -> None:
        """The scheduler makes room for a bigger neighbour (LLM-Mesh §7.1): the instance's
        requests end PREEMPTED now, and it unloads once they have."""
        req = decode(msg.data, PreemptInstance)
        inst = self.node.instances.get(req.model)
        if inst is None or inst.preempted:
            reply = InstanceStopped(node_id=self.node.id, model=req.model, stopped=False, reason="not loaded")
        else:
            task = asyncio.create_task(self.memory.preempt(inst, self.node.instances.get(req.for_model)))
            self._preemptions.add(task)
            task.add_done_callback(self._preemptions.discard)
            reply = InstanceStopped(node_id=self.node.id, model=req.model, stopped=True, reason="preempted")
        await self.bus.reply(msg, reply)
