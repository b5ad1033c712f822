"""A start's blob from the nodes that already hold it (FaaScale §4-5: a scale-out reads the
model from other nodes' host memory over the network, not from the store, and several new
nodes receive it along one PipeCast plan).

The scheduler asks the loaders of the nodes running the model what their host caches hold,
and sends the new node's loader a `Multicast` naming the holders and the targets; each target
derives the same plan (`policy.multicast.pipecast`) from them and the block count. The start
itself goes on at once: the new node's loader makes its stage wait for the blocks, and falls
back to the store if they fail.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from policy.multicast import STORE
from shared import subjects
from shared.bus import Bus
from shared.errors import TesseraError
from shared.messages import CacheQuery, CacheStatus, ModelRecord, Multicast, MulticastDone, Tier

log = logging.getLogger(__name__)

QUERY_TIMEOUT_S = 2.0
"""A loader that does not say what it holds within this is not asked to send."""


async def _status(bus: Bus, node: str) -> CacheStatus | None:
    try:
        return await bus.request(subjects.loader_cache(node), CacheQuery(), CacheStatus, timeout=QUERY_TIMEOUT_S)
    except TesseraError:
        return None


@dataclass(frozen=True)
class Order:
    """A multicast and the nodes it goes to (its plan's targets)."""

    multicast: Multicast
    nodes: tuple[str, ...]


async def order(bus: Bus, record: ModelRecord, targets: list[str], running_on: Iterable[str]) -> list[Order]:
    """The `Multicast`s that bring `record`'s blob to `targets` from the nodes in `running_on`
    whose loaders hold it (asked now): one per form the targets load; none where no holder
    has that form, or every target holds it."""
    holders = [n for n in running_on if n not in targets]
    asked = [*holders, *targets]
    statuses = await asyncio.gather(*(_status(bus, n) for n in asked))
    return choose(record, holders, targets, {n: s for n, s in zip(asked, statuses, strict=True) if s is not None})


def choose(record: ModelRecord, holders: list[str], targets: list[str], status: dict[str, CacheStatus]) -> list[Order]:
    """From what each loader said it holds (`status`, by node): a plan per form the targets
    load (an OpenVINO node's compiled blob, a torch node's torch checkpoint: a mixed cluster
    moves each to the nodes that load it), each from the holders of that form."""
    return [o for torch in (False, True) if (o := choose_form(record, holders, targets, status, torch)) is not None]


def choose_form(
    record: ModelRecord, holders: list[str], targets: list[str], status: dict[str, CacheStatus], torch: bool
) -> Order | None:
    """The plan for the targets that load the torch checkpoint (`torch`) or a compiled blob:
    the holders of that form as its sources (for a blob, those of the tier the first one
    caches: the tier its starts load), the targets that lack it, the store as the last
    fallback; None where no holder has the form or no such target lacks it."""
    aid = record.artifact.artifact_id
    reachable = {n: s for n, s in status.items() if s.peer_addr}
    sources = [
        (reachable[n], e.tier)
        for n in holders
        if n in reachable
        for e in reachable[n].entries
        if e.artifact_id == aid and (e.tier == Tier.TORCH) == torch
    ]
    wanting = [
        n
        for n in targets
        if n in reachable
        and reachable[n].torch == torch
        and not any(e.artifact_id == aid for e in reachable[n].entries)
    ]
    if not sources or not wanting:
        return None
    tier = sources[0][1]
    addrs = tuple(s.peer_addr for s, t in sources if t == tier)
    multicast = Multicast(
        artifact=record.artifact,
        device=sources[0][0].device or reachable[wanting[0]].device,
        tier=Tier(tier),
        plan_sources=addrs,
        plan_targets=tuple(reachable[n].peer_addr for n in wanting),
        fallbacks=(*addrs, STORE),
    )
    return Order(multicast, tuple(wanting))


async def send(bus: Bus, multicast: Multicast, target: str, timeout_s: float) -> MulticastDone | None:
    """Have `target`'s loader carry out its part; its answer (None: it failed, and the start
    reads the store)."""
    try:
        done = await bus.request(subjects.loader_multicast(target), multicast, MulticastDone, timeout=timeout_s)
    except TesseraError as e:
        log.warning("multicast of %s to %s failed: %s", multicast.artifact.artifact_id, target, e.message)
        return None
    log.info(
        "multicast of %s to %s: %d blocks in %.2f s from %s (%d from fallbacks)",
        multicast.artifact.artifact_id,
        target,
        done.blocks,
        done.seconds,
        ", ".join(multicast.plan_sources),
        done.refetched,
    )
    return done
