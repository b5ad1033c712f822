"""The engine's reservations (services/engine/memory.py) against a memory manager's book kept
in the test (`FakeMemoryManager`): how much room a reservation makes by evicting idle
residents, and what the true-up of a worker's footprint measures, on the host and on a GPU.
The book replaces a region's size as the memory manager's station does (`used_bytes` counts
the region's old size until granted)."""

from __future__ import annotations

import asyncio

from policy.kv_watermark import Action, KvPlan
from services.engine.backends import OPENVINO, TORCH, Backend
from services.engine.node import Served
from shared import subjects
from shared.messages import RelocateAnswer, RelocateQuery
from tests.helpers.engine_fakes import FakeMemoryManager, bind, parts, serve


def test_growing_a_kv_cache_asks_room_for_the_growth_only() -> None:
    # 100 bytes: the KV holds 40, two idle residents 50 and 5; 5 free. Growing the KV to 50
    # needs 5 more (the watermark's 60 is refused first, as the node has no room for it): the
    # small resident alone makes them. Asking room for all 50 (not taking off the 40 it holds)
    # would stop the big one instead.
    book = FakeMemoryManager(100, {"m:kv": 40, "weights:big": 50, "weights:small": 5})
    engine = parts(book)
    bind(engine.node, "big", 50, reload_s=10.0)
    small = bind(engine.node, "small", 5, reload_s=0.01)
    inst = serve(engine.node, "m", bind(engine.node, "mine", 0, users=1), kv_reserved=40)
    grown = asyncio.run(engine.memory.kv_resize(inst, KvPlan(Action.GROW, 60), 50, wait=True))
    assert grown and inst.kv.reserved_bytes == 50
    assert book.regions == {"m:kv": 50, "weights:big": 50}  # not 45: the 40 it holds are not room to make
    assert small.worker.stopped and set(engine.node.bound) == {"big", "mine"}


def test_a_new_reservation_asks_room_for_all_it_lacks() -> None:
    # 5 free, 50 wanted: 45 to make. The small resident's 5 make too little; asked for less than
    # 45, the engine would stop it first, needlessly.
    book = FakeMemoryManager(100, {"other": 40, "weights:big": 50, "weights:small": 5})
    engine = parts(book)
    bind(engine.node, "big", 50, reload_s=10.0)
    bind(engine.node, "small", 5, reload_s=0.01)
    assert asyncio.run(engine.memory.reserve("m:kv", 50)) == 50
    assert book.regions == {"other": 40, "weights:small": 5, "m:kv": 50}


def true_up(
    device: str, rss: int, device_bytes: int, kv: int, backend: Backend = TORCH, kv_reserved: int = 600
) -> tuple[dict[str, int], int]:
    """The reservation `true_up_weights` gives a model in the node's arena on `device` (its
    worker's RSS `rss`, on the device `device_bytes`, its KV cache as reported `kv`), its one
    instance's KV reservation `kv_reserved`; and the worker's weights reservation after."""
    book = FakeMemoryManager(10_000, {"weights:a": 100})
    engine = parts(book, backend=backend, device=device)
    bound = bind(engine.node, "a", 1000, users=1, rss=rss, arena=object())
    bound.weights_reserved, bound.device_bytes, bound.kv_allocated_bytes = 100, device_bytes, kv
    serve(engine.node, "m", bound, kv_reserved=kv_reserved)
    engine.node.memory_seen = (book.budget, sum(book.regions.values()))
    asyncio.run(engine.memory.true_up_weights())
    return book.regions, bound.weights_reserved


def test_a_gpu_workers_reservation_is_what_it_holds_on_the_device_less_its_kv() -> None:
    # Host RSS 5,000 (libraries, staging), on the device 900 of which 600 are its KV cache.
    assert true_up("CUDA", rss=5000, device_bytes=900, kv=600) == ({"weights:a": 300}, 300)
    # Its cache is committed whole; its instances reserve only 200 of it: the other 400 are
    # held all the same, and counted as the worker's.
    assert true_up("CUDA", rss=5000, device_bytes=900, kv=600, kv_reserved=200)[0] == {"weights:a": 700}
    # On the host a torch worker's KV pages are committed as they fill: how many its RSS holds
    # is unknown, and none is taken off. OpenVINO's cache is all in use: it is.
    assert true_up("CPU", rss=5000, device_bytes=0, kv=600)[0] == {"weights:a": 5000}
    assert true_up("CPU", rss=5000, device_bytes=0, kv=600, backend=OPENVINO)[0] == {"weights:a": 4400}


def test_a_gpu_worker_that_has_not_reported_keeps_its_reservation() -> None:
    assert true_up("CUDA", rss=5000, device_bytes=0, kv=0)[0] == {"weights:a": 100}


def test_a_reservation_drops_idle_adapters_by_cost_and_never_a_busy_one() -> None:
    """Loaded adapters are booked on the node (`book_adapter`); an idle one goes to make room
    before its keep-alive, the cheapest to need again first, beside idle models' weights; one
    with a request in flight stays. Its worker lets it go and its booking is released."""
    import time

    from policy.adapter_turns import AdapterUse
    from services.engine.adapters import owner

    book = FakeMemoryManager(
        100,
        {"weights:base": 60, "m:adapter:rare": 10, "m:adapter:busy": 10, "weights:idle": 15},
    )
    engine = parts(book)
    idle = bind(engine.node, "idle", 15, reload_s=5.0).resident  # an idle model: dear to reload
    idle.first_used, idle.last_used, idle.uses = time.time() - 600, time.time() - 60, 5
    base = bind(engine.node, "base", 60, users=1)
    inst = serve(engine.node, "m", base, active=1)
    now = time.monotonic()
    inst.adapters = {
        "rare": AdapterUse(600, now - 500, 0, 10, first_used=now - 1000),
        "busy": AdapterUse(600, now, 1, 10, first_used=now - 10, uses=5),
    }
    assert asyncio.run(engine.memory.reserve("m:kv", 12)) == 12  # 5 free, 7 to make
    assert base.worker.dropped_adapters == ["rare"] and set(inst.adapters) == {"busy"}
    assert owner("m", "rare") not in book.regions and set(engine.node.bound) == {"idle", "base"}
    # 30 more: the busy adapter is no candidate, so the idle model's weights go.
    assert asyncio.run(engine.memory.reserve("other", 15)) == 15
    assert "weights:idle" not in book.regions and base.worker.dropped_adapters == ["rare"]


def test_a_kv_growth_waiting_for_room_preempts_once_its_batch_outgrows_a_neighbours() -> None:
    # 100 bytes: big's worker 50, its KV 30, the victim's KV 10; 10 free. Big grows to 50 with
    # one request running beside the victim's one: no smaller batch to preempt, so it waits.
    # A second request joins big (as `Requests.on_generate` registers it): the wait looks again,
    # the victim (whose request the scheduler says validates elsewhere) is preempted and its
    # memory goes to big. Waiting on, big would hold the node until the victim's request ended.
    book = FakeMemoryManager(100, {"weights:a": 50, "big:kv": 30, "victim:kv": 10})
    engine = parts(book, memory_wait_s=60.0)
    node, memory = engine.node, engine.memory
    big = serve(node, "big", bind(node, "a", 50, users=1), kv_reserved=30, active=1)
    victim = serve(node, "victim", bind(node, "v", 0, users=1), kv_reserved=10, active=1)
    asked: list[tuple[str, ...]] = []

    def relocatable(query: RelocateQuery) -> RelocateAnswer:
        asked.append(query.models)
        return RelocateAnswer(query.models)

    engine.bus.answers[subjects.relocatable()] = relocatable
    waiting = asyncio.Event()
    wait_news, preempt = node.wait_news, memory.preempt

    async def waits(deadline: float) -> bool:
        waiting.set()
        return await wait_news(deadline)

    async def preempts(inst: Served, preemptor: Served | None) -> None:
        inst.prompts.clear()  # its request ends at once, PREEMPTED (the gateway resumes it)
        inst.drained.set()
        await preempt(inst, preemptor)

    node.wait_news, memory.preempt = waits, preempts  # type: ignore[method-assign]

    async def run() -> bool:
        growth = asyncio.create_task(memory.kv_resize(big, KvPlan(Action.GROW, 60), 50, wait=True))
        await asyncio.wait_for(waiting.wait(), 10)
        assert not growth.done() and asked == []  # a batch of one beside one: nobody to preempt
        big.prompts["joined"] = 1  # a request joins big, as `Requests.on_generate` registers it
        node.batch_grew.set()
        return await asyncio.wait_for(growth, 10)

    assert asyncio.run(run())
    assert asked == [("victim",)] and victim.preempted and "victim" not in node.instances
    assert big.kv.reserved_bytes == 50 and book.regions["big:kv"] == 50 and "victim:kv" not in book.regions
