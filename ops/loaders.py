"""A client of a cluster's loaders over NATS: what the multicast benchmark and tests ask of
them (what they cache and where they serve it, evictions, `Multicast` orders to many targets
at once). Operations code: the services never import it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence

from shared import subjects
from shared.bus import Bus
from shared.cache_messages import (
    CacheQuery,
    CacheStatus,
    Evicted,
    EvictHostCache,
    Multicast,
    MulticastDone,
    StageArtifact,
    Staged,
)
from shared.errors import TesseraError
from shared.messages import Artifact, ImportModel, ModelImported, Tier


class LoaderClient:
    def __init__(self, bus: Bus, device: str = "CPU") -> None:
        self.bus = bus
        self.device = device

    async def status(self, node: str) -> CacheStatus:
        return await self.bus.request(subjects.loader_cache(node), CacheQuery(), CacheStatus, timeout=10)

    async def import_model(self, source: str) -> Artifact:
        reply = await self.bus.request(subjects.import_model(), ImportModel(source=source), ModelImported, timeout=600)
        return reply.artifact

    async def cache_on(self, node: str, artifact: Artifact, timeout_s: float = 120, tier: Tier = Tier.STEADY) -> None:
        """Have `node`'s loader hold the artifact's blob (that form of it) in host memory (a
        stage, then its fill)."""
        await self.bus.request(
            subjects.loader_stage(node),
            StageArtifact(artifact=artifact, device=self.device, tier=tier),
            Staged,
            timeout=60,
        )
        deadline = time.monotonic() + timeout_s
        while not any(e.artifact_id == artifact.artifact_id for e in (await self.status(node)).entries):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{node} never cached {artifact.artifact_id}")
            await asyncio.sleep(0.1)  # sync-ok: polling the loader's cache, with a deadline

    async def evict(self, nodes: Sequence[str], artifact: Artifact) -> None:
        for n in nodes:
            await self.bus.request(
                subjects.loader_evict(n), EvictHostCache(artifact_id=artifact.artifact_id), Evicted, timeout=30
            )

    async def multicast(
        self,
        artifact: Artifact,
        feeds: Mapping[str, Sequence[tuple[int, str]]],
        fallbacks: tuple[str, ...],
        *,
        block_timeout_s: float = 20,
        unawaited: frozenset[str] = frozenset(),
        tier: Tier = Tier.STEADY,
    ) -> tuple[float, dict[str, MulticastDone | str]]:
        """Send every target (`feeds`' keys) its feeds at once; the seconds until the last
        answer (not waiting for `unawaited`: a loader killed never answers) and each answer,
        or the error it gave."""

        async def one(node: str) -> MulticastDone | str:
            try:
                return await self.bus.request(
                    subjects.loader_multicast(node),
                    Multicast(
                        artifact=artifact,
                        device=self.device,
                        tier=tier,
                        feeds=tuple(feeds[node]),
                        fallbacks=fallbacks,
                        timeout_s=block_timeout_s,
                    ),
                    MulticastDone,
                    timeout=900,
                )
            except TesseraError as e:
                return str(e)

        t0 = time.perf_counter()
        tasks = {n: asyncio.create_task(one(n)) for n in feeds}
        done = {n: await t for n, t in tasks.items() if n not in unawaited}
        wall = time.perf_counter() - t0
        for t in tasks.values():
            t.cancel()
        return wall, done
