"""LoRA adapters on a node's instances (issue 34): which each instance has loaded, their use,
their keep-alive (`policy.adapter_turns.idle_adapters`: a worker lets an idle one go, its base
stays), and an adapter start's cold-start record. The worker's batch loads and applies them
(`services/engine/core.py`); this is the node's side, on its event loop."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from policy.adapter_turns import AdapterUse, idle_adapters
from services.engine import metrics
from shared.messages import AdapterRef, ColdStartPhases, ColdStartRecorded

if TYPE_CHECKING:
    from services.engine.batch_types import AdapterLoad
    from services.engine.node import Served

log = logging.getLogger(__name__)

ADAPTER_TIER = "adapter"
"""`ColdStartRecorded.tier` of an adapter's start on its warm base."""


def begin(inst: Served, ref: AdapterRef) -> bool:
    """A request for `ref` runs on `inst`: its adapter is in use (never dropped meanwhile).
    Whether it is its first use there (not loaded yet: its bytes are to be booked)."""
    use = inst.adapters.get(ref.name)
    active = use.active if use is not None else 0
    inst.adapters[ref.name] = AdapterUse(ref.keep_alive_s, time.monotonic(), active + 1)
    metrics.ADAPTER_REQUESTS.labels(ref.name).inc()
    return use is None


def end(inst: Served, ref: AdapterRef) -> None:
    use = inst.adapters.get(ref.name)
    if use is not None:
        inst.adapters[ref.name] = AdapterUse(use.keep_alive_s, time.monotonic(), max(0, use.active - 1))


def owner(model: str, name: str) -> str:
    """The memory manager's owner of an adapter's bytes on `model`'s instance."""
    return f"{model}:adapter:{name}"


def drop_idle(instances: list[Served]) -> list[str]:
    """Every adapter idle its keep-alive leaves its instance's worker: the owners of their
    bytes, for the caller to release."""
    dropped = []
    now = time.monotonic()
    for inst in instances:
        for name in idle_adapters(inst.adapters, now):
            inst.bound.worker.drop_adapter(name)
            del inst.adapters[name]
            metrics.ADAPTER_DROPS.inc()
            dropped.append(owner(inst.model, name))
    if dropped:
        log.info("adapters idle their keep-alive dropped: %s", ", ".join(dropped))
    return dropped


def cold_start(
    node_id: str, ref: AdapterRef, load: AdapterLoad, received: float, first_token_at: float
) -> ColdStartRecorded:
    """An adapter's start on its warm base: read from the store (`load_s`), applied
    (`apply_s`), its first token (`prefill_s`: the rest of the time to it); `received`,
    `first_token_at`: time.monotonic()."""
    total = max(0.0, first_token_at - received)
    phases = ColdStartPhases(
        init_s=0.0,
        load_s=load.load_s,
        profile_s=0.0,
        apply_s=load.apply_s,
        prefill_s=max(0.0, total - load.load_s - load.apply_s),
    )
    metrics.ADAPTER_LOADS.inc()
    log.info("adapter start of %s: %.3fs (load %.3fs, apply %.3fs)", ref.name, total, load.load_s, load.apply_s)
    return ColdStartRecorded(
        node_id=node_id,
        model=ref.name,
        started_at=time.time() - (time.monotonic() - received),
        phases=phases,
        total_s=total,
        source="store",
        worker_load_s=load.load_s,
        tier=ADAPTER_TIER,
    )
