"""The node's memory within the memory manager's grants: a request is admitted when its KV
fits, a cache grows with its rows and shrinks when they end (`policy/kv_watermark.py`), and when
a grant cannot grow the engine preempts a neighbour (LLM-Mesh §7.1), evicts the request with
the most headroom (§6.4), or evicts idle residents at the lowest cost (Tangram)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Protocol

from policy.defrag import Neighbour, choose_preemption
from policy.eviction import Resident, choose_evictions, over_budget
from policy.footprint import true_up
from policy.kv_watermark import Action, KvPlan
from policy.slo import ttft_slo
from services.engine import adapters, metrics
from services.engine.node import ARENA_REGION, Bound, Node, Publisher, Served
from shared import subjects
from shared.errors import TesseraError
from shared.messages import (
    AdapterRef,
    ErrorCode,
    Generate,
    Release,
    RelocateAnswer,
    RelocateQuery,
    Reserve,
    ReserveDone,
    ReserveResult,
)

log = logging.getLogger(__name__)


class MemoryManager(Protocol):
    """The node's memory manager (`services/memory_manager`): `reserve` moves `owner`'s
    reservation to `nbytes` if there is room, `release` drops it (`*`: all of this engine's),
    `done` says the load or resize it granted is finished."""

    async def reserve(self, owner: str, nbytes: int) -> ReserveResult: ...

    async def release(self, owner: str) -> ReserveResult: ...

    async def done(self, owner: str) -> None: ...


@dataclass
class BusMemoryManager:
    """The node's memory manager over the bus."""

    bus: Publisher
    node_id: str
    timeout_s: float

    async def reserve(self, owner: str, nbytes: int) -> ReserveResult:
        ask = Reserve(owner=owner, nbytes=nbytes)
        return await self.bus.request(subjects.memory_reserve(self.node_id), ask, ReserveResult, self.timeout_s)

    async def release(self, owner: str) -> ReserveResult:
        ask = Release(owner=owner)
        return await self.bus.request(subjects.memory_release(self.node_id), ask, ReserveResult, self.timeout_s)

    async def done(self, owner: str) -> None:
        await self.bus.publish(subjects.memory_done(self.node_id), ReserveDone(owner=owner))


class KvMemory:
    """The node's memory as its parts use it: reservations with the memory manager, the KV
    caches' growth and shrinking, and the evictions and preemptions that make room."""

    def __init__(self, node: Node, manager: MemoryManager) -> None:
        self.node, self.manager = node, manager
        self.settings, self.arena = node.settings, node.workers.arena
        self.footprints: dict[str, int] = {}
        """Per artifact, the weights its last worker was trued up to: what the next start reserves."""
        self.arena_wanted: Counter[str] = Counter()
        """Digests the starts under way will bind in the node's arena: counted in its reservation
        until they are in (once), and never evicted for memory meanwhile."""
        self.arena_granted = 0
        """The arena's reservation as the memory manager last granted it."""

    async def reserve_now(self, owner: str, nbytes: int) -> ReserveResult:
        """One reservation asked, no room made."""
        result = await self.manager.reserve(owner, nbytes)
        self.node.memory_seen = (result.budget_bytes, result.used_bytes)
        return result

    async def release(self, owner: str) -> None:
        """Release and wait for the answer: a reservation sent next must see it."""
        try:
            result = await self.manager.release(owner)
            self.node.memory_seen = (result.budget_bytes, result.used_bytes)
        except Exception:
            log.warning("could not release memory of %s", owner)

    async def done(self, owner: str) -> None:
        try:
            await self.manager.done(owner)
        except Exception:
            log.warning("could not report memory of %s done", owner)

    async def sync_arena(self) -> None:
        """The node arena's reservation moved to `arena_target` (after an eviction or a start)."""
        if self.arena is None:
            return
        target = self.arena_target()
        if target == 0:
            await self.release(ARENA_REGION)
            self.arena_granted = 0
            return
        result = await self.reserve_now(ARENA_REGION, target)
        await self.done(ARENA_REGION)
        if result.granted:
            self.arena_granted = target
        else:
            log.warning("the node arena takes %d bytes, more than the memory manager grants it", target)

    def arena_target(self) -> int:
        """What the node's arena takes, with what the starts under way will copy into it."""
        if self.arena is None:
            return 0
        wanted = {d: n for t in self.node.tensor_bytes.values() for d, n in t.items() if d in self.arena_wanted}
        return self.arena.committed_bytes(wanted)

    async def evict(self, keys: list[str]) -> int:
        """Stop the residents `keys`, and drop their tensors from the node's arena but those
        another model holds or a start under way will bind; the bytes freed."""
        freed = 0
        for key in keys:
            bound = self.node.bound.pop(key, None)
            if bound is None:  # gone while an earlier one stopped (rebound to another model)
                continue
            await asyncio.to_thread(bound.worker.stop)  # the process's memory goes with it
            if self.arena is not None:  # and the weights it alone held in the node's arena
                self.arena.evict_idle(
                    {d: n for d, n in self.node.tensor_bytes.get(key, {}).items() if d not in self.arena_wanted}
                )
            freed += bound.resident.nbytes
            await self.release(f"weights:{key}")
            metrics.POOL_EVICTIONS.inc()
            log.info("evicted resident model %s (%d bytes)", key, bound.resident.nbytes)
        if freed and self.arena is not None:
            await self.sync_arena()  # once, for all it evicted there
        return freed

    async def unload(self, inst: Served) -> None:
        inst.bound.worker.drop_session(inst.model)  # its KV cache
        holds_weights = inst.bound.source != "pipeline"  # a pipelined one holds none
        if holds_weights:
            # Idle before the first await: a heartbeat between the instance leaving and its
            # worker turning idle would show the model neither served nor resident.
            self._idle(inst.bound)
        await self._forget(inst)
        if holds_weights:
            await self._trim_pool()

    async def book_adapter(self, inst: Served, ref: AdapterRef) -> None:
        """An adapter's bytes (its file, what the worker holds of it) booked before its first
        request on `inst` (room made as for any reservation); released when it is dropped."""
        async with self.reserved(adapters.owner(inst.model, ref.name), ref.nbytes):
            pass

    async def _forget(self, inst: Served) -> None:
        del self.node.instances[inst.model]
        for name in list(inst.adapters):
            await self.release(adapters.owner(inst.model, name))
        for gauge in (metrics.KV_RESERVED, metrics.KV_ALLOCATED):
            with contextlib.suppress(KeyError):
                gauge.remove(inst.model)
        await self.release(f"{inst.model}:kv")
        self.node.replaced(inst)  # a pipelined one: its worker and stages go

    async def lose_worker(self, bound: Bound) -> None:
        """A worker died: its instances are gone; the next request starts them again."""
        for inst in [i for i in self.node.instances.values() if i.bound is bound]:
            await self._forget(inst)
        if self.node.bound.get(bound.artifact.artifact_id) is bound:
            del self.node.bound[bound.artifact.artifact_id]
            await self.release(f"weights:{bound.artifact.artifact_id}")
        await self.node.beat()  # tell the scheduler now

    async def release_worker(self, bound: Bound) -> None:
        """An instance stopped using the worker: it stays resident within the pool budget."""
        self._idle(bound)
        await self._trim_pool()

    @staticmethod
    def _idle(bound: Bound) -> None:
        bound.resident.users -= 1
        bound.resident.last_used = time.time()

    async def _trim_pool(self) -> None:
        excess = over_budget([b.resident for b in self.node.bound.values()], self.settings.pool_budget_bytes)
        await self._evict_idle_residents(excess)

    def _sole(self, inst: Served) -> bool:
        """`inst` is its resident worker's only user: ending it frees the weights too."""
        return self.node.bound.get(inst.bound.artifact.artifact_id) is inst.bound and inst.bound.resident.users == 1

    def _frees(self, inst: Served) -> int:
        return inst.kv.reserved_bytes + (inst.bound.resident.nbytes if self._sole(inst) else 0)

    async def evict_idle_instances(self, need: int, frees: Callable[[Served, bool], int] | None = None) -> bool:
        """End idle instances before their keep-alive, at the lowest cost (Tangram §3.2).
        `frees(instance, sole user of its worker)`: what ending it frees (default: its KV cache
        and a sole user's weights). False if the idle ones cannot free enough."""
        candidates = []
        for i in self.node.instances.values():
            if i.active or i.pinned:  # a pinned one is never ended to make room
                continue
            sole = self._sole(i)
            freed = frees(i, sole) if frees else self._frees(i)
            # Its restart costs a resident start at least, a full load if its weights go too.
            reload_s = i.bound.resident.reload_s if sole else 0.1
            candidates.append(Resident(i.model, freed, reload_s, i.loaded_at, i.last_used, priority=i.priority))
        victims = choose_evictions(candidates, need, time.time())
        if not victims:
            return False
        for model in victims:
            inst = self.node.instances.get(model)
            if inst is not None and inst.active == 0:
                log.info("unloading idle %s to make room", model, extra={"model": model})
                metrics.INSTANCE_EVICTIONS.inc()
                await self.unload(inst)
        return True

    async def reserve(
        self,
        owner: str,
        size: int | Callable[[], int],
        preemptor: Served | None = None,
        held: Callable[[], int] | None = None,
    ) -> int:
        """Reserve, making room if the node is full: evict idle tensors of the node's arena and
        idle residents at the lowest cost, then idle instances (whose memory turns into
        residents, evicted in turn); for a busy instance's KV growth (`preemptor`), preempt
        smaller neighbours whose requests validate elsewhere (LLM-Mesh §7.1); else wait for an
        instance to go idle. `size` may be a function (the node arena's size changes as it
        evicts); `held`: what `owner` holds granted already (the room to make is only the
        growth). The bytes granted."""
        deadline = time.monotonic() + self.settings.memory_wait_s
        rooms = (self._evict_idle_tensors, self._evict_idle_residents, self.evict_idle_instances)
        short = 0
        while True:
            self.node.clear_news()
            for make_room in (None, *rooms, self._evict_idle_residents):
                if make_room is not None and not await make_room(short):
                    continue
                nbytes = size() if callable(size) else size
                result = await self.reserve_now(owner, nbytes)
                if result.granted:
                    return nbytes
                if nbytes > result.budget_bytes:  # no eviction, preemption or wait makes room
                    raise TesseraError(
                        ErrorCode.NO_CAPACITY,
                        f"{nbytes} bytes needed on node {self.node.id}, more than its whole memory budget "
                        f"of {result.budget_bytes} bytes",
                        retry_after_s=2,
                    )
                short = nbytes - (held() if held else 0) - (result.budget_bytes - result.used_bytes)
            if preemptor is not None and await self._preempt_for(preemptor, short):
                continue  # the preempted instances are idle now: the next pass evicts them
            # Everything that could go is busy: wait for an instance to finish its requests,
            # rather than refuse a start that will fit in a moment.
            if time.monotonic() >= deadline or not await self.node.wait_news(deadline):
                raise TesseraError(
                    ErrorCode.NO_CAPACITY,
                    f"node {self.node.id} has {result.budget_bytes - result.used_bytes} bytes free, {nbytes} needed",
                    retry_after_s=2,
                )

    @contextlib.asynccontextmanager
    async def reserved(self, owner: str, nbytes: int) -> AsyncIterator[None]:
        """`owner`'s reservation (room made as `reserve` makes it) for what the block does:
        released if that fails, else reported done."""
        await self.reserve(owner, nbytes)
        try:
            yield
        except BaseException:
            await self.release(owner)
            raise
        await self.done(owner)

    async def kv_resize(self, inst: Served, plan: KvPlan, required: int, wait: bool) -> bool:
        """Move `inst`'s reservation to `plan`'s size, else the requirement, else (`wait`) make
        room like a start does. False when the node could not grant even the requirement."""
        owner = f"{inst.model}:kv"
        old = inst.kv.reserved_bytes
        targets = [plan.target_bytes] if plan.action is not Action.REFUSE else []
        if required not in targets and required > old:
            targets.append(required)
        for granted in targets:
            if (await self.reserve_now(owner, granted)).granted:
                break
        else:
            if not wait or required <= old:
                return False
            # It holds `old` already: the room to make is only the growth.
            granted = await self.reserve(owner, required, preemptor=inst, held=lambda: old)
        await self.done(owner)
        inst.kv.reserved_bytes = granted
        metrics.KV_RESERVED.labels(inst.model).set(granted)
        metrics.KV_RESIZES.labels("grow" if granted > old else "shrink").inc()
        return True

    async def kv_admit(self, inst: Served, req: Generate) -> None:
        """Count the request into its instance's KV reservation, grown first (to the watermark)
        if it falls short. Raises NO_CAPACITY when the node cannot grant it."""
        ctx = inst.bound.artifact.context_length
        cap = req.params.max_tokens if req.params.max_tokens > 0 else ctx - req.prompt_tokens
        async with inst.kv_lock:
            slo = ttft_slo(inst, req.prompt_tokens)
            plan = inst.kv.admit(req.request_id, req.prompt_tokens, cap, self.node.available(), time.monotonic(), slo)
            if plan.action is Action.KEEP:
                return
            try:
                await self.kv_resize(inst, plan, inst.kv.required(), wait=True)
            except BaseException:
                inst.kv.forget(req.request_id)
                raise

    async def kv_progress(self, inst: Served, request_id: str, generated: int) -> None:
        """A request decoding past what eq. 2 assumed (the mean output): grow the reservation,
        else evict the request with the most headroom (§6.4): it ends PREEMPTED and the gateway
        resumes it elsewhere from the text it has streamed."""
        if inst.kv_lock.locked():
            return  # a resize is under way; the next chunk looks again
        async with inst.kv_lock:
            plan = inst.kv.progress(request_id, generated, self.node.available())
            if plan.action is Action.KEEP:
                return
            if await self.kv_resize(inst, plan, inst.kv.required(), wait=False):
                return
            metrics.KV_UNDERESTIMATES.inc()
            victim = inst.kv.evictee(inst.ttft_slo_s, inst.tpot_slo_s, time.monotonic())
            if victim is not None and victim not in inst.evicted:
                inst.evicted.add(victim)
                inst.kv.forget(victim)  # its rows leave the cache now; Ō learns nothing from it
                metrics.KV_EVICTIONS.inc()
                log.info(
                    "evicting %s from %s's KV cache (most headroom; the node cannot grow it)",
                    victim,
                    inst.model,
                    extra={"model": inst.model},
                )
                self.node.cancel(victim, by_client=False)

    async def kv_complete(self, inst: Served, request_id: str, generated: int, finished: bool) -> None:
        """A request left: Ō learns its length, and the reservation shrinks if it is now well
        over what the rest need (lazily, below the watermark only)."""
        # The cache's allocation stays (OpenVINO's never shrinks): this instance's part of it,
        # less what its worker's other names reserve, is the floor of its reservation.
        others = self.node.kv_reserved_on(inst.bound) - inst.kv.reserved_bytes
        async with inst.kv_lock:
            plan = inst.kv.complete(request_id, generated, finished, max(0, inst.bound.kv_allocated_bytes - others))
            if plan.action is Action.SHRINK and self.node.instances.get(inst.model) is inst:
                await self.kv_resize(inst, plan, plan.target_bytes, wait=False)

    async def _preempt_for(self, preemptor: Served, need: int) -> bool:
        """Preempt neighbours of `preemptor` with a smaller batch, smallest first, whose requests
        validate on another node (the scheduler says which), until `need` bytes would be free.
        False when no such set frees enough."""
        neighbours = [
            Neighbour(i.model, i.active, self._frees(i), relocatable=False, priority=i.priority, pinned=i.pinned)
            for i in self.node.instances.values()
            if i is not preemptor and not i.preempted and 0 < i.active < preemptor.active
        ]
        if not neighbours:
            return False
        try:
            query = RelocateQuery(node_id=self.node.id, models=tuple(n.key for n in neighbours))
            answer = await self.node.bus.request(
                subjects.relocatable(), query, RelocateAnswer, self.settings.memory_request_timeout_s
            )
        except TesseraError as e:
            log.warning("no relocation check (%s): preempting nobody", e.message)
            return False
        ok = set(answer.relocatable)
        candidates = [replace(n, relocatable=n.key in ok) for n in neighbours]
        plan = choose_preemption(preemptor.active, need, candidates, for_priority=preemptor.priority)
        if plan is None or not plan.victims:
            return False
        for model in plan.victims:
            inst = self.node.instances.get(model)
            if inst is not None:
                await self.preempt(inst, preemptor)
        return True

    async def preempt(self, inst: Served, preemptor: Served | None) -> None:
        """End `inst`'s requests as PREEMPTED (the gateway resumes each elsewhere) and unload it."""
        inst.preempted = True
        metrics.PREEMPTIONS.inc()
        log.info(
            "preempting %s (batch %d) for %s (batch %d)",
            inst.model,
            inst.active,
            preemptor.model if preemptor else "a neighbour",
            preemptor.active if preemptor else 0,
            extra={"model": inst.model},
        )
        for rid in list(inst.prompts):
            self.node.cancel(rid, by_client=False)
        if inst.active > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(inst.drained.wait(), self.settings.memory_wait_s)
        if inst.active == 0 and self.node.instances.get(inst.model) is inst:
            await self.unload(inst)

    async def true_up_weights(self) -> None:
        """Each bound worker's weights reservation moved to its measured footprint, so that the
        budget bounds what workers really hold. Where there is no room, the shortfall is counted
        (`tessera_engine_unaccounted_bytes`), nothing evicted: the next start reserves it."""
        unaccounted = 0
        for aid, bound in list(self.node.bound.items()):
            if bound.worker.dead:
                continue
            # A model in the node's arena: its weights are the arena's reservation.
            floor = 0 if bound.worker.arena is not None else bound.artifact.weight_bytes
            # On a GPU the budget is the device's (the host RSS is libraries and staging).
            measured = bound.device_bytes if self.node.on_cuda else bound.worker.rss_bytes()
            # Taken off: what the KV reservations count of its KV cache (a cache committed whole
            # may hold more; the rest is the worker's). A lazily committed host cache: unknown
            # how much the RSS holds, so none (the safe side).
            lazy = self.node.backend.lazy_host_kv and not self.node.on_cuda
            kv_reserved = self.node.kv_reserved_on(bound)
            kv = 0 if lazy else min(bound.kv_allocated_bytes, kv_reserved)
            target = true_up(bound.weights_reserved, floor, measured, kv)
            lock = self.node.locks[aid]
            if target is None or lock.locked():  # in step, or a start of it under way
                continue
            owner, growth = f"weights:{aid}", target - bound.weights_reserved
            async with lock:
                # No room as the memory manager last answered: not worth a refusal.
                if growth > self.node.available() or not (await self.reserve_now(owner, target)).granted:
                    unaccounted += max(0, growth)
                    continue
                await self.done(owner)
                if self.node.bound.get(aid) is not bound:  # evicted or lost meanwhile
                    await self.release(owner)
                    continue
                bound.weights_reserved = self.footprints[aid] = target
        metrics.UNACCOUNTED_BYTES.set(unaccounted)

    async def _evict_idle_tensors(self, need: int) -> bool:
        """Evict idle tensors of the node's arena, the cheapest to reload first (Tangram eq. 2).
        Not on CUDA, where the arena is allocated whole: evicting frees no memory there."""
        arena = self.arena
        if arena is None or arena.handle.cuda or not arena.evict_cheapest(need, keep=self.arena_wanted.keys()):
            return False
        await self.sync_arena()
        return True

    async def _evict_idle_residents(self, need: int) -> bool:
        """Idle models' weights and idle loaded adapters, the cheapest to need again first
        (Tangram eq. 2, one order for both)."""
        loras = adapters.residents(self.node.instances.values())
        models = [b.resident for b in self.node.bound.values()]
        keys = choose_evictions([*models, *(r for _, _, r in loras.values())], need, time.time())
        for key in [k for k in keys if k in loras]:
            inst, name, _ = loras[key]
            log.info("dropping idle adapter %s of %s to make room", name, inst.model, extra={"model": inst.model})
            await self.release(adapters.drop(inst, name))
        if models_out := [k for k in keys if k not in loras]:
            await self.evict(models_out)
        return bool(keys)
