"""Engine bus handlers: start and stop instances, generate, cancel, heartbeat, cold-start log.

A cold start is timed in four phases (ARCHITECTURE, "A cold start"): Init (runtime objects
for the instance), Load (weights onto the device), Profile (KV sizing and the memory
reservation), Prefill (the first token of the request that caused the start).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openvino as ov
from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge, Histogram

from services.engine.instance import GenerationResult, Instance, LoadedModel
from services.engine.pool import Resident, choose_evictions, over_budget
from services.engine.settings import EngineSettings
from shared import subjects
from shared.bus import Bus, decode
from shared.errors import TesseraError
from shared.messages import (
    Artifact,
    Cancel,
    EvictResidents,
    Evicted,
    ColdStartPhases,
    ColdStartRecorded,
    ErrorCode,
    Failed,
    Finished,
    FinishReason,
    Generate,
    GenerateAccepted,
    InstanceReady,
    InstanceStopped,
    InstanceView,
    NodeStatus,
    Rejected,
    Release,
    Reserve,
    ReserveResult,
    StartInstance,
    StopInstance,
    TokenChunk,
)

log = logging.getLogger(__name__)

PHASE_SECONDS = Histogram(
    "tessera_coldstart_phase_seconds",
    "Seconds spent in each phase of a cold start",
    ["phase"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32),
)
COLD_START_SECONDS = Histogram(
    "tessera_coldstart_seconds",
    "Start request received to first token of the request that caused it",
    buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32),
)
DECODED_TOKENS = Counter("tessera_engine_decoded_tokens_total", "Tokens decoded by this engine")
REQUESTS = Counter("tessera_engine_requests_total", "Generations ended", ["finish_reason"])
INSTANCES = Gauge("tessera_engine_instances", "Model instances loaded on this engine")
RESIDENT_BYTES = Gauge("tessera_engine_resident_model_bytes", "Bytes of compiled models held, in use or not")
POOL_IDLE_BYTES = Gauge(
    "tessera_engine_pool_idle_bytes", "Bytes of compiled models kept resident with no instance (reusable)"
)
POOL_HITS = Counter("tessera_engine_pool_hits_total", "Starts that found their model resident")
POOL_EVICTIONS = Counter("tessera_engine_pool_evictions_total", "Resident models evicted")
TTFT = Histogram(
    "tessera_engine_ttft_seconds",
    "Generate received to first token, in the engine",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8),
)


class EngineService:
    def __init__(self, settings: EngineSettings, bus: Bus) -> None:
        self.settings = settings
        self.bus = bus
        self.node = settings.node_id
        self.instances: dict[str, Instance] = {}
        self._starting: dict[str, asyncio.Future[InstanceReady]] = {}
        # Pending first tokens of fresh instances: model → (start time, phases so far).
        self._cold: dict[str, tuple[float, ColdStartPhases, str]] = {}
        self.residents: dict[str, tuple[Resident, LoadedModel]] = {}
        self._artifact_locks: dict[str, asyncio.Lock] = {}
        self._cancels: dict[str, threading.Event] = {}
        # Loads get a pool of their own so that a cold start never waits behind generations.
        self._load_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="load")
        self.core = ov.Core()
        self._gen_pool = ThreadPoolExecutor(
            max_workers=settings.max_concurrent_generations, thread_name_prefix="gen"
        )
        self._heartbeat_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.bus.subscribe(subjects.engine_start(self.node), self.on_start)
        await self.bus.subscribe(subjects.engine_stop(self.node), self.on_stop)
        await self.bus.subscribe(subjects.engine_generate(self.node), self.on_generate)
        await self.bus.subscribe(subjects.engine_cancel(self.node), self.on_cancel)
        await self.bus.subscribe(subjects.engine_evict(self.node), self.on_evict)
        # A restarted engine holds nothing: drop whatever an earlier run had reserved.
        await self._release_memory("*")
        self._heartbeat_task = asyncio.create_task(self._heartbeat())

    async def close(self) -> None:
        if self._heartbeat_task:
            self._heartbeat_task.cancel()
        for ev in self._cancels.values():
            ev.set()
        self._gen_pool.shutdown(wait=False, cancel_futures=True)
        self._load_pool.shutdown(wait=False, cancel_futures=True)

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
                    weight_bytes=i.artifact.weight_bytes,
                )
                for i in self.instances.values()
            ),
            starting=tuple(self._starting),
            memory_used_bytes=sum(r.nbytes for r, _ in self.residents.values()),
        )

    async def _heartbeat(self) -> None:
        while True:
            try:
                if self.bus.connected.is_set():
                    await self.bus.publish(subjects.node_heartbeat(), self.status())
            except Exception:
                log.exception("heartbeat failed")
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    # --- memory ------------------------------------------------------------------------------

    async def _reserve_memory(self, owner: str, nbytes: int) -> ReserveResult:
        return await self.bus.request(
            subjects.memory_reserve(self.node),
            Reserve(owner=owner, nbytes=nbytes),
            ReserveResult,
            timeout=self.settings.memory_request_timeout_s,
        )

    async def _release_memory(self, owner: str) -> None:
        try:
            await self.bus.publish(subjects.memory_release(self.node), Release(owner=owner))
        except Exception:
            log.warning("could not release memory of %s", owner)

    # --- start / stop ------------------------------------------------------------------------

    async def on_start(self, msg: Msg) -> None:
        req = decode(msg.data, StartInstance)
        try:
            reply: InstanceReady | Rejected = await self.start_instance(req)
        except TesseraError as e:
            reply = Rejected(code=e.code, message=e.message, retry_after_s=e.retry_after_s)
        except Exception as e:
            log.exception("start of %s failed", req.model.name)
            reply = Rejected(code=ErrorCode.ENGINE_FAILED, message=f"start failed: {e}")
        await self.bus.reply(msg, reply)

    async def start_instance(self, req: StartInstance) -> InstanceReady:
        name = req.model.name
        if name in self.instances:
            return InstanceReady(
                node_id=self.node,
                model=name,
                phases=ColdStartPhases(init_s=0, load_s=0, profile_s=0),
                already_running=True,
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
        t0 = time.perf_counter()
        started_at = time.time()
        # Init: the runtime is imported with the engine process; what is left is finding the
        # model resident, or admitting its weights into the node's memory budget.
        loaded, resident, t1 = await self._acquire(record.artifact)
        t2 = time.perf_counter()
        try:
            # Profile: KV sizing was measured once at registration (bytes per token); here it
            # only becomes a reservation for a full context.
            kv_bytes = record.artifact.kv_bytes_per_token * record.artifact.context_length
            await self._reserve(f"{record.name}:kv", kv_bytes)
        except BaseException:
            await self._release(record.artifact.artifact_id)
            raise
        t3 = time.perf_counter()
        phases = ColdStartPhases(init_s=t1 - t0, load_s=t2 - t1, profile_s=t3 - t2)
        now = time.time()
        inst = Instance(model=record.name, loaded=loaded, loaded_at=now, last_used=now)
        self.instances[record.name] = inst
        INSTANCES.set(len(self.instances))
        self._cold[record.name] = (t0, phases, "resident" if resident else "store")
        log.info(
            "instance of %s ready",
            record.name,
            extra={"model": record.name, "init_s": phases.init_s, "load_s": phases.load_s,
                   "profile_s": phases.profile_s, "started_at": started_at, "resident": resident},
        )
        if not loaded.loaded_from_cache:
            log.warning("%s was compiled at start: its materialized blob is missing", record.name)
        return InstanceReady(node_id=self.node, model=record.name, phases=phases,
                             loaded_from_cache=loaded.loaded_from_cache)

    # --- resident models (Tangram reuse) -----------------------------------------------------

    async def _acquire(self, artifact: Artifact) -> tuple[LoadedModel, bool, float]:
        """The artifact's loaded model, from the resident pool or from the store; returns it,
        whether it was resident, and when the load began (end of Init)."""
        aid = artifact.artifact_id
        async with self._artifact_locks.setdefault(aid, asyncio.Lock()):
            now = time.time()
            if aid in self.residents:
                r, loaded = self.residents[aid]
                r.users += 1
                r.uses += 1
                r.last_used = now
                POOL_HITS.inc()
                self._update_pool_metrics()
                return loaded, True, time.perf_counter()
            await self._reserve(f"weights:{aid}", artifact.weight_bytes)
            t_load = time.perf_counter()
            try:
                loaded = await asyncio.get_running_loop().run_in_executor(
                    self._load_pool, LoadedModel.load, self.core, artifact,
                    self.settings.device, self.settings.inference_threads,
                )
            except BaseException:
                await self._release_memory(f"weights:{aid}")
                raise
            reload_s = time.perf_counter() - t_load
            self.residents[aid] = (Resident(aid, artifact.weight_bytes, reload_s, now, now, users=1), loaded)
            self._update_pool_metrics()
            return loaded, False, t_load

    async def _release(self, aid: str) -> None:
        """An instance stopped using the artifact: it stays resident within the pool budget."""
        r, _ = self.residents[aid]
        r.users -= 1
        r.last_used = time.time()
        excess = over_budget((r for r, _ in self.residents.values()), self.settings.pool_budget_bytes)
        if excess:
            await self._evict(choose_evictions((r for r, _ in self.residents.values()), excess, time.time()))
        self._update_pool_metrics()

    async def _evict(self, keys: list[str]) -> int:
        freed = 0
        for key in keys:
            r, loaded = self.residents.pop(key)
            del loaded  # the compiled model's memory goes with its last reference
            freed += r.nbytes
            await self._release_memory(f"weights:{key}")
            POOL_EVICTIONS.inc()
            log.info("evicted resident model %s (%d bytes)", key, r.nbytes)
        self._update_pool_metrics()
        return freed

    def _update_pool_metrics(self) -> None:
        RESIDENT_BYTES.set(sum(r.nbytes for r, _ in self.residents.values()))
        POOL_IDLE_BYTES.set(sum(r.nbytes for r, _ in self.residents.values() if r.users == 0))

    async def _reserve(self, owner: str, nbytes: int) -> None:
        """Reserve, evicting idle residents at the lowest cost if the node is full."""
        result = await self._reserve_memory(owner, nbytes)
        if result.granted:
            return
        need = nbytes - (result.budget_bytes - result.used_bytes)
        keys = choose_evictions((r for r, _ in self.residents.values()), need, time.time())
        if keys:
            await self._evict(keys)
            result = await self._reserve_memory(owner, nbytes)
            if result.granted:
                return
        raise TesseraError(
            ErrorCode.NO_CAPACITY,
            f"node {self.node} has {result.budget_bytes - result.used_bytes} bytes free, {nbytes} needed",
            retry_after_s=2,
        )

    async def on_evict(self, msg: Msg) -> None:
        req = decode(msg.data, EvictResidents)
        keys = [k for k, (r, _) in self.residents.items()
                if r.users == 0 and (not req.artifact_id or k == req.artifact_id)]
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
            del self.instances[req.model]
            self._cold.pop(req.model, None)
            INSTANCES.set(len(self.instances))
            inst.release_kv()
            await self._release_memory(f"{req.model}:kv")
            await self._release(inst.artifact.artifact_id)
            log.info("instance of %s unloaded (idle)", req.model, extra={"model": req.model})
            reply = InstanceStopped(node_id=self.node, model=req.model, stopped=True)
        await self.bus.reply(msg, reply)

    # --- generation --------------------------------------------------------------------------

    async def on_cancel(self, msg: Msg) -> None:
        req = decode(msg.data, Cancel)
        ev = self._cancels.get(req.request_id)
        if ev is not None:
            ev.set()

    async def on_generate(self, msg: Msg) -> None:
        req = decode(msg.data, Generate)
        inst = self.instances.get(req.model)
        if inst is None:
            await self.bus.reply(
                msg,
                Failed(request_id=req.request_id, code=ErrorCode.INSTANCE_NOT_LOADED,
                       message=f"{req.model} is not loaded on {self.node}"),
            )
            return
        cancelled = threading.Event()
        self._cancels[req.request_id] = cancelled
        inst.active += 1
        inst.last_used = time.time()
        await self.bus.reply(msg, GenerateAccepted(request_id=req.request_id))
        try:
            await self._generate(inst, req, cancelled)
        finally:
            inst.active -= 1
            inst.last_used = time.time()
            del self._cancels[req.request_id]

    async def _generate(self, inst: Instance, req: Generate, cancelled: threading.Event) -> None:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[TokenChunk | None] = asyncio.Queue()
        received = time.perf_counter()

        def emit(text: str, tokens: int) -> None:  # on the generation thread
            loop.call_soon_threadsafe(
                chunks.put_nowait, TokenChunk(request_id=req.request_id, text=text, tokens=tokens)
            )

        async def pump() -> None:
            while (chunk := await chunks.get()) is not None:
                DECODED_TOKENS.inc(chunk.tokens)
                await self.bus.publish(req.stream_subject, chunk)

        pumping = asyncio.create_task(pump())
        final: Finished | Failed
        try:
            result: GenerationResult = await loop.run_in_executor(
                self._gen_pool, inst.generate, req.prompt_ids, req.params, emit, cancelled,
                self.settings.stream_interval_s,
            )
            final = Finished(
                request_id=req.request_id,
                finish_reason=result.finish_reason,
                prompt_tokens=req.prompt_tokens,
                completion_tokens=result.completion_tokens,
            )
            REQUESTS.labels(result.finish_reason.value).inc()
            if result.first_token_at is not None:
                TTFT.observe(result.first_token_at - received)
                await self._maybe_record_cold_start(inst, result.first_token_at)
        except Exception as e:
            log.exception("generation %s failed", req.request_id)
            REQUESTS.labels("error").inc()
            final = Failed(request_id=req.request_id, code=ErrorCode.ENGINE_FAILED, message=str(e))
        finally:
            loop.call_soon_threadsafe(chunks.put_nowait, None)
            await pumping
        await self.bus.publish(req.stream_subject, final)

    async def _maybe_record_cold_start(self, inst: Instance, first_token_at: float) -> None:
        model = inst.model
        pending = self._cold.pop(model, None)
        if pending is None:
            return
        t0, phases, source = pending
        loaded = t0 + phases.init_s + phases.load_s + phases.profile_s
        phases = ColdStartPhases(
            init_s=phases.init_s,
            load_s=phases.load_s,
            profile_s=phases.profile_s,
            prefill_s=max(0.0, first_token_at - loaded),
        )
        total = first_token_at - t0
        for name in ("init", "load", "profile", "prefill"):
            PHASE_SECONDS.labels(name).observe(getattr(phases, f"{name}_s"))
        COLD_START_SECONDS.observe(total)
        event = ColdStartRecorded(
            node_id=self.node,
            model=model,
            started_at=time.time() - (time.perf_counter() - t0),
            phases=phases,
            total_s=total,
            loaded_from_cache=inst.loaded_from_cache,
            source=source,
        )
        log.info("cold start of %s: %.2fs", model, total, extra={"model": model, "phases": {
            "init_s": phases.init_s, "load_s": phases.load_s,
            "profile_s": phases.profile_s, "prefill_s": phases.prefill_s}})
        await self.bus.publish(subjects.cold_start_recorded(), event)
