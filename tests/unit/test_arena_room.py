"""Room in the node's tensor arena for a start (`Starts._arena_room`, services/engine/starts.py)
over a real `NodeArena`, the engine's parts over fake workers and a fake memory manager:
which idle instances and residents it stops when the models there leave the start too little;
and a start the arena has room for but no range long enough (`ArenaFull`) refused as
NO_CAPACITY."""

from __future__ import annotations

import asyncio

import pytest

from cuda_ext.allocator import ArenaFull
from services.engine.backends import TORCH
from services.engine.node import ARENA_REGION
from services.engine.node_arena import NodeArena
from shared.errors import TesseraError
from shared.messages import ErrorCode
from tests.helpers.engine_fakes import FakeMemoryManager, FakePool, FakeWorker, Parts, artifact, bind, parts, serve


def engine(
    arena: NodeArena, models: dict[str, dict[str, int]], reload_s: dict[str, float], busy: frozenset[str] = frozenset()
) -> Parts:
    """The engine on `arena`, each of `models` (artifact → digest → bytes) placed there by its
    own worker and served by one instance of the same name, idle but for those in `busy`."""
    got = parts(FakeMemoryManager(1 << 30), FakePool(arena=arena), backend=TORCH)
    got.node.tensor_bytes = dict(models)
    for aid, tensors in models.items():
        arena.place(aid, tensors)  # its worker's holdings, by the artifact's name here
        bound = bind(got.node, aid, sum(tensors.values()), reload_s[aid], users=1, arena=arena)
        serve(got.node, aid, bound, kv_reserved=1 << 20, active=int(aid in busy))
    return got


def ended(got: Parts, models: dict[str, dict[str, int]]) -> list[str]:
    return [m for m in models if m not in got.node.instances]


def evicted(got: Parts, models: dict[str, dict[str, int]]) -> list[str]:
    return [m for m in models if m not in got.node.bound]


def test_a_start_stops_the_model_whose_tensors_make_room_not_the_cheaper_one_it_shares_with() -> None:
    # x's tensors are all the new model's; y's are its own. The arena lacks 256 bytes for the
    # new model's one new tensor: only stopping y makes them. x is cheaper to stop, and its
    # instance and KV cache are as big as y's, but stopping it frees nothing of the arena.
    arena = NodeArena(4 * 1024, "CPU")
    x = {"a": 1024, "b": 1024}
    y = {"c": 1024, "d": 768}
    new = {**x, "e": 512}
    models = {"x": x, "y": y}
    got = engine(arena, models, reload_s={"x": 0.01, "y": 10.0})
    missing = asyncio.run(got.starts._arena_room("new", new))
    assert missing == 512 and missing <= arena.room_bytes(new)
    assert ended(got, models) == ["y"] and evicted(got, models) == ["y"]
    assert "x" in got.node.instances  # still serving


def test_a_start_the_models_in_use_leave_no_room_for_is_refused_and_stops_nothing() -> None:
    arena = NodeArena(4 * 1024, "CPU")
    x = {"a": 1024, "b": 1024}
    new = {**x, "e": 3 * 1024}  # more than x leaves, whatever else goes
    got = engine(arena, {"x": x}, reload_s={"x": 0.01})
    with pytest.raises(TesseraError) as refused:
        asyncio.run(got.starts._arena_room("new", new))
    assert refused.value.code is ErrorCode.NO_CAPACITY and "tensor arena" in str(refused.value)
    assert ended(got, {"x": x}) == [] and evicted(got, {"x": x}) == []


def test_tensors_a_model_in_use_holds_too_are_no_room_to_stop_another_for() -> None:
    # y's tensors are z's too, and z is serving: stopping y frees nothing of the arena. w holds
    # tensors of its own: it goes, dearer as it is.
    arena = NodeArena(4 * 1024, "CPU")  # 256 bytes free
    shared = {"a": 1024, "b": 1024}
    w = {"c": 1024, "d": 768}
    new = {"e": 1536}
    models = {"y": shared, "z": dict(shared), "w": w}
    got = engine(arena, models, reload_s={"y": 0.01, "z": 0.01, "w": 10.0}, busy=frozenset("z"))
    asyncio.run(got.starts._arena_room("new", new))
    assert ended(got, models) == ["w"] and evicted(got, models) == ["w"]


def test_a_start_whose_tensors_fit_in_no_one_range_is_refused_as_no_capacity() -> None:
    # A fragmented arena: room enough in all, no range long enough (`ArenaFull` from the load).
    book = FakeMemoryManager(1 << 30)
    worker = FakeWorker(load_error=ArenaFull("512 bytes in no free range"))
    got = parts(book, FakePool(lambda: worker, arena=NodeArena(4 * 1024, "CPU")), backend=TORCH)
    with pytest.raises(TesseraError) as refused:
        asyncio.run(got.starts._acquire_new(artifact("a", weight_bytes=1), {"e": 512}, 0.0))
    assert refused.value.code is ErrorCode.NO_CAPACITY and "tensor arena" in str(refused.value)
    # Its reservation and worker went (and the arena's, holding nothing now).
    assert book.released == ["weights:a", ARENA_REGION] and worker.stopped
    assert book.regions == {}
