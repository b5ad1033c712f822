"""The engine's reservations (services/engine/memory.py) against a memory manager's book kept
here: how much room `_reserve` asks its make-room steps for, and what the true-up of a
worker's footprint measures, on the host and on a GPU. The book replaces a region's size as
the memory manager's station does (`used_bytes` counts the region's old size until granted)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from policy.kv_watermark import Action, KvPlan
from services.engine.memory import KvMemory
from shared.messages import ReserveResult


class Book:
    def __init__(self, budget: int, regions: dict[str, int]) -> None:
        self.budget = budget
        self.regions = dict(regions)

    async def reserve(self, owner: str, nbytes: int) -> ReserveResult:
        others = sum(n for o, n in self.regions.items() if o != owner)
        granted = others + nbytes <= self.budget
        if granted:
            self.regions[owner] = nbytes
        return ReserveResult(granted=granted, used_bytes=sum(self.regions.values()), budget_bytes=self.budget)


def node(book: Book, asked: list[int]) -> KvMemory:
    """A `KvMemory` with no bus: its reservations go to `book`, and its one way to make room
    (evicting the idle resident `weights:idle`) records the room it was asked for."""
    engine = KvMemory.__new__(KvMemory)
    engine.settings = SimpleNamespace(memory_wait_s=0.0)  # type: ignore[assignment]
    engine.node = "n"
    engine._went_idle = asyncio.Event()
    engine._reserve_memory = book.reserve  # type: ignore[method-assign]

    async def evict_resident(need: int) -> bool:
        asked.append(need)
        return book.regions.pop("weights:idle", None) is not None

    async def nothing(need: int) -> bool:
        return False

    engine._evict_idle_tensors = nothing  # type: ignore[method-assign]
    engine._evict_idle_residents = evict_resident  # type: ignore[method-assign]
    engine._evict_idle_instances = nothing  # type: ignore[method-assign]

    async def done(owner: str) -> None:
        pass

    engine._memory_done = done  # type: ignore[method-assign]
    return engine


def test_growing_a_kv_cache_asks_room_for_the_growth_only() -> None:
    # 100 bytes: the KV holds 40, an idle resident 55; 5 free. Growing the KV to 50 needs 5 more
    # (the watermark's 60 is refused first, as the node has no room for it).
    book = Book(100, {"m:kv": 40, "weights:idle": 55})
    asked: list[int] = []
    engine = node(book, asked)
    inst = SimpleNamespace(model="m", kv=SimpleNamespace(reserved_bytes=40))
    grown = asyncio.run(engine._kv_resize(inst, KvPlan(Action.GROW, 60), 50, wait=True))  # type: ignore[arg-type]
    assert grown and inst.kv.reserved_bytes == 50 and book.regions == {"m:kv": 50}
    assert asked == [5]  # not 45: the 40 it holds are not room to make


def test_a_new_reservation_asks_room_for_all_it_lacks() -> None:
    book = Book(100, {"other": 40, "weights:idle": 55})
    asked: list[int] = []
    assert asyncio.run(node(book, asked)._reserve("m:kv", 50)) == 50
    assert asked == [45]


def bound_worker(rss: int, device_bytes: int, kv: int) -> SimpleNamespace:
    worker = SimpleNamespace(dead=False, arena=object(), rss_bytes=lambda: rss)
    return SimpleNamespace(
        worker=worker,
        artifact=SimpleNamespace(weight_bytes=1000),
        weights_reserved=100,
        device_bytes=device_bytes,
        kv_allocated_bytes=kv,
    )


def true_up(device: str, bound: SimpleNamespace, backend: str = "torch", kv_reserved: int = 600) -> dict[str, int]:
    """The reservation `_true_up_weights` gives a model in the node's arena on `device`, its
    one instance's KV reservation `kv_reserved`."""
    book = Book(10_000, {"weights:a": bound.weights_reserved})
    engine = node(book, [])
    engine.settings.device = device  # type: ignore[attr-defined]
    engine.settings.engine_backend = backend  # type: ignore[attr-defined]
    engine.bound = {"a": bound}  # type: ignore[dict-item]
    engine.instances = {"m": SimpleNamespace(bound=bound, kv=SimpleNamespace(reserved_bytes=kv_reserved))}  # type: ignore[dict-item]
    engine._artifact_locks = {}
    engine._footprints = {}
    engine._memory_seen = (book.budget, sum(book.regions.values()))
    asyncio.run(engine._true_up_weights())
    return book.regions


def test_a_gpu_workers_reservation_is_what_it_holds_on_the_device_less_its_kv() -> None:
    # Host RSS 5,000 (libraries, staging), on the device 900 of which 600 are its KV cache.
    bound = bound_worker(rss=5000, device_bytes=900, kv=600)
    assert true_up("CUDA", bound) == {"weights:a": 300}
    assert bound.weights_reserved == 300
    # Its cache is committed whole; its instances reserve only 200 of it: the other 400 are
    # held all the same, and counted as the worker's.
    assert true_up("CUDA", bound_worker(rss=5000, device_bytes=900, kv=600), kv_reserved=200) == {"weights:a": 700}
    # On the host a torch worker's KV pages are committed as they fill: how many its RSS holds
    # is unknown, and none is taken off. OpenVINO's cache is all in use: it is.
    assert true_up("CPU", bound_worker(rss=5000, device_bytes=0, kv=600)) == {"weights:a": 5000}
    assert true_up("CPU", bound_worker(rss=5000, device_bytes=0, kv=600), "openvino") == {"weights:a": 4400}


def test_a_gpu_worker_that_has_not_reported_keeps_its_reservation() -> None:
    assert true_up("CUDA", bound_worker(rss=5000, device_bytes=0, kv=0)) == {"weights:a": 100}
