"""A start's blob from the nodes that already hold it (FaaScale §4-5: a scale-out reads the
model from other nodes' host memory over the network, not from the store, and several new
nodes receive it along one PipeCast plan).

The scheduler asks the loaders of the nodes running the model what their host caches hold,
and sends the new node's loader a `Multicast` naming the sources (the holders, then the store)
and the targets; each target derives the same plan (`policy.multicast.pipecast`) from them and
the block count. The start itself goes on at once: the new node's loader makes its stage wait
for the blocks, and falls back to the store if they fail.

On torch nodes the targets also serve before the last block (§4.3, `pipeline`): once together
they hold every layer (`policy.pipeline_stages`), each chosen one runs its layers as a stage
and the first stage's node serves the model through them until its own replica is whole.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from policy import pipeline_stages
from policy.multicast import STORE, pipecast
from shared import subjects
from shared.bus import Bus
from shared.cache_messages import CacheQuery, CacheStatus, Multicast, MulticastDone
from shared.errors import TesseraError
from shared.messages import InstanceReady, ModelRecord, Rejected, Tier
from shared.pipeline_messages import EndStage, LayoutQuery, StageLayout, StageReady, StartPipelined, StartStage

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
        # The store is a source too, with an uplink of its own (a sub-group of its own).
        plan_sources=(*addrs, STORE),
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


async def layout(bus: Bus, node: str, order: Order) -> StageLayout | None:
    """Where the layers of a torch checkpoint lie among its blocks (asked of a target's
    loader); None where it cannot say."""
    try:
        return await bus.request(
            subjects.loader_layout(node),
            LayoutQuery(artifact=order.multicast.artifact, device=order.multicast.device),
            StageLayout,
            timeout=QUERY_TIMEOUT_S * 5,
        )
    except TesseraError as e:
        log.warning("no layout of %s from %s: %s", order.multicast.artifact.artifact_id, node, e.message)
        return None


async def pipeline(
    bus: Bus, record: ModelRecord, order: Order, shape: StageLayout, max_stages: int, timeout_s: float
) -> InstanceReady | None:
    """FaaScale §4.3 for one scale-out: the earliest set of its targets that together hold every
    layer, by the plan the targets follow, each running its layers as a stage as soon as its
    loader has them; then the first stage's node serves the model through them. Its
    `InstanceReady`, or None where no pipeline would serve before a target's own replica (or
    one failed: its stages are ended, and the starts go on as they would have)."""
    m = order.multicast
    plan = pipecast(m.plan_sources, m.plan_targets, shape.blocks, m.lead)
    node_of = dict(zip(m.plan_targets, order.nodes, strict=True))
    got = pipeline_stages.ready(
        plan,
        list(m.plan_targets),
        pipeline_stages.Layout(shape.blocks, shape.lead, shape.units, shape.first),
        max_stages,
    )
    if got is None or not got.early:
        log.info(
            "no pipeline for %s: %s",
            record.name,
            "its targets never hold every layer together"
            if got is None
            else f"one target holds it whole (step {got.whole_step}) before the stages are there (step {got.step})",
            extra={"model": record.name},
        )
        return None
    layers = len(shape.units) - 1  # the last unit is the head
    log.info(
        "pipeline for %s: stages %s from plan step %d (a replica at %d)",
        record.name,
        ", ".join(f"[{s.lo}, {s.hi}) on {node_of[s.node]}" for s in got.stages),
        got.step,
        got.whole_step,
        extra={"model": record.name},
    )
    asked = [
        bus.request(
            subjects.engine_stage(node_of[s.node]),
            StartStage(
                model=record,
                lo=s.lo,
                hi=s.hi,
                layers=layers,
                blocks=tuple(sorted(s.blocks)),
                nbytes=len(s.blocks) * shape.block_bytes,
            ),
            StageReady,
            timeout=timeout_s,
        )
        for s in got.stages
    ]
    answers = await asyncio.gather(*asked, return_exceptions=True)
    stages = [a for a in answers if isinstance(a, StageReady)]
    failed = [a for a in answers if not isinstance(a, StageReady)]
    ready: InstanceReady | Rejected | None = None
    if not failed:
        head = node_of[got.stages[0].node]
        try:
            ready = await bus.request(
                subjects.engine_pipelined(head),
                StartPipelined(
                    model=record,
                    stages=tuple(s.addr for s in stages),
                    stage_nodes=tuple(s.node_id for s in stages),
                    blocks=tuple(range(shape.lead)),
                ),
                InstanceReady | Rejected,
                timeout=timeout_s,
            )
        except TesseraError as e:
            ready = Rejected(code=e.code, message=e.message)
    if isinstance(ready, InstanceReady):
        log.info(
            "%s served through a pipeline of %d stages on %s (step %d of the plan; a replica at step %d)",
            record.name,
            len(stages),
            ", ".join(s.node_id for s in stages),
            got.step,
            got.whole_step,
            extra={"model": record.name},
        )
        return ready
    log.warning(
        "no pipeline for %s: %s",
        record.name,
        ready.message if isinstance(ready, Rejected) else "; ".join(str(f) for f in failed),
        extra={"model": record.name},
    )
    for s in stages:
        await bus.publish(
            subjects.engine_end_stage(s.node_id), EndStage(artifact_id=m.artifact.artifact_id, addr=s.addr)
        )
    return None
