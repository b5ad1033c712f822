"""Room in the node's tensor arena for a start (`Starts._arena_room`, services/engine/starts.py)
over a real `NodeArena`, with the engine's models as plain records: which idle instances and
residents it stops when the models there leave the start too little; and a start the arena has
room for but no range long enough (`ArenaFull`) refused as NO_CAPACITY."""

from __future__ import annotations

import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest

from policy.eviction import Resident
from services.engine.node_arena import NodeArena
from services.engine.starts import Starts
from shared.errors import TesseraError
from shared.messages import ErrorCode


def engine(
    arena: NodeArena, models: dict[str, dict[str, int]], reload_s: dict[str, float], busy: frozenset[str] = frozenset()
) -> SimpleNamespace:
    """`Starts` on `arena`, each of `models` (artifact → digest → bytes) placed there by its own
    worker and served by one instance of the same name, idle but for those in `busy`; what it
    stops is recorded."""
    starts = Starts.__new__(Starts)
    starts.workers = SimpleNamespace(arena=arena)  # type: ignore[assignment]
    starts.settings = SimpleNamespace(memory_wait_s=0.0)  # type: ignore[assignment]
    starts.node = "n"
    starts._went_idle = asyncio.Event()
    starts._arena_wanted = Counter()
    starts.tensor_bytes = dict(models)
    starts.bound = {}
    starts.instances = {}
    record = SimpleNamespace(ended=[], evicted=[])
    for aid, tensors in models.items():
        arena.place(aid, tensors)  # its worker's holdings, by the artifact's name here
        resident = Resident(aid, sum(tensors.values()), reload_s[aid], 0.0, 0.0, users=1)
        bound = SimpleNamespace(resident=resident, artifact=SimpleNamespace(artifact_id=aid))
        starts.bound[aid] = bound  # type: ignore[assignment]
        starts.instances[aid] = SimpleNamespace(  # type: ignore[assignment]
            model=aid,
            bound=bound,
            active=int(aid in busy),
            kv=SimpleNamespace(reserved_bytes=1 << 20),
            loaded_at=0.0,
            last_used=0.0,
        )

    async def unload(inst: SimpleNamespace) -> None:
        record.ended.append(inst.model)
        del starts.instances[inst.model]
        inst.bound.resident.users -= 1

    async def evict(keys: list[str]) -> None:
        for key in keys:
            record.evicted.append(key)
            arena.release(key)
            del starts.bound[key]

    starts._unload = unload  # type: ignore[method-assign,assignment]
    starts._evict = evict  # type: ignore[method-assign,assignment]
    record.starts = starts
    return record


def test_a_start_stops_the_model_whose_tensors_make_room_not_the_cheaper_one_it_shares_with() -> None:
    # x's tensors are all the new model's; y's are its own. The arena lacks 256 bytes for the
    # new model's one new tensor: only stopping y makes them. x is cheaper to stop, and its
    # instance and KV cache are as big as y's, but stopping it frees nothing of the arena.
    arena = NodeArena(4 * 1024, "CPU")
    x = {"a": 1024, "b": 1024}
    y = {"c": 1024, "d": 768}
    new = {**x, "e": 512}
    got = engine(arena, {"x": x, "y": y}, reload_s={"x": 0.01, "y": 10.0})
    missing = asyncio.run(got.starts._arena_room("new", new))
    assert missing == 512 and missing <= arena.room_bytes(new)
    assert got.ended == ["y"] and got.evicted == ["y"]
    assert "x" in got.starts.instances  # still serving


def test_a_start_the_models_in_use_leave_no_room_for_is_refused_and_stops_nothing() -> None:
    arena = NodeArena(4 * 1024, "CPU")
    x = {"a": 1024, "b": 1024}
    new = {**x, "e": 3 * 1024}  # more than x leaves, whatever else goes
    got = engine(arena, {"x": x}, reload_s={"x": 0.01})
    with pytest.raises(TesseraError) as refused:
        asyncio.run(got.starts._arena_room("new", new))
    assert refused.value.code is ErrorCode.NO_CAPACITY and "tensor arena" in str(refused.value)
    assert got.ended == [] and got.evicted == []


def test_tensors_a_model_in_use_holds_too_are_no_room_to_stop_another_for() -> None:
    # y's tensors are z's too, and z is serving: stopping y frees nothing of the arena. w holds
    # tensors of its own: it goes, dearer as it is.
    arena = NodeArena(4 * 1024, "CPU")  # 256 bytes free
    shared = {"a": 1024, "b": 1024}
    w = {"c": 1024, "d": 768}
    new = {"e": 1536}
    got = engine(
        arena, {"y": shared, "z": dict(shared), "w": w}, reload_s={"y": 0.01, "z": 0.01, "w": 10.0}, busy=frozenset("z")
    )
    asyncio.run(got.starts._arena_room("new", new))
    assert got.ended == ["w"] and got.evicted == ["w"]


def test_a_start_whose_tensors_fit_in_no_one_range_is_refused_as_no_capacity() -> None:
    # A fragmented arena: room enough in all, no range long enough (`ArenaFull` from the load).
    from cuda_ext.allocator import ArenaFull

    starts = Starts.__new__(Starts)
    starts.node = "n"
    starts._footprints = {}
    released: list[str] = []
    stopped: list[bool] = []

    async def nothing(*_: object, **__: object) -> int:
        return 0

    async def release(owner: str) -> None:
        released.append(owner)

    async def take() -> tuple[SimpleNamespace, bool]:
        return SimpleNamespace(stop=lambda: stopped.append(True), on_tier_up=None), True

    async def load(*_: object) -> None:
        raise ArenaFull("512 bytes in no free range")

    starts._arena_room = nothing  # type: ignore[method-assign,assignment]
    starts._reserve = nothing  # type: ignore[method-assign,assignment]
    starts._memory_done = nothing  # type: ignore[method-assign,assignment]
    starts._sync_arena = nothing  # type: ignore[method-assign,assignment]
    starts._stage = nothing  # type: ignore[method-assign,assignment]
    starts._release_memory = release  # type: ignore[method-assign]
    starts._warm_worker_bytes = lambda: 1  # type: ignore[method-assign]
    starts._start_tier = lambda artifact: None  # type: ignore[method-assign,assignment,return-value]
    starts._load = load  # type: ignore[method-assign,assignment]
    starts.workers = SimpleNamespace(take=take)  # type: ignore[assignment]
    artifact = SimpleNamespace(artifact_id="a", weight_bytes=1)
    with pytest.raises(TesseraError) as refused:
        asyncio.run(starts._acquire_new(artifact, {"e": 512}, 0.0))  # type: ignore[arg-type]
    assert refused.value.code is ErrorCode.NO_CAPACITY and "tensor arena" in str(refused.value)
    assert released == ["weights:a"] and stopped == [True]  # its reservation and worker went
