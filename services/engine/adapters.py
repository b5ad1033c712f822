"""LoRA adapters on a node's instances (issue 34): which each instance has loaded, their use,
their keep-alive (`policy.adapter_turns.idle_adapters`: a worker lets an idle one go, its base
stays), their host-cache copies (the node's loader keeps them beside the models' blobs), and an
adapter start's cold-start record. The worker's batch loads and applies them
(`services/engine/core.py`); this is the node's side, on its event loop."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import msgspec

from policy.adapter_turns import AdapterUse, adapter_residents, idle_adapters
from policy.eviction import Resident
from services.engine import metrics
from shared import subjects
from shared.adapters import StageAdapter
from shared.messages import AdapterRef, ColdStartPhases, ColdStartRecorded

if TYPE_CHECKING:
    from services.engine.batch_types import AdapterLoad
    from services.engine.node import Node, Served

log = logging.getLogger(__name__)

ADAPTER_TIER = "adapter"
"""`ColdStartRecorded.tier` of an adapter's start on its warm base."""


def begin(inst: Served, ref: AdapterRef) -> bool:
    """A request for `ref` runs on `inst`: its adapter is in use (never dropped meanwhile).
    Whether it is its first use there (not loaded yet: its bytes are to be booked)."""
    use = inst.adapters.get(ref.name)
    now = time.monotonic()
    if use is None:
        inst.adapters[ref.name] = AdapterUse(ref.keep_alive_s, now, 1, ref.nbytes, first_used=now)
    else:
        inst.adapters[ref.name] = replace(
            use, keep_alive_s=ref.keep_alive_s, last_used=now, active=use.active + 1, uses=use.uses + 1
        )
    metrics.ADAPTER_REQUESTS.labels(ref.name).inc()
    return use is None


async def stage(node: Node, inst: Served, ref: AdapterRef) -> float:
    """At its first use on `inst`: where its worker is to read the adapter, as the node's
    loader answers (its host-cache copy on a hit, the store's on a miss, the cache filling
    behind it); the store's where the loader cannot answer. The seconds it took (its start's
    `stage_s`)."""
    t0 = time.monotonic()
    copy = await node.host_copy(subjects.loader_stage_adapter(node.id), StageAdapter(path=ref.path), ref.name)
    if copy is not None and ref.name in inst.adapters:
        inst.adapter_copies[ref.name] = copy
    return time.monotonic() - t0


def as_loaded(inst: Served, ref: AdapterRef) -> AdapterRef:
    """`ref` as its worker is to read it: from its host-cache copy where it has one."""
    copy = inst.adapter_copies.get(ref.name)
    return ref if copy is None else msgspec.structs.replace(ref, path=copy.cache_dir)


def source(inst: Served, ref: AdapterRef) -> str:
    """Where a request carrying `ref` (`as_loaded`) had its adapter read from: a start's source."""
    copy = inst.adapter_copies.get(ref.name)
    return "host" if copy is not None and copy.hit and ref.path == copy.cache_dir else "store"


def end(inst: Served, ref: AdapterRef) -> None:
    use = inst.adapters.get(ref.name)
    if use is not None:
        inst.adapters[ref.name] = replace(use, last_used=time.monotonic(), active=max(0, use.active - 1))


def loaded(inst: Served, name: str, load: AdapterLoad) -> None:
    """Its load was measured: what evicting it would cost its next request."""
    use = inst.adapters.get(name)
    if use is not None:
        inst.adapters[name] = replace(use, reload_s=load.load_s + load.apply_s)


def residents(instances: Iterable[Served]) -> dict[str, tuple[Served, str, Resident]]:
    """Every idle loaded adapter as an eviction candidate (`policy.adapter_turns.adapter_residents`),
    with its instance and name, by the owner of its bytes."""
    now, wall = time.monotonic(), time.time()
    out = {}
    for inst in instances:
        names = {owner(inst.model, name): name for name in inst.adapters}
        for r in adapter_residents(inst.adapters, now, wall, functools.partial(owner, inst.model), inst.priority):
            out[r.key] = (inst, names[r.key], r)
    return out


def drop(inst: Served, name: str) -> str:
    """Let the worker drop a loaded adapter (its base stays); the owner of its bytes, for the
    caller to release."""
    inst.bound.worker.drop_adapter(name)
    del inst.adapters[name]
    inst.adapter_copies.pop(name, None)
    metrics.ADAPTER_DROPS.inc()
    return owner(inst.model, name)


def owner(model: str, name: str) -> str:
    """The memory manager's owner of an adapter's bytes on `model`'s instance."""
    return f"{model}:adapter:{name}"


def drop_idle(instances: list[Served]) -> list[str]:
    """Every adapter idle its keep-alive leaves its instance's worker: the owners of their
    bytes, for the caller to release."""
    dropped = []
    now = time.monotonic()
    for inst in instances:
        dropped += [drop(inst, name) for name in idle_adapters(inst.adapters, now)]
    if dropped:
        log.info("adapters idle their keep-alive dropped: %s", ", ".join(dropped))
    return dropped


def cold_start(
    node_id: str,
    ref: AdapterRef,
    load: AdapterLoad,
    received: float,
    first_token_at: float,
    source: str,
    stage_s: float = 0.0,
) -> ColdStartRecorded:
    """An adapter's start on its warm base: its host-cache copy staged (`stage_s`) and read
    from there or from the store (`source`; `load_s`: both), applied (`apply_s`), its first
    token (`prefill_s`: the rest of the time to it); `received`, `first_token_at`:
    time.monotonic()."""
    total = max(0.0, first_token_at - received)
    load_s = stage_s + load.load_s
    phases = ColdStartPhases(
        init_s=0.0,
        load_s=load_s,
        profile_s=0.0,
        apply_s=load.apply_s,
        prefill_s=max(0.0, total - load_s - load.apply_s),
    )
    metrics.ADAPTER_LOADS.inc()
    log.info("adapter start of %s: %.3fs (load %.3fs, apply %.3fs)", ref.name, total, load_s, load.apply_s)
    return ColdStartRecorded(
        node_id=node_id,
        model=ref.name,
        started_at=time.time() - (time.monotonic() - received),
        phases=phases,
        total_s=total,
        source=source,
        stage_s=stage_s,
        worker_load_s=load.load_s,
        tier=ADAPTER_TIER,
    )
