"""Loader bus handlers: import a source (a GGUF, a Hugging Face checkpoint, an OpenVINO IR
directory) into the model store, once per content, weight format and runtime."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path
from typing import Any, TypeVar

import openvino as ov
from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge, Histogram

from policy.adapters import AdapterRefused
from policy.multicast import STORE, pipecast
from services.loader.adapters import import_adapter
from services.loader.formats import REFUSED_EXIT
from services.loader.hostcache import ADAPTER_ENTRY, HostCache, StageResult, block_set, forget_store_pages
from services.loader.layout import stage_layout
from services.loader.peer import BlockServer, BlockSource, DirectoryStore, Holding, Link, PeerSource, receive
from services.loader.settings import LoaderSettings
from services.loader.sources import (
    SHOWN_SOURCE_CHARS,
    ImportRefused,
    adapter_source,
    kept_weight_format,
    model_source,
    readable,
    shown,
)
from services.loader.store import artifact_dir, artifact_id, read_artifact, sha256_of, sha256_of_dir
from shared import subjects
from shared.adapters import AdapterImported, ImportAdapter, StageAdapter, read_manifest
from shared.artifact import compiled_cache_dir, is_materialized, reads_torch_checkpoint
from shared.bus import Bus, decode
from shared.cache_messages import (
    CachedArtifact,
    CacheStatus,
    Evicted,
    EvictHostCache,
    Multicast,
    MulticastDone,
    StageArtifact,
    Staged,
    VerifyStaged,
)
from shared.messages import Artifact, ErrorCode, ImportModel, ModelImported, Rejected, SourceFormat, Tier, WeightFormat
from shared.pipeline_messages import AwaitBlocks, BlocksHeld, LayoutQuery, StageLayout

log = logging.getLogger(__name__)
T = TypeVar("T")

IMPORT_SECONDS = Histogram(
    "tessera_loader_import_seconds",
    "Seconds to import a GGUF into the model store",
    ["converted"],
    buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 40, 80, 160),
)


HOST_CACHE_BYTES = Gauge("tessera_loader_host_cache_bytes", "Bytes of blobs in the host block cache")
HOST_CACHE_BUDGET = Gauge("tessera_loader_host_cache_budget_bytes", "Budget of the host block cache")
HOST_CACHE_ENTRIES = Gauge("tessera_loader_host_cache_entries", "Artifacts in the host block cache")
STAGES = Counter("tessera_loader_stages_total", "Artifacts staged for a start", ["result"])
MULTICAST_BLOCKS = Counter(
    "tessera_loader_multicast_blocks_total",
    "Blocks received by multicast, by where they came from",
    ["source"],
)
RECEIVED_BLOCKS = Gauge(
    "tessera_loader_multicast_received_blocks", "Blocks the multicast under way (or the last one) has received"
)
SERVED_BLOCKS = Counter("tessera_loader_served_blocks_total", "Blocks this node's block server has sent to other nodes")
REPAIRED_BLOCKS = Counter(
    "tessera_loader_corrupt_blocks_total", "Cached blocks that failed their checksum and were re-read"
)
STAGE_SECONDS = Histogram(
    "tessera_loader_stage_seconds",
    "Seconds to stage an artifact in host memory",
    ["result"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4),
)


STAGE_WAITS_FOR_MULTICAST_S = 60.0
"""Longest a start's stage waits for a multicast of its artifact under way before it reads
the store instead."""


class LoaderService:
    def __init__(self, settings: LoaderSettings, bus: Bus) -> None:
        self.settings = settings
        self.bus = bus
        self.store = settings.model_store.resolve()
        self._locks: dict[str, asyncio.Lock] = {}
        self._stage_lock = asyncio.Lock()
        self._checks: dict[str, asyncio.Future[StageResult]] = {}
        self._holdings: dict[str, Holding] = {}
        """The copies arriving by multicast, by artifact: a pipeline stage waits on their blocks."""
        self._holding_made = asyncio.Condition()
        """Notified as each arriving copy gets its place (a multicast's first moments)."""
        """Block checks of deferred-verify hits, by artifact, until the engine asks."""
        self._fills: dict[str, asyncio.Task[None]] = {}
        """Pending host-cache fills by artifact: an eviction cancels them, or it would be undone."""
        self.peers = BlockServer(Link(settings.link_bps), on_served=lambda _: SERVED_BLOCKS.inc())
        """Serves the blocks of what the host cache holds to other nodes (FaaScale §4)."""
        # A copy that leaves the cache (an eviction, or room made for another) is no longer
        # served to other nodes.
        self.cache = HostCache(
            settings.host_cache_dir / settings.node_id, settings.host_cache_bytes, on_evict=self.peers.withdraw_artifact
        )
        HOST_CACHE_BUDGET.set(settings.host_cache_bytes)
        self.peer_addr = ""
        self._receiving: dict[str, asyncio.Future[None]] = {}
        """Multicasts under way, by artifact: a stage of it waits for the copy; a fill skips it."""

    async def close(self) -> None:
        """Nothing of its own to stop: its subscriptions end with the runtime's bus."""

    async def start(self) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        node = self.settings.node_id
        await self.bus.subscribe(subjects.import_model(), self.on_import, queue=subjects.LOADER_QUEUE)
        await self.bus.subscribe(subjects.import_adapter(), self.on_import_adapter, queue=subjects.LOADER_QUEUE)
        await self.bus.subscribe(subjects.loader_import(node), self.on_import)
        await self.bus.subscribe(subjects.loader_stage(node), self.on_stage)
        await self.bus.subscribe(subjects.loader_verify(node), self.on_verify)
        await self.bus.subscribe(subjects.loader_stage_adapter(node), self.on_stage_adapter)
        await self.bus.subscribe(subjects.loader_evict(node), self.on_evict)
        await self.bus.subscribe(subjects.loader_cache(node), self.on_cache)
        self.peer_addr = await self.peers.start(self.settings.peer_host, self.settings.peer_port)
        await self.bus.subscribe(subjects.loader_multicast(node), self.on_multicast)
        await self.bus.subscribe(subjects.loader_layout(node), self.on_layout)
        await self.bus.subscribe(subjects.loader_await_blocks(node), self.on_await_blocks)

    def _update_gauges(self) -> None:
        HOST_CACHE_BYTES.set(self.cache.used_bytes)
        HOST_CACHE_ENTRIES.set(len(self.cache.entries))

    async def on_stage(self, msg: Msg) -> None:
        req = decode(msg.data, StageArtifact)
        aid = req.artifact.artifact_id
        t0 = time.perf_counter()
        if aid in self._receiving:
            # Its blocks are on their way from other nodes (a scale-out's multicast): wait for
            # them and stage the copy, rather than read the store beside it.
            # Bounded: a slow multicast must not outlast the start; one that failed (or was
            # cancelled) leaves the store to read.
            await asyncio.wait({self._receiving[aid]}, timeout=STAGE_WAITS_FOR_MULTICAST_S)
        replied = False  # a deferred check answers early, before its blocks are checked
        try:
            # One stage at a time: the cache's bookkeeping is not shared between threads. The
            # lock is held until the blocks are checked, so no eviction or fill can touch the
            # copy while an engine imports it.
            async with self._stage_lock:
                if self.cache.lookup(req.artifact, req.tier) is None:
                    # A miss: the start reads the store's copy now, and the cache fills behind
                    # it, off the start's critical path (TIDAL §5.2: overlap loading).
                    STAGES.labels("miss").inc()
                    await self.bus.reply(
                        msg,
                        Staged(
                            cache_dir=str(compiled_cache_dir(req.artifact, req.device, req.tier)),
                            hit=False,
                            repaired_blocks=0,
                        ),
                    )
                    replied = True
                    self._schedule_fill(req.artifact, req.device, req.tier)
                    return
                checked: asyncio.Future[StageResult] | None = None
                if req.defer_verify:
                    # The engine imports the copy while its blocks are checked here (the check
                    # is ≈ 0.1 s of a start otherwise); it asks for the result before serving.
                    checked = self._checks[aid] = asyncio.get_running_loop().create_future()
                    await self.bus.reply(
                        msg,
                        Staged(
                            cache_dir=str(self.cache.place(req.artifact, req.device, req.tier)),
                            hit=True,
                            repaired_blocks=0,
                            verified=False,
                        ),
                    )
                    replied = True
                try:
                    result = await asyncio.to_thread(self.cache.check, req.artifact, req.device, req.tier)
                except Exception as e:
                    if checked is not None:
                        checked.set_exception(e)
                    raise
                if checked is not None:
                    checked.set_result(result)
        except Exception as e:
            log.exception("staging %s failed", aid)
            if not replied:  # a deferred check that failed before its early reply answers too
                await self.bus.reply(msg, Rejected(code=ErrorCode.ENGINE_FAILED, message=f"staging failed: {e}"))
            return
        seconds = time.perf_counter() - t0
        STAGES.labels("hit").inc()
        STAGE_SECONDS.labels("hit").observe(seconds)
        if result.repaired_blocks:
            REPAIRED_BLOCKS.inc(result.repaired_blocks)
            log.warning("re-read %d corrupt block(s) of %s from the store", result.repaired_blocks, aid)
        self._update_gauges()
        if not replied:
            await self.bus.reply(msg, self._staged(result))

    @staticmethod
    def _staged(result: StageResult) -> Staged:
        return Staged(cache_dir=str(result.cache_dir), hit=result.hit, repaired_blocks=result.repaired_blocks)

    async def on_verify(self, msg: Msg) -> None:
        req = decode(msg.data, VerifyStaged)
        checked = self._checks.get(req.artifact_id)
        if checked is None:
            await self.bus.reply(
                msg, Rejected(code=ErrorCode.ENGINE_FAILED, message=f"no check of {req.artifact_id} under way")
            )
            return
        try:
            result = await checked
        except Exception as e:
            await self.bus.reply(msg, Rejected(code=ErrorCode.ENGINE_FAILED, message=f"checking failed: {e}"))
            return
        finally:
            if self._checks.get(req.artifact_id) is checked:
                del self._checks[req.artifact_id]
        await self.bus.reply(msg, self._staged(result))

    async def on_stage_adapter(self, msg: Msg) -> None:
        """An adapter's host-cache copy for its start on this node (issue 34): a hit, checked;
        on a miss the start reads the store's copy, and the cache fills behind it (as a
        model's: TIDAL §5.2, loading off the start's critical path)."""
        try:
            path = decode(msg.data, StageAdapter).path
            adapter = readable(path, lambda p: read_manifest(Path(p)))
            if adapter is None:
                raise ImportRefused(f"no whole adapter is kept at {shown(path)}")
            async with self._stage_lock:
                result = await asyncio.to_thread(self.cache.verify_adapter, adapter)
        except Exception as e:  # the engine reads the store's copy: a warning, its words bounded
            why = str(e) if isinstance(e, ImportRefused) else f"{type(e).__name__}: {shown(str(e))}"
            log.warning("no host-cache copy of an adapter: %s", why)
            await self.bus.reply(msg, Rejected(code=ErrorCode.ENGINE_FAILED, message=f"staging failed: {why}"))
            return
        STAGES.labels("hit" if result else "miss").inc()
        await self.bus.reply(
            msg, self._staged(result) if result else Staged(cache_dir=path, hit=False, repaired_blocks=0)
        )
        if result is None:
            try:
                async with self._stage_lock:
                    await asyncio.to_thread(self.cache.fill_adapter, adapter)
            except Exception as e:
                log.warning("filling the host cache with adapter %s failed: %s", adapter.adapter_id, e)
        self._update_gauges()

    def _schedule_fill(self, artifact: Artifact, device: str, tier: Tier) -> None:
        aid = artifact.artifact_id
        if aid in self._fills:
            return
        task = asyncio.create_task(self._fill(artifact, device, tier))
        self._fills[aid] = task
        task.add_done_callback(lambda _: self._fills.pop(aid, None))

    async def _fill(self, artifact: Artifact, device: str, tier: Tier) -> None:
        await asyncio.sleep(self.settings.fill_delay_s)  # an eviction may cancel it here
        # Once copying, it finishes even if cancelled: an eviction waiting on the lock then
        # removes a whole copy, never a half-written one.
        await asyncio.shield(self._fill_now(artifact, device, tier))

    async def _fill_now(self, artifact: Artifact, device: str, tier: Tier) -> None:
        t0 = time.perf_counter()
        try:
            async with self._stage_lock:
                # Not if it is there, or a multicast under way brings it into the same place
                # (and offers it to other nodes as its blocks land).
                if self.cache.tiers.get(artifact.artifact_id) == tier or artifact.artifact_id in self._receiving:
                    return
                await asyncio.to_thread(self.cache.fill, artifact, device, tier)
        except Exception:
            log.exception("filling the host cache with %s failed", artifact.artifact_id)
            return
        STAGE_SECONDS.labels("fill").observe(time.perf_counter() - t0)
        await self._offer(artifact, device, tier)
        self._update_gauges()

    async def _offer(self, artifact: Artifact, device: str, tier: Tier) -> None:
        """Serve a whole cached copy to other nodes' multicasts."""
        try:
            bs = await asyncio.to_thread(block_set, artifact, device, tier)
        except Exception:
            log.exception("no block set for %s: not offered to other nodes", artifact.artifact_id)
            return
        if self.cache.tiers.get(artifact.artifact_id) == tier:  # not evicted meanwhile
            self.peers.offer(Holding.complete(self.cache.place(artifact, device, tier), bs))

    def _store_source(self, artifact: Artifact, device: str, tier: Tier) -> BlockSource:
        if self.settings.store_addr:
            return PeerSource(self.settings.store_addr)
        return DirectoryStore(compiled_cache_dir(artifact, device, tier))

    async def on_multicast(self, msg: Msg) -> None:
        """Receive an artifact's blob by a multicast plan into the host cache, forwarding each
        block to the targets after this one as it lands (the bus answers an error for us).
        A start's stage of the artifact meanwhile waits for it rather than read it twice."""
        req = decode(msg.data, Multicast)
        aid = req.artifact.artifact_id
        if aid in self._receiving:  # one copy at a time: this order joins the one under way
            joined = self._receiving[aid]
            await asyncio.wait({joined})
            if joined.cancelled() or joined.exception() is not None:
                raise RuntimeError(f"the multicast of {aid} under way here failed")
            await self.bus.reply(msg, MulticastDone(node_id=self.settings.node_id, blocks=0, nbytes=0, seconds=0.0))
            return
        done = self._receiving[aid] = asyncio.get_running_loop().create_future()
        try:
            reply = await self._multicast(req)
        except BaseException as e:
            if isinstance(e, Exception):
                done.set_exception(e)
                done.exception()  # retrieved: a stage waiting on it reads the store instead
            else:
                done.cancel()
            raise
        else:
            done.set_result(None)
        finally:
            del self._receiving[aid]
            async with self._holding_made:  # a stage waiting for its place: it is over
                self._holding_made.notify_all()
        await self.bus.reply(msg, reply)

    async def _multicast(self, req: Multicast) -> MulticastDone:
        aid = req.artifact.artifact_id
        bs = await asyncio.to_thread(block_set, req.artifact, req.device, req.tier)
        feeds = req.feeds
        if not feeds and req.plan_sources:  # the plan every target derives alike
            plan = pipecast(req.plan_sources, req.plan_targets, bs.blocks, req.lead)
            feeds = tuple((s.block, s.src) for s in plan.feeds(self.peer_addr))
        feeds = feeds or tuple((i, STORE) for i in range(bs.blocks))
        async with self._stage_lock:
            if self.cache.tiers.get(aid) == req.tier:  # already here: nothing to move
                return MulticastDone(node_id=self.settings.node_id, blocks=0, nbytes=0, seconds=0.0)
            place = await asyncio.to_thread(self.cache.reserve, req.artifact, req.device, req.tier, bs.size)
        holding = self._holdings[aid] = Holding(place, bs)
        async with self._holding_made:
            self._holding_made.notify_all()
        sources: dict[str, BlockSource] = {}
        try:
            self.peers.offer(holding)  # forward while receiving
            for name in {src for _, src in feeds} | set(req.fallbacks):
                sources[name] = (
                    self._store_source(req.artifact, req.device, req.tier) if name == STORE else PeerSource(name)
                )
            RECEIVED_BLOCKS.set(0)

            async def landed(_: int) -> None:
                RECEIVED_BLOCKS.inc()

            got = await receive(holding, feeds, sources, req.fallbacks, req.timeout_s, on_block=landed)
        except BaseException as e:
            evicted = self.peers.sets.get(bs.set_id) is not holding  # `on_evict` withdrew it
            self.peers.withdraw(bs.set_id)
            async with self._stage_lock:
                self.cache.evict(aid)
            if evicted and isinstance(e, Exception):
                raise RuntimeError(f"the copy of {aid} was evicted while it arrived") from e
            raise
        finally:
            self._holdings.pop(aid, None)
            for source in sources.values():
                await source.close()
        async with self._stage_lock:
            if self.peers.sets.get(bs.set_id) is not holding or not place.is_dir():
                # Evicted while its blocks arrived (`on_evict` withdrew it): not cached.
                self.cache.evict(aid)
                raise RuntimeError(f"the copy of {aid} was evicted while it arrived")
            self.cache.adopt(req.artifact, req.tier, bs.size, got.seconds)
        MULTICAST_BLOCKS.labels("planned").inc(got.blocks - got.refetched)
        MULTICAST_BLOCKS.labels("fallback").inc(got.refetched)
        self._update_gauges()
        log.info(
            "multicast of %s: %d blocks (%d MB) in %.2f s, %d from fallbacks, %d corrupt, dead sources %s",
            aid,
            got.blocks,
            got.nbytes // 1_000_000,
            got.seconds,
            got.refetched,
            got.corrupt,
            got.dead_sources,
        )
        return MulticastDone(
            node_id=self.settings.node_id,
            blocks=got.blocks,
            nbytes=got.nbytes,
            seconds=got.seconds,
            refetched=got.refetched,
            corrupt=got.corrupt,
            dead_sources=tuple(got.dead_sources),
        )

    async def on_layout(self, msg: Msg) -> None:
        """Where the torch checkpoint's layers lie among its blocks (a pipeline's planner asks)."""
        req = decode(msg.data, LayoutQuery)

        def layout() -> StageLayout:
            bs = block_set(req.artifact, req.device, Tier.TORCH)
            return stage_layout(compiled_cache_dir(req.artifact, req.device, Tier.TORCH), bs)

        await self.bus.reply(msg, await asyncio.to_thread(layout))

    async def on_await_blocks(self, msg: Msg) -> None:
        """Answer once the given blocks of an artifact are here, checked: at once from a whole
        cached copy; as they land from a multicast under way (a pipeline stage starts on part
        of a replica); an error when neither, or when they do not come in time."""
        req = decode(msg.data, AwaitBlocks)
        aid = req.artifact.artifact_id
        deadline = time.monotonic() + req.timeout_s
        ended = self._receiving.get(aid)
        if ended is not None and aid not in self._holdings:  # it has only just begun
            async with self._holding_made:
                await asyncio.wait_for(
                    self._holding_made.wait_for(lambda: aid in self._holdings or ended.done()), req.timeout_s
                )
        holding = self._holdings.get(aid)
        if holding is None or ended is None or ended.done():
            if self.cache.tiers.get(aid) != Tier.TORCH:
                raise LookupError(f"{aid} is neither cached nor arriving here")
            await self.bus.reply(
                msg, BlocksHeld(cache_dir=str(self.cache.place(req.artifact, self.settings.device, Tier.TORCH)))
            )
            return
        for index in req.blocks:
            if index in holding.have:
                continue
            arrived = asyncio.ensure_future(holding.wait_for(index, max(0.0, deadline - time.monotonic())))
            either: list[asyncio.Future[Any]] = [arrived, ended]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if arrived.done() and arrived.result():
                continue
            arrived.cancel()
            if not ended.done():
                raise TimeoutError(f"block {index} of {aid} did not arrive within {req.timeout_s:g}s")
            if ended.cancelled() or ended.exception() is not None or self.cache.tiers.get(aid) != Tier.TORCH:
                raise RuntimeError(f"the multicast of {aid} failed before block {index} arrived")
            break  # the whole copy is here
        await self.bus.reply(msg, BlocksHeld(cache_dir=str(holding.root)))

    async def on_cache(self, msg: Msg) -> None:
        entries = tuple(
            CachedArtifact(
                artifact_id=aid,
                nbytes=e.nbytes,
                tier=str(self.cache.tiers.get(aid, ADAPTER_ENTRY)),
                uses=e.uses,
                last_used=e.last_used,
            )
            for aid, e in sorted(self.cache.entries.items())
        )
        await self.bus.reply(
            msg,
            CacheStatus(
                node_id=self.settings.node_id,
                budget_bytes=self.cache.budget_bytes,
                used_bytes=self.cache.used_bytes,
                entries=entries,
                peer_addr=self.peer_addr,
                device=self.settings.device,
                torch=reads_torch_checkpoint(self.settings.engine_backend),
            ),
        )

    async def on_evict(self, msg: Msg) -> None:
        req = decode(msg.data, EvictHostCache)
        for aid, task in list(self._fills.items()):
            if not req.artifact_id or aid == req.artifact_id:
                task.cancel()
        async with self._stage_lock:
            if req.artifact_id:
                keys, freed = [req.artifact_id], self.cache.evict(req.artifact_id)
            else:
                keys, freed = self.cache.evict_all()
            # Copies still arriving go too: their multicast fails rather than cache them after.
            arriving = [a for a in self._receiving if not req.artifact_id or a == req.artifact_id]
            for key in arriving:
                self.cache.evict(key)
            for key in [*keys, *arriving]:
                self.peers.withdraw_artifact(key)
            if keys:
                RECEIVED_BLOCKS.set(0)
            if req.forget_store_pages:
                for dirpath in self.store.iterdir():
                    artifact = read_artifact(dirpath)
                    if artifact is not None and (not req.artifact_id or artifact.artifact_id == req.artifact_id):
                        forget_store_pages(artifact, self.settings.device)
        self._update_gauges()
        await self.bus.reply(msg, Evicted(node_id=self.settings.node_id, artifact_ids=tuple(keys), freed_bytes=freed))

    async def import_model(self, source: str, weight_format: WeightFormat | None = None) -> ModelImported:
        t0 = time.perf_counter()
        path, kind = readable(source, lambda s: model_source(s, self.settings.allowed_model_dirs))
        keep = kept_weight_format(path, kind, weight_format)
        if kind is SourceFormat.GGUF:
            sha = await asyncio.to_thread(sha256_of, path)
        else:  # the weight format asked for is part of what the artifact is
            sha = await asyncio.to_thread(sha256_of_dir, path, str(keep or ""))
        aid = artifact_id(sha, ov.get_version())
        dest = artifact_dir(self.store, aid)
        async with self._locks.setdefault(aid, asyncio.Lock()):
            existing = read_artifact(dest)
            if existing is not None and is_materialized(existing, self.settings.device, self.settings.engine_backend):
                IMPORT_SECONDS.labels("false").observe(time.perf_counter() - t0)
                return ModelImported(artifact=existing, converted=False, seconds=time.perf_counter() - t0)
            log.info("importing %s (%s) into %s", path, kind, dest)
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "services.loader.convert",
                str(path),
                str(dest),
                sha,
                aid,
                self.settings.device,
                str(self.settings.inference_threads),
                self.settings.engine_backend,
                kind,
                str(keep or ""),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                _, err = await asyncio.wait_for(proc.communicate(), self.settings.import_timeout_s)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise ImportRefused(f"conversion of {shown(source)} timed out") from None
            artifact = read_artifact(dest)
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            if proc.returncode == REFUSED_EXIT:
                reason = tail[0].removeprefix("refused: ")[: 2 * SHOWN_SOURCE_CHARS]
                raise ImportRefused(f"source {shown(source)} cannot be imported: {reason}")
            if (
                proc.returncode != 0
                or artifact is None
                or not is_materialized(artifact, self.settings.device, self.settings.engine_backend)
            ):
                raise ImportRefused(f"conversion of {shown(source)} failed: {tail[0][:SHOWN_SOURCE_CHARS]}")
        seconds = time.perf_counter() - t0
        IMPORT_SECONDS.labels("true").observe(seconds)
        log.info("imported %s as %s in %.1fs", path, aid, seconds)
        return ModelImported(artifact=artifact, converted=True, seconds=seconds)

    async def on_import_adapter(self, msg: Msg) -> None:
        """Check a LoRA adapter against its base and keep it in the store; every refusal (and
        any failure of the loader's own) answered as `Rejected`, never left waiting."""
        req = decode(msg.data, ImportAdapter)
        try:
            path = readable(req.source, lambda s: adapter_source(s, self.settings.allowed_model_dirs))
            async with self._locks.setdefault(f"adapter:{req.base.artifact.artifact_id}", asyncio.Lock()):
                imported = await asyncio.to_thread(import_adapter, req.base, path, self.settings.max_adapter_rank)
            log.info("adapter %s on %s: %s", shown(req.source), req.base.name, imported.adapter.adapter_id)
            reply: AdapterImported | Rejected = imported
        except (ImportRefused, AdapterRefused) as e:
            log.warning("adapter refused: %s", e)
            reply = Rejected(code=ErrorCode.IMPORT_FAILED, message=str(e))
        except Exception as e:
            log.exception("import of adapter %s failed", shown(req.source))
            reply = Rejected(
                code=ErrorCode.IMPORT_FAILED,
                message=f"cannot import adapter {shown(req.source)}: {type(e).__name__}: {str(e)[:SHOWN_SOURCE_CHARS]}",
            )
        await self.bus.reply(msg, reply)

    async def on_import(self, msg: Msg) -> None:
        req = decode(msg.data, ImportModel)
        try:
            reply: ModelImported | Rejected = await self.import_model(req.source, req.weight_format)
        except ImportRefused as e:  # bad input, handled: the client is told why
            log.warning("import refused: %s", e)
            reply = Rejected(code=ErrorCode.IMPORT_FAILED, message=str(e))
        except Exception as e:  # a failure of the loader's own: answer, never leave it waiting
            log.exception("import of %s failed", shown(req.source))
            reply = Rejected(
                code=ErrorCode.IMPORT_FAILED,
                message=f"cannot import {shown(req.source)}: {type(e).__name__}: {str(e)[:SHOWN_SOURCE_CHARS]}",
            )
        await self.bus.reply(msg, reply)
