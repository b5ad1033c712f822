"""Generating: a request admitted to an instance's KV, run in its worker, its tokens streamed
to the gateway, its cancellation, and the measurements taken on the way."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec
from nats.aio.msg import Msg

from policy.slo import ttft_slo
from services.engine import adapters, metrics
from services.engine.memory import KvMemory
from services.engine.node import Cancelled, Node, Samples, Served, WorkerDied
from services.engine.worker_wire import Chunk, Run
from shared import subjects
from shared.bus import decode
from shared.errors import TesseraError
from shared.messages import (
    Cancel,
    ColdStartRecorded,
    ErrorCode,
    Failed,
    Finished,
    FinishReason,
    Generate,
    GenerateAccepted,
    TokenChunk,
)

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Requests:
    """The requests of the node's instances, from their admission to their last message."""

    node: Node
    memory: KvMemory

    async def on_cancel(self, msg: Msg) -> None:
        self.node.cancel(decode(msg.data, Cancel).request_id, by_client=True)

    async def on_generate(self, msg: Msg) -> None:
        req = decode(msg.data, Generate)
        inst = self.node.instances.get(req.model)
        if inst is None or inst.preempted:
            why = f"{req.model} is not loaded on {self.node.id}"
            failed = Failed(request_id=req.request_id, code=ErrorCode.INSTANCE_NOT_LOADED, message=why)
            await self.node.bus.reply(msg, failed)
            return
        received, stage_s = time.monotonic(), 0.0
        cancelled = Cancelled()
        self.node.cancels[req.request_id] = (cancelled, inst.bound)
        inst.prompts[req.request_id] = req.prompt_tokens
        inst.drained.clear()
        self.node.batch_grew.set()  # a KV growth waiting for room may now preempt a smaller batch
        inst.last_used = time.time()
        await self.node.bus.reply(msg, GenerateAccepted(request_id=req.request_id))
        # In use from here (its keep-alive cannot drop it meanwhile); booked at its first use.
        first_use = req.adapter is not None and adapters.begin(inst, req.adapter)
        try:
            try:
                if req.adapter is not None and first_use:
                    await self.memory.book_adapter(inst, req.adapter)
                    stage_s = await adapters.stage(self.node, inst, req.adapter)
                await self.memory.kv_admit(inst, req)
            except TesseraError as e:
                if first_use and req.adapter is not None:
                    inst.adapters.pop(req.adapter.name, None)  # never loaded
                metrics.REQUESTS.labels("error").inc()
                failed = Failed(request_id=req.request_id, code=e.code, message=e.message)
                await self.node.bus.publish(req.stream_subject, failed)
                return
            await self._generate(inst, req, cancelled, received, stage_s)
        finally:
            if req.adapter is not None:
                adapters.end(inst, req.adapter)
            del inst.prompts[req.request_id]
            inst.held.pop(req.request_id, None)
            inst.evicted.discard(req.request_id)
            inst.last_used = time.time()
            del self.node.cancels[req.request_id]
            self.node.beat_due.set()  # its room is free: tell the scheduler's line soon
            if inst.active == 0:
                inst.drained.set()
                self.node.went_idle.set()  # a start waiting for memory may take this one's

    async def _generate(
        self, inst: Served, req: Generate, cancelled: Cancelled, received: float, stage_s: float
    ) -> None:
        """`received`: time.monotonic() at its arrival; `stage_s`: what its adapter's host-cache
        copy took before it (its first use on the instance)."""
        rid, interval = req.request_id, self.node.settings.stream_interval_s
        slo = ttft_slo(inst, req.prompt_tokens)
        adapter = None if req.adapter is None else adapters.as_loaded(inst, req.adapter)
        run = Run(
            rid,
            inst.model,
            req.prompt_ids,
            req.params,
            interval,
            inst.kv.reserved_tokens,
            received,
            slo,
            inst.tpot_slo_s,
            adapter,
        )
        generated, completion, reason = 0, 0, FinishReason.CANCELLED
        final: Failed | None = None

        def started(batch: int) -> None:
            metrics.QUEUE_WAIT.observe(time.monotonic() - received)
            metrics.BATCHED_REQUESTS.labels(str(batch)).inc()
            inst.held[rid] = req.prompt_tokens

        try:
            async for out in inst.bound.worker.generate(run, cancelled, started):
                if isinstance(out, Chunk):
                    metrics.DECODED_TOKENS.inc(out.tokens)
                    generated += out.tokens
                    if rid in inst.held:
                        inst.held[rid] = req.prompt_tokens + generated
                    await self.memory.kv_progress(inst, rid, generated)
                    chunk = TokenChunk(request_id=rid, text=out.text, tokens=out.tokens, logprobs=out.logprobs)
                    await self.node.bus.publish(req.stream_subject, chunk)
                    continue
                if received >= inst.warm_since and not out.beside_build:
                    # Requests that arrived before the start's first token shared the start:
                    # no measure of the model (they made the scheduler predict a 2 s prefill).
                    self.node.perf.setdefault(inst.bound.artifact.artifact_id, Samples()).add(out)
                if self.node.settings.interleave:
                    metrics.GATE_WAIT.observe(out.gated_s)
                if out.kv_allocated_bytes:
                    metrics.KV_ALLOCATED.labels(inst.model).set(out.kv_allocated_bytes)
                    inst.bound.kv_allocated_bytes = out.kv_allocated_bytes
                inst.bound.device_bytes = out.device_bytes or inst.bound.device_bytes
                reason, completion = out.finish_reason, out.completion_tokens
                if out.first_token_at is not None:
                    metrics.TTFT.observe(out.first_token_at - received)
                    await self._maybe_record_cold_start(inst, out.first_token_at)
                    if adapter is not None and out.adapter_load is not None:
                        adapters.loaded(inst, adapter.name, out.adapter_load)
                        record = adapters.cold_start(
                            self.node.id,
                            adapter,
                            out.adapter_load,
                            received,
                            out.first_token_at,
                            adapters.source(inst, adapter),
                            stage_s,
                        )
                        await self.node.bus.publish(subjects.cold_start_recorded(), record)
            preempted = inst.preempted or rid in inst.evicted
            if reason is FinishReason.CANCELLED and preempted and not cancelled.by_client:
                why = (
                    f"the instance of {inst.model} on {self.node.id} was preempted"
                    if inst.preempted
                    else f"evicted from the KV cache of {inst.model} on {self.node.id}, which could not grow"
                )
                final = Failed(request_id=rid, code=ErrorCode.PREEMPTED, message=why)
        except WorkerDied as e:
            log.error("worker of %s died during %s", inst.model, rid)
            why = f"the worker serving {inst.model} died ({e}); retry the request"
            final = Failed(request_id=rid, code=ErrorCode.ENGINE_FAILED, message=why)
            await self.memory.lose_worker(inst.bound)
        except Exception as e:
            log.exception("generation %s failed", rid)
            final = Failed(request_id=rid, code=ErrorCode.ENGINE_FAILED, message=str(e))
            if inst.bound.source == "pipeline" and self.node.instances.get(inst.model) is inst:
                # A stage is gone: the pipeline serves nothing more. The scheduler hears of it
                # now and sends the next requests to an instance.
                await self.memory.unload(inst)
                await self.node.beat()
        outcome = reason.value if final is None else "preempted" if final.code is ErrorCode.PREEMPTED else "error"
        metrics.REQUESTS.labels(outcome).inc()
        ended = Finished(
            request_id=rid, finish_reason=reason, prompt_tokens=req.prompt_tokens, completion_tokens=completion
        )
        await self.node.bus.publish(req.stream_subject, final or ended)
        await self.memory.kv_complete(inst, rid, generated, not final and reason is not FinishReason.CANCELLED)

    async def _maybe_record_cold_start(self, inst: Served, first_token_at: float) -> None:
        pending, inst.start = inst.start, None
        if pending is None:
            return
        if inst.bound.source != "pipeline":  # a pipeline's times are no measure of the model here
            inst.warm_since = first_token_at
        self.node.workers.start_done()
        p = pending.phases
        ready_at = pending.t0 + p.init_s + p.load_s + p.profile_s
        phases = msgspec.structs.replace(p, prefill_s=max(0.0, first_token_at - ready_at))
        total = first_token_at - pending.t0
        for name in ("init", "load", "profile", "prefill"):
            metrics.PHASE_SECONDS.labels(name).observe(getattr(phases, f"{name}_s"))
        metrics.COLD_START_SECONDS.observe(total)
        loaded = pending.source != "resident"  # else no load of its own
        event = ColdStartRecorded(
            node_id=self.node.id,
            model=inst.model,
            started_at=time.time() - (time.monotonic() - pending.t0),
            phases=phases,
            total_s=total,
            loaded_from_cache=inst.bound.loaded.loaded_from_cache,
            source=pending.source,
            stage_s=inst.bound.stage_s * loaded,
            worker_load_s=inst.bound.loaded.load_s * loaded,
            load_threads=inst.bound.loaded.threads * loaded,
            tier=inst.bound.worker.tier or "",
        )
        extra = {"model": inst.model, "phases": msgspec.structs.asdict(phases), "source": pending.source}
        log.info("cold start of %s: %.2fs", inst.model, total, extra={**extra, "tier": inst.bound.worker.tier})
        await self.node.bus.publish(subjects.cold_start_recorded(), event)
