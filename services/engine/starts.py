"""Starting and stopping instances: a start binds a pre-warmed worker to the artifact (or finds
it resident), restores its compiled model, reserves its KV, and later tiers up to the
continuous-batching core; a stop, a preemption or an eviction undoes it. A cold start is timed
in four phases (ARCHITECTURE, "A cold start"): Init, Load, Profile, Prefill."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from nats.aio.msg import Msg

from cuda_ext.allocator import ArenaFull
from policy.affinity import most_reused
from policy.eviction import Resident, choose_evictions
from policy.node_cpu import StartTierWorker, next_tier_up, start_cores
from policy.prefetch import admission_bytes
from services.engine import metrics, progress
from services.engine.memory import KvMemory
from services.engine.node import ARENA_REGION, Bound, Node, PendingColdStart, Served
from services.engine.progress import form_bytes, reported
from shared import subjects
from shared.artifact import compiled_cache_dir, has_torch_checkpoint, torch_tensor_bytes
from shared.bus import decode
from shared.cache_messages import Evicted, EvictResidents, StageArtifact, Staged, VerifyStaged
from shared.errors import TesseraError
from shared.messages import (
    Artifact,
    ColdStartPhases,
    ErrorCode,
    ImportModel,
    InstanceReady,
    InstanceStopped,
    ModelImported,
    ModelRecord,
    PreemptInstance,
    Rejected,
    StartInstance,
    StopInstance,
    Tier,
)

if TYPE_CHECKING:
    from services.engine.worker_pool import Worker
    from services.engine.worker_wire import Loaded, TieredUp

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Starts:
    """Starts and stops of instances on the node."""

    node: Node
    memory: KvMemory
    load_growth: dict[str, int] = dataclasses.field(default_factory=dict)
    """Artifact → its worker's resident growth over its last load here: the bytes a load of it
    reads in, which the next one's progress counts against (before one: its blob's size)."""

    async def tier_up_next(self) -> None:
        """Tier up one START worker at a time, once the whole node has been idle for
        `tier_up_idle_s`: the ≈ 1 core-second it takes would otherwise be taken from decoding
        neighbours (measured on 1-core nodes: their TPOT past their SLO)."""
        live = {aid: b.worker for aid, b in self.node.bound.items() if not b.worker.dead}
        workers = [StartTierWorker(aid, w.tier == Tier.START, w.tiering, w.tier_up_failed) for aid, w in live.items()]
        key = next_tier_up(workers, self.node.idle_since(), time.time(), self.node.settings.tier_up_idle_s)
        if key is not None:
            live[key].tier_up()

    async def on_start(self, msg: Msg) -> None:
        req = decode(msg.data, StartInstance)
        try:
            reply: InstanceReady | Rejected = await self.start_instance(req)
        except TesseraError as e:
            reply = Rejected(code=e.code, message=e.message, retry_after_s=e.retry_after_s)
        except Exception as e:
            log.exception("start of %s failed", req.model.name)
            reply = Rejected(code=ErrorCode.ENGINE_FAILED, message=f"start failed: {e}", retry_after_s=1)
        await self.node.bus.reply(msg, reply)

    async def start_instance(self, req: StartInstance) -> InstanceReady:
        name = req.model.name
        if (inst := self.node.instances.get(name)) is not None:
            inst.keep(req.model)  # a pin or an unpin, told by the scheduler
            zero, cached = ColdStartPhases(init_s=0, load_s=0, profile_s=0), inst.bound.loaded.loaded_from_cache
            return InstanceReady(
                node_id=self.node.id, model=name, phases=zero, loaded_from_cache=cached, source="resident"
            )
        if name not in self.node.starting:  # else a second start of the same model waits for the first
            start = self.node.starting[name] = asyncio.ensure_future(self._reported_start(req))
            start.add_done_callback(lambda _: self.node.starting.pop(name))
        return await asyncio.shield(self.node.starting[name])

    async def _reported_start(self, req: StartInstance) -> InstanceReady:
        """A cold start, its progress published (issue 35): the streams waiting for it show it."""
        interval = self.node.settings.progress_interval_s
        async with progress.reporting(self.node.bus, self.node.id, req.model.name, interval):
            return await self._cold_start(req)

    async def _cold_start(self, req: StartInstance) -> InstanceReady:
        record = req.model
        t0 = time.monotonic()
        await self._materialized(record)
        bound, hit, t1 = await self._acquire(record.artifact)
        t2 = time.monotonic()
        await progress.enter("profile")
        try:
            # Profile: KV sizing was measured at registration; here it becomes a reservation.
            kv = self.node.kv_account(record.artifact)
            kv.reserved_bytes = kv.required()  # eq. 2 with nothing running: the L_min floor
            await self.memory.reserve(f"{record.name}:kv", kv.reserved_bytes)
            await self.memory.done(f"{record.name}:kv")  # allocated on demand by the runtime
        except BaseException:
            await self.memory.release_worker(bound)
            raise
        t3 = time.monotonic()
        phases = ColdStartPhases(init_s=t1 - t0, load_s=t2 - t1, profile_s=t3 - t2)
        source = "resident" if hit else bound.source
        self.node.serve(record, bound, kv, PendingColdStart(t0, phases, source))
        metrics.KV_RESERVED.labels(record.name).set(kv.reserved_bytes)
        extra = {"model": record.name, "resident": hit, "worker_pid": bound.worker.pid}
        log.info("instance of %s ready", record.name, extra={**extra, **msgspec.structs.asdict(phases)})
        if not bound.loaded.loaded_from_cache:
            log.warning("%s was compiled at start: its materialized blob is missing", record.name)
        return InstanceReady(
            node_id=self.node.id,
            model=record.name,
            phases=phases,
            loaded_from_cache=bound.loaded.loaded_from_cache,
            source=source,
        )

    async def _materialized(self, record: ModelRecord) -> None:
        """A model registered by an OpenVINO node's loader has no torch checkpoint yet: on a
        node that reads one, this node's loader writes it from the GGUF once, for every node."""
        backend = self.node.backend
        if not backend.reads_torch_checkpoint or await asyncio.to_thread(has_torch_checkpoint, record.artifact):
            return
        log.info("%s has no torch checkpoint yet: this node's loader writes it", record.name)
        ask, timeout = ImportModel(source=record.source), self.node.settings.load_timeout_s
        reply = await self.node.bus.request(
            subjects.loader_import(self.node.id), ask, ModelImported | Rejected, timeout
        )
        if isinstance(reply, Rejected):
            raise TesseraError(reply.code, f"{record.name} cannot start on a {backend.name} node: {reply.message}")

    async def _acquire(self, artifact: Artifact) -> tuple[Bound, bool, float]:
        """A worker bound to the artifact (the resident one, or a pre-warmed one loaded now),
        whether it was resident, and when Init ended (monotonic)."""
        aid = artifact.artifact_id
        async with self.node.locks[aid]:
            now = time.time()
            bound = self.node.bound.get(aid)
            if bound is not None and not bound.worker.dead:
                r = bound.resident
                r.users += 1
                r.uses += 1
                r.last_used = now
                metrics.POOL_HITS.inc()
                return bound, True, time.monotonic()
            arena = self.memory.arena
            if self.node.backend.tensor_arena and arena is None:
                # Without the node's one arena, reuse is only in an idle worker's own.
                rebound = await self._rebind(artifact)
                if rebound is not None:
                    return rebound, False, time.monotonic()
            tensors = await self._tensors(artifact) if arena is not None else {}
            self.memory.arena_wanted.update(tensors.keys())
            try:
                return await self._acquire_new(artifact, tensors, now)
            finally:
                self.memory.arena_wanted.subtract(tensors.keys())
                self.memory.arena_wanted += Counter()  # drops the digests no start wants now

    async def _acquire_new(self, artifact: Artifact, tensors: dict[str, int], now: float) -> tuple[Bound, bool, float]:
        """`_acquire` of a model not bound here: a pre-warmed worker loads it."""
        aid, settings = artifact.artifact_id, self.node.settings
        missing = await self._arena_room(aid, tensors) if tensors else 0
        in_arena = bool(tensors) and missing == 0
        if tensors:
            # Its weights are the arena's reservation; its own is its worker's memory (a
            # pre-warmed one's until a true-up).
            rss = max((w.rss_bytes() for w in self.node.workers.idle), default=0)
            weights = self.memory.footprints.get(aid) or rss or artifact.weight_bytes
        else:
            weights = max(artifact.weight_bytes, self.memory.footprints.get(aid, 0))
        try:
            async with self.memory.reserved(f"weights:{aid}", weights):
                if missing:
                    self.memory.arena_granted = await self.memory.reserve(
                        ARENA_REGION, self.memory.arena_target, held=lambda: self.memory.arena_granted
                    )
                    await self.memory.done(ARENA_REGION)
                t_load = time.monotonic()
                tier = self.node.backend.start_tier_of(
                    artifact, self.node.settings.device, self.node.settings.start_tier
                )
                # The blob first, then the worker: a stage waiting for a scale-out's multicast
                # leaves the warm worker to the pipeline stages meanwhile. With every tensor in the
                # node's arena, nothing is staged.
                stage = StageArtifact(artifact=artifact, device=self.node.settings.device, tier=tier, defer_verify=True)
                staged = (
                    None if in_arena else await self.node.host_copy(subjects.loader_stage(self.node.id), stage, aid)
                )
                stage_s = time.monotonic() - t_load
                worker, warm = await self.node.workers.take()
                if not warm:
                    metrics.COLD_WORKERS.inc()
                # Bytes read: the worker's resident memory grows as the runtime maps the blob in.
                base = worker.rss_bytes()
                form = Path(staged.cache_dir) if staged else compiled_cache_dir(artifact, settings.device, tier)
                total = self.load_growth.get(aid) or form_bytes(form) or artifact.weight_bytes
                try:
                    importing = self._import(worker, artifact, tier, staged)
                    loaded, waited_s = await reported(importing, lambda: worker.rss_bytes() - base, total)
                except BaseException:  # bound to no model: its process goes
                    await asyncio.to_thread(worker.stop)
                    raise
                if (grown := worker.rss_bytes() - base) > 0:
                    self.load_growth[aid] = grown
                stage_s += waited_s
        except ArenaFull as e:  # room for its bytes, but no range long enough
            raise TesseraError(
                ErrorCode.NO_CAPACITY,
                f"artifact {aid} does not fit in node {self.node.id}'s tensor arena: {e}",
                retry_after_s=2,
            ) from e
        finally:
            if tensors:  # what it placed (or, failing, left) there; a concurrent load may have evicted
                await self.memory.sync_arena()
        source = "arena" if in_arena else "host" if staged and staged.hit else "store"
        return self._bind(worker, artifact, loaded, source, stage_s, weights, now), False, t_load

    async def _arena_room(self, aid: str, tensors: dict[str, int]) -> int:
        """Room in the node's arena for the bytes of `tensors` it lacks (returned): idle
        residents stopped, cheapest first, then idle instances, else a wait for one to go idle
        (as `KvMemory.reserve`). NO_CAPACITY once the models in use leave too little."""
        arena = self.memory.arena
        assert arena is not None
        deadline = time.monotonic() + self.node.settings.memory_wait_s

        def unshared(aid: str) -> int:
            """What stopping a model's worker could free in the arena: what neither a start
            under way nor a model in use holds too."""
            kept = self.memory.arena_wanted.keys() | {
                d
                for k, b in self.node.bound.items()
                if k != aid and b.resident.users > 0
                for d in self.node.tensor_bytes.get(k, {})
            }
            return sum(n for d, n in self.node.tensor_bytes.get(aid, {}).items() if d not in tensors and d not in kept)

        def ended(inst: Served, sole: bool) -> int:
            # Its worker stays, an idle resident the next pass prices.
            return unshared(inst.bound.artifact.artifact_id) if sole else 0

        # Again after each eviction: the evicted model's tensors may have been this one's too.
        while (missing := arena.missing_bytes(tensors)) > (room := arena.room_bytes(tensors)):
            self.node.clear_news()
            residents = [dataclasses.replace(b.resident, nbytes=unshared(k)) for k, b in self.node.bound.items()]
            keys = choose_evictions(residents, missing - room, time.time())
            if keys:
                await self.memory.evict(keys)  # this start's tensors are wanted: they stay
                continue
            if await self.memory.evict_idle_instances(missing - room, ended):
                continue
            if not await self.node.wait_news(deadline):
                raise TesseraError(
                    ErrorCode.NO_CAPACITY,
                    f"artifact {aid} needs {missing} bytes of node {self.node.id}'s tensor arena; the "
                    f"models in use there leave {room}",
                    retry_after_s=2,
                )
        return missing

    def _bind(
        self, worker: Worker, artifact: Artifact, loaded: Loaded, source: str, stage_s: float, weights: int, now: float
    ) -> Bound:
        """Record `worker` as bound to `artifact`, in use by the start that loaded it (`now`:
        when that start began, its resident's first use)."""
        aid = artifact.artifact_id
        resident = Resident(aid, artifact.weight_bytes, loaded.load_s, now, now, users=1)
        bound = self.node.bound[aid] = Bound(worker, artifact, loaded, resident, source, stage_s, weights)
        return bound

    async def _rebind(self, artifact: Artifact) -> Bound | None:
        """Tangram §3.1 on a torch node: the idle worker whose arena holds the most of this
        model's tensors by content hash (a fine-tune's base) is bound to it, reading only the
        rest. None where no idle worker shares any tensor: a pre-warmed one loads it."""
        aid = artifact.artifact_id
        tensors = await self._tensors(artifact)
        choice = most_reused(self.node.idle_tensors(), tensors)
        if choice is None:
            return None
        key, shared = choice
        old = self.node.bound.pop(key)  # no await since the check: nobody took it meanwhile
        await self.memory.release(f"weights:{key}")
        weights = max(artifact.weight_bytes, self.memory.footprints.get(aid, 0))
        try:
            async with self.memory.reserved(f"weights:{aid}", weights):
                loaded, _ = await self._import(old.worker, artifact, Tier.TORCH, None)
        except BaseException:  # bound to neither model now
            await asyncio.to_thread(old.worker.stop)
            raise
        log.info(
            "%s bound to the idle worker of %s: %d of its bytes were in that worker's arena",
            aid,
            key,
            loaded.reused_bytes,
            extra={"artifact": aid, "reused_bytes": loaded.reused_bytes, "expected_bytes": shared},
        )
        bound = self._bind(old.worker, artifact, loaded, "arena", 0.0, weights, time.time())
        return bound

    async def _tensors(self, artifact: Artifact) -> dict[str, int]:
        """The artifact's torch tensors, digest → bytes in access order (read once)."""
        tensors = self.node.tensor_bytes.get(artifact.artifact_id)
        if not tensors:  # none yet: its checkpoint may be written since
            tensors = await asyncio.to_thread(torch_tensor_bytes, artifact)
            if tensors:
                self.node.tensor_bytes[artifact.artifact_id] = tensors
        return tensors

    async def _import(
        self, worker: Worker, artifact: Artifact, tier: Tier, staged: Staged | None
    ) -> tuple[Loaded, float]:
        """Import the staged blob into the worker. On a deferred-verify hit the loader checks the
        copy meanwhile; one found corrupt (or unconfirmed) is imported again once repaired.
        Returns the load and how long it then waited for the check."""
        worker.on_tier_up = functools.partial(self._on_tier_up, artifact)
        # A bounded share of cores for a start while other instances generate; else all.
        busy = any(i.active for i in self.node.instances.values())
        cores = start_cores(sorted(os.sched_getaffinity(0)), self.node.settings.start_cpu_share, busy)
        timeout = self.node.settings.load_timeout_s
        tensors = await self._tensors(artifact) if worker.arena is not None else None
        admit = self._admit_bytes(artifact, tensors)
        if staged is None or staged.verified:
            cache_dir = staged.cache_dir if staged else None
            return await worker.load(artifact, cores, cache_dir, timeout, tier, tensors=tensors, admit_bytes=admit), 0.0
        verify = VerifyStaged(artifact_id=artifact.artifact_id)
        check = asyncio.ensure_future(
            self.node.host_copy(subjects.loader_verify(self.node.id), verify, artifact.artifact_id)
        )
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
        metrics.REIMPORTS.inc()
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
        """TIDAL Eq. 1 for a start into the node's arena: the bytes to copy before its first
        request runs (M_prefetch), the rest streaming in behind; B_h2d is the node's measured
        fill bandwidth, T_TTFT the quickest prefill measured for the model (else any) here."""
        arena = self.memory.arena
        if arena is None or not tensors:
            return None
        own = self.node.perf.get(artifact.artifact_id)
        samples = own.prefill if own and own.prefill else [s for p in self.node.perf.values() for s in p.prefill]
        ttft = min((seconds for _, seconds in samples), default=None)
        return admission_bytes(arena.missing_bytes(tensors), ttft, arena.fill_bps, arena.handle.cuda)

    def _on_tier_up(self, artifact: Artifact, msg: TieredUp) -> None:
        if msg.error:
            metrics.TIER_UPS.labels("failed").inc()
            log.warning("tier-up of %s failed, staying on the start tier: %s", artifact.artifact_id, msg.error)
            return
        metrics.TIER_UPS.labels("done").inc()
        metrics.TIER_UP_SECONDS.observe(msg.load_s)
        self.node.core_build_s = msg.load_s
        aid = artifact.artifact_id
        log.info("%s tiered up to %s in %.2fs", aid, msg.tier, msg.load_s, extra={"artifact": aid})

    async def on_evict(self, msg: Msg) -> None:
        req = decode(msg.data, EvictResidents)
        idle = [k for k, b in self.node.bound.items() if b.resident.users == 0]
        keys = [k for k in idle if not req.artifact_id or k == req.artifact_id]
        freed = await self.memory.evict(keys)
        await self.node.bus.reply(msg, Evicted(node_id=self.node.id, artifact_ids=tuple(keys), freed_bytes=freed))

    async def on_stop(self, msg: Msg) -> None:
        req = decode(msg.data, StopInstance)
        inst = self.node.instances.get(req.model)
        reason = "not loaded" if inst is None else "busy" if inst.active or inst.last_used > req.idle_since else ""
        if inst is not None and not reason:
            await self.memory.unload(inst)
            log.info("instance of %s unloaded (idle)", req.model, extra={"model": req.model})
        resident = tuple(sorted(self.node.holdings()[0]))
        await self.node.bus.reply(
            msg,
            InstanceStopped(
                node_id=self.node.id, model=req.model, stopped=not reason, reason=reason, resident=resident
            ),
        )

    async def on_preempt(self, msg: Msg) -> None:
        """The scheduler makes room for a bigger neighbour (LLM-Mesh §7.1)."""
        req = decode(msg.data, PreemptInstance)
        inst = self.node.instances.get(req.model)
        ok = inst is not None and not inst.preempted
        if inst is not None and ok:
            self.node.spawn(self.memory.preempt(inst, self.node.instances.get(req.for_model)))
        reason = "preempted" if ok else "not loaded"
        await self.node.bus.reply(
            msg, InstanceStopped(node_id=self.node.id, model=req.model, stopped=ok, reason=reason)
        )
