"""Execution pipelines on torch nodes while a scale-out's blocks arrive (FaaScale §4.3).

Once a scale-out's targets together hold every layer of a model, each chosen node runs its layer
range as a stage server (`StartStage`), and the first stage's node serves the model through the
stages (`StartPipelined`): an instance like any other. Mode switching (§4.3): when the node's
own start of the model is done, its local instance takes the new requests, and the pipelined
one finishes those in flight, then its stages end (`EndStage`)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from policy.eviction import Resident
from services.engine.memory import KvMemory
from services.engine.node import Bound, Node, PendingColdStart
from services.engine.worker_wire import Loaded, StageSpec
from shared import subjects
from shared.bus import decode
from shared.errors import TesseraError
from shared.messages import ColdStartPhases, ErrorCode, InstanceReady, ModelRecord, Rejected, Tier
from shared.pipeline_messages import AwaitBlocks, BlocksHeld, EndStage, StageReady, StartPipelined, StartStage

if TYPE_CHECKING:
    from services.engine.worker_pool import Worker

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Pipelines:
    """This node's pipeline stages, and its instances served through other nodes' stages."""

    node: Node
    memory: KvMemory

    async def on_start_stage(self, msg: Msg) -> None:
        await self.node.bus.reply(msg, await self.start_stage(decode(msg.data, StartStage)))

    async def on_start_pipelined(self, msg: Msg) -> None:
        await self.node.bus.reply(msg, await self.start_pipelined(decode(msg.data, StartPipelined)))

    async def on_end_stage(self, msg: Msg) -> None:
        req = decode(msg.data, EndStage)
        entry = self.node.stage_workers.pop(req.addr, None)
        if entry is None:
            return
        worker, _, owner = entry
        await self.memory.release(owner)
        drives = any(i.bound.worker is worker for i in self.node.instances.values())
        if not self.node.runs_stages(worker) and not drives:  # its last stage, and no pipeline of its own
            await asyncio.to_thread(worker.stop)
        log.info("stage %s of %s ended", req.addr, req.artifact_id, extra={"artifact": req.artifact_id})

    async def _blocks(self, what: str, record: ModelRecord, blocks: tuple[int, ...]) -> str:
        """The node's copy of the model once `blocks` of it are here (the loader waits), for
        `what` runs only on a backend with pipeline stages."""
        if not self.node.backend.pipeline_stages:
            raise TesseraError(ErrorCode.INVALID_REQUEST, f"{what} does not run on {self.node.backend.name} nodes")
        timeout = self.node.settings.load_timeout_s
        ask = AwaitBlocks(artifact=record.artifact, blocks=blocks, timeout_s=timeout)
        held = await self.node.bus.request(subjects.loader_await_blocks(self.node.id), ask, BlocksHeld, timeout + 5)
        return held.cache_dir

    async def _load_into_worker(
        self,
        record: ModelRecord,
        cache_dir: str,
        stages: tuple[str, ...] = (),
        stage: StageSpec | None = None,
        owner: str = "",
    ) -> tuple[Worker, Loaded]:
        """Into the live worker running this node's stages of the model (warm workers are few),
        else into a warm one; `stage`'s reservation (`owner`) is released when it ends."""
        aid = record.artifact.artifact_id
        async with self.node.locks[f"stages:{aid}"]:
            worker = next((w for w, a, _ in self.node.stage_workers.values() if a == aid and not w.dead), None)
            fresh = worker is None
            if worker is None:
                worker, _ = await self.node.workers.take()
            try:
                timeout = self.node.settings.load_timeout_s
                loaded = await worker.load(record.artifact, None, cache_dir, timeout, Tier.TORCH, stages, stage)
            except BaseException:
                if fresh:
                    await asyncio.to_thread(worker.stop)
                raise
            if stage is not None:
                self.node.stage_workers[loaded.addr] = (worker, aid, owner)
        return worker, loaded

    async def start_stage(self, req: StartStage) -> StageReady:
        """Run units [lo, hi) of the model (its layers, then its head as unit `layers`) as a
        stage server, once this node's copy holds their blocks."""
        t0 = time.monotonic()
        cache_dir = await self._blocks("a pipeline stage", req.model, req.blocks)
        waited = time.monotonic() - t0
        spec = StageSpec(
            req.lo, min(req.hi, req.layers), req.layers, req.hi > req.layers, self.node.settings.stage_host
        )
        owner = f"stage:{req.model.artifact.artifact_id}:{req.lo}-{req.hi}"
        async with self.memory.reserved(owner, req.nbytes):  # refused when the node has no room: no pipeline
            _, loaded = await self._load_into_worker(req.model, cache_dir, stage=spec, owner=owner)
        log.info(
            "stage [%d, %d) of %s serving at %s (%.2fs for its %d blocks, %.2fs to load)",
            req.lo,
            req.hi,
            req.model.name,
            loaded.addr,
            waited,
            len(req.blocks),
            time.monotonic() - t0 - waited,
            extra={"model": req.model.name, "load_s": loaded.load_s, "waited_s": waited},
        )
        return StageReady(node_id=self.node.id, addr=loaded.addr)

    async def start_pipelined(self, req: StartPipelined) -> InstanceReady | Rejected:
        """Serve the model through `req.stages` until this node's own start of it is done;
        refused when that start was done first."""
        record, name = req.model, req.model.name
        done_first = Rejected(code=ErrorCode.UNAVAILABLE, message=f"{name} runs here already: nothing to bridge")
        t0 = time.monotonic()
        if name in self.node.instances:
            return done_first
        cache_dir = await self._blocks("a pipelined instance", record, req.blocks)
        t1 = time.monotonic()
        worker, loaded = await self._load_into_worker(record, cache_dir, stages=req.stages)
        if name in self.node.instances:  # its own start was done meanwhile
            if not self.node.runs_stages(worker):  # else it goes with its last stage's end
                await asyncio.to_thread(worker.stop)
            return done_first
        now = time.time()
        # Not in the node's `bound`: it holds no weights, and no start may take it as the model's
        # resident worker.
        resident = Resident(record.artifact.artifact_id, 0, 0.0, now, now, 1)
        bound = Bound(worker, record.artifact, replace(loaded, loaded_from_cache=True), resident, "pipeline")
        self.node.pipelined[name] = tuple(zip(req.stage_nodes, req.stages, strict=True))
        phases = ColdStartPhases(init_s=t1 - t0, load_s=time.monotonic() - t1, profile_s=0.0)
        # Never measured (`warm_since`): its times are the pipeline's, not the model's here.
        self.node.serve(record, bound, self.node.kv_account(record.artifact), PendingColdStart(t0, phases, "pipeline"))
        log.info(
            "%s served through a pipeline of %d stages until its replica is here",
            name,
            len(req.stages),
            extra={"model": name, "stages": list(req.stages)},
        )
        return InstanceReady(
            node_id=self.node.id,
            model=name,
            phases=ColdStartPhases(init_s=0.0, load_s=time.monotonic() - t0, profile_s=0.0),
            loaded_from_cache=True,
            source="pipeline",
        )
