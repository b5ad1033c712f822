"""The engine's controller (services/engine/service.py) and its parts, real, over fakes of what
they are built with: a memory manager's book, the bus, a worker pool whose workers answer from
a script (no process, no model)."""

from __future__ import annotations

import asyncio
import importlib
import time

import msgspec
import pytest

from policy.eviction import Resident
from policy.kv_watermark import recommended_bytes, required_bytes
from services.engine import adapters
from services.engine.backends import BACKENDS, OPENVINO, TORCH
from services.engine.batch_types import AdapterLoad
from services.engine.node import Bound, PendingColdStart, WorkerDied
from services.engine.service import EngineService
from services.engine.worker_wire import Chunk, Done, Loaded, Run
from shared import subjects
from shared.adapters import StageAdapter
from shared.cache_messages import Staged
from shared.errors import TesseraError
from shared.messages import (
    AdapterRef,
    ColdStartPhases,
    ErrorCode,
    Failed,
    Finished,
    FinishReason,
    Generate,
    GenerateAccepted,
    InstanceReady,
    InstanceStopped,
    ModelRecord,
    NodeStatus,
    Rejected,
    SamplingParams,
    StartInstance,
    StopInstance,
    Tier,
    TokenChunk,
)
from shared.pipeline_messages import StartStage
from tests.helpers.engine_fakes import (
    FakeBus,
    FakeMemoryManager,
    FakePool,
    FakeWorker,
    Parts,
    Script,
    artifact,
    bind,
    msg,
    parts,
    settings,
)


def record(name: str = "m", weight_bytes: int = 100) -> ModelRecord:
    return ModelRecord(
        name=name,
        source="test",
        artifact=artifact("a", weight_bytes=weight_bytes),
        ttft_slo_s=1.0,
        tpot_slo_s=0.1,
        keep_alive_s=60.0,
        created_at=0.0,
    )


def request(rid: str = "r1", model: str = "m") -> Generate:
    return Generate(
        request_id=rid,
        model=model,
        prompt="hi",
        prompt_ids=(1, 2),
        prompt_tokens=2,
        params=SamplingParams(max_tokens=4),
        stream_subject=f"stream.{rid}",
    )


def says(*texts: str) -> Script:
    """A model that answers each request with `texts`, a token each, then stops."""

    def script(run: Run) -> list[Chunk | Done | BaseException]:
        chunks: list[Chunk | Done | BaseException] = [Chunk(run.request_id, t, 1) for t in texts]
        return [*chunks, Done(run.request_id, FinishReason.STOP, len(texts), time.monotonic())]

    return script


def started(script: Script, budget: int = 10_000) -> Parts:
    """The parts over a book of `budget` bytes, with an instance of `record()` started."""
    engine = parts(FakeMemoryManager(budget), FakePool(lambda: FakeWorker(script)))
    ready = asyncio.run(engine.starts.start_instance(StartInstance(model=record())))
    assert ready.model == "m" and "m" in engine.node.instances
    return engine


def test_a_request_streams_its_worker_chunks_and_ends_finished_with_its_room_freed() -> None:
    engine = started(says("Hel", "lo"))
    assert set(engine.manager.regions) == {"weights:a", "m:kv"}
    assert engine.pool.taken[0].tier is Tier.STEADY  # no START tier compiled for the artifact
    asyncio.run(engine.requests.on_generate(msg(request())))
    assert engine.bus.replies == [GenerateAccepted(request_id="r1")]
    assert engine.bus.sent("stream.r1") == [
        TokenChunk(request_id="r1", text="Hel", tokens=1),
        TokenChunk(request_id="r1", text="lo", tokens=1),
        Finished(request_id="r1", finish_reason=FinishReason.STOP, prompt_tokens=2, completion_tokens=2),
    ]
    inst = engine.node.instances["m"]
    assert inst.active == 0 and inst.drained.is_set() and not engine.node.cancels
    assert engine.node.beat_due.is_set() and engine.node.went_idle.is_set()
    assert engine.node.batch_grew.is_set()  # its arrival: a KV growth waiting for room looks again
    # Its first token ended the cold start: recorded, and the pool's replacement may warm.
    assert len(engine.bus.sent(subjects.cold_start_recorded())) == 1 and engine.pool.starts_done == 1
    # Measured from the first token on: this request came before it, and is no measure.
    assert engine.node.perf == {}


def test_a_request_for_a_model_not_loaded_fails_at_once() -> None:
    engine = parts(FakeMemoryManager(10_000))
    asyncio.run(engine.requests.on_generate(msg(request(model="nope"))))
    (failed,) = engine.bus.replies
    assert isinstance(failed, Failed) and failed.code is ErrorCode.INSTANCE_NOT_LOADED


def test_a_worker_dying_mid_request_fails_it_and_forgets_the_worker_and_its_instance() -> None:
    engine = started(lambda run: [Chunk(run.request_id, "a", 1), WorkerDied("worker 4242 exited")])
    asyncio.run(engine.requests.on_generate(msg(request())))
    *chunks, failed = engine.bus.sent("stream.r1")
    assert chunks == [TokenChunk(request_id="r1", text="a", tokens=1)]
    assert isinstance(failed, Failed) and failed.code is ErrorCode.ENGINE_FAILED
    assert engine.node.instances == {} and engine.node.bound == {}
    assert engine.manager.regions == {}  # its KV and weights released
    (status,) = engine.bus.sent(subjects.node_heartbeat())  # the scheduler hears of it now
    assert isinstance(status, NodeStatus) and status.instances == ()


def test_a_cancel_reaches_the_worker_running_the_request() -> None:
    engine = started(says("x"))
    cancelled: list[bool] = []

    def script(run: Run) -> list[Chunk | Done | BaseException]:
        engine.node.cancel(run.request_id, by_client=True)  # the client's cancel, mid-request
        cancelled.append(engine.node.cancels[run.request_id][0]())
        return [Done(run.request_id, FinishReason.CANCELLED, 0, None)]

    engine.node.instances["m"].bound.worker.script = script  # type: ignore[attr-defined]
    asyncio.run(engine.requests.on_generate(msg(request())))
    assert cancelled == [True] and engine.node.instances["m"].bound.worker.cancelled == ["r1"]  # type: ignore[attr-defined]
    (final,) = engine.bus.sent("stream.r1")
    assert isinstance(final, Finished) and final.finish_reason is FinishReason.CANCELLED


def test_a_start_the_node_has_no_room_for_is_refused_and_holds_nothing() -> None:
    engine = parts(FakeMemoryManager(50), FakePool())
    asyncio.run(engine.starts.on_start(msg(StartInstance(model=record(weight_bytes=100)))))
    (refused,) = engine.bus.replies
    assert isinstance(refused, Rejected) and refused.code is ErrorCode.NO_CAPACITY
    assert engine.pool.taken == [] and engine.manager.regions == {} and engine.node.starting == {}


def test_a_start_whose_kv_does_not_fit_leaves_its_weights_resident_and_idle() -> None:
    # 100 bytes of weights fit, the KV cache's floor of 64 (a context of 64 tokens, a byte each) not.
    engine = parts(FakeMemoryManager(150), FakePool(), kv_min_tokens=64)
    asyncio.run(engine.starts.on_start(msg(StartInstance(model=record()))))
    (refused,) = engine.bus.replies
    assert isinstance(refused, Rejected) and refused.code is ErrorCode.NO_CAPACITY
    assert engine.node.instances == {} and engine.node.bound["a"].resident.users == 0
    assert engine.manager.regions == {"weights:a": 100}


def test_a_start_on_openvino_books_its_weights_and_a_request_books_its_own_kv() -> None:
    # OpenVINO's cache grows as its rows fill: no L_min floor is booked ahead (it would be the
    # whole 64-token context here); a request's admission books its own eq. 2.
    engine = started(says("hi"), budget=150)
    assert engine.manager.regions.get("m:kv", 0) == 0 and engine.manager.regions["weights:a"] == 100
    asyncio.run(engine.requests.on_generate(msg(request())))
    # Eq. 2 of the request alone (a byte a token, Ō unknown yet), the watermark over it: not the floor.
    own = recommended_bytes(required_bytes(1, [(2, 0, 4)], 0.0, 0))
    assert engine.manager.peak["m:kv"] == own < record().artifact.context_length


def test_a_requests_end_leaves_the_kv_its_cache_still_holds_reserved() -> None:
    # The worker's cache grew to 40 bytes for the request (a byte a token here) and keeps them
    # (OpenVINO's frees none): the reservation stays at that, not at nothing, so the next
    # request's admission needs no grow through the memory manager.
    def holds_40(run: Run) -> list[Chunk | Done | BaseException]:
        return [
            Chunk(run.request_id, "hi", 1),
            Done(run.request_id, FinishReason.STOP, 1, time.monotonic(), kv_allocated_bytes=40),
        ]

    engine = started(holds_40, budget=150)
    asyncio.run(engine.requests.on_generate(msg(request())))
    booked = engine.manager.peak["m:kv"]
    assert 0 < booked < 40 and engine.manager.regions["m:kv"] == booked  # kept, not shrunk
    resizes = len(engine.manager.calls)
    asyncio.run(engine.requests.on_generate(msg(request("r2"))))
    assert engine.manager.regions["m:kv"] == booked and len(engine.manager.calls) == resizes
    # A cache that holds nothing after its requests: the reservation goes back.
    engine = started(says("hi"), budget=150)
    asyncio.run(engine.requests.on_generate(msg(request())))
    assert engine.manager.peak["m:kv"] > 0 and engine.manager.regions.get("m:kv", 0) == 0


def test_a_second_start_of_a_model_finds_its_worker_resident() -> None:
    engine = started(says("x"))
    asyncio.run(engine.memory.unload(engine.node.instances["m"]))
    assert engine.node.bound["a"].resident.users == 0 and engine.manager.regions == {"weights:a": 100}
    asyncio.run(engine.starts.start_instance(StartInstance(model=record())))
    assert len(engine.pool.taken) == 1 and engine.node.instances["m"].start.source == "resident"  # type: ignore[union-attr]


def test_an_idle_stop_answers_with_the_stopped_models_weights_resident() -> None:
    engine = started(says("x"))
    asyncio.run(engine.starts.on_stop(msg(StopInstance(model="m", idle_since=time.time() + 60))))
    (stopped,) = engine.bus.replies
    assert isinstance(stopped, InstanceStopped) and stopped.stopped and stopped.resident == ("a",)
    assert "m" not in engine.node.instances


def test_a_heartbeat_while_an_instance_unloads_shows_its_model_served_or_resident() -> None:
    # The unload awaits the memory manager; a heartbeat sent then must not show the model
    # neither served nor resident (the scheduler would start it from disk, a test would fail).
    engine = started(says("x"))
    seen: list[NodeStatus] = []
    manager_release = engine.manager.release

    async def release(owner: str):  # type: ignore[no-untyped-def]
        seen.append(engine.node.status())
        return await manager_release(owner)

    engine.manager.release = release  # type: ignore[method-assign]
    asyncio.run(engine.memory.unload(engine.node.instances["m"]))
    assert seen
    for status in seen:
        assert "m" in {i.model for i in status.instances} or "a" in status.resident


def test_an_adapters_worker_reads_its_host_cache_copy_and_its_store_copy_where_the_loader_has_none() -> None:
    def loads(run: Run) -> list[Chunk | Done | BaseException]:  # each run the adapter's start
        load = AdapterLoad(run.adapter.name, 0.01, 0.02) if run.adapter else None
        return [
            Chunk(run.request_id, "x", 1),
            Done(run.request_id, FinishReason.STOP, 1, time.monotonic(), adapter_load=load),
        ]

    engine = started(loads)
    store = AdapterRef(name="ad", adapter_id="ad1", path="/store/a/adapters/ad1", scale=2.0, nbytes=8, keep_alive_s=60)
    asked: list[StageAdapter] = []

    def loader(ask: StageAdapter) -> Staged:
        asked.append(ask)
        return Staged(cache_dir="/dev/shm/n/adapter-ad1", hit=len(asked) > 1, repaired_blocks=0)

    def adapted(rid: str) -> Generate:
        return msgspec.structs.replace(request(rid), adapter=store)

    engine.bus.answers[subjects.loader_stage_adapter(engine.node.id)] = loader
    worker = engine.node.instances["m"].bound.worker
    for rid in ("r1", "r2"):
        asyncio.run(engine.requests.on_generate(msg(adapted(rid))))
    # Staged at its first use only; both requests read the copy.
    assert asked == [StageAdapter(path=store.path)]
    assert [r.adapter.path for r in worker.runs if r.adapter] == ["/dev/shm/n/adapter-ad1"] * 2  # type: ignore[attr-defined]

    # Dropped, it is staged again at its next use (a hit now); with no loader, the store's copy.
    engine.memory.node.instances["m"].adapters.clear()
    engine.node.instances["m"].adapter_copies.clear()
    asyncio.run(engine.requests.on_generate(msg(adapted("r3"))))
    assert len(asked) == 2 and worker.runs[-1].adapter.path == "/dev/shm/n/adapter-ad1"  # type: ignore[attr-defined]
    assert adapters.source(engine.node.instances["m"], worker.runs[-1].adapter) == "host"  # type: ignore[attr-defined]
    # Each start recorded with where it read the adapter; its load counts the staging and the
    # worker's read.
    # (The fake's worker loads it at every request: r2 read the copy r1 made, not one found.)
    records = [r for r in engine.bus.sent(subjects.cold_start_recorded()) if r.tier == "adapter"]
    assert [r.source for r in records] == ["store", "store", "host"]
    again = records[2]
    assert again.stage_s > 0 and again.phases.load_s == pytest.approx(again.stage_s + 0.01)
    assert again.worker_load_s == 0.01 and records[1].stage_s == 0.0  # staged at its first use only
    del engine.bus.answers[subjects.loader_stage_adapter(engine.node.id)]
    engine.node.instances["m"].adapters.clear()
    engine.node.instances["m"].adapter_copies.clear()
    asyncio.run(engine.requests.on_generate(msg(adapted("r4"))))
    assert worker.runs[-1].adapter == store  # type: ignore[attr-defined]
    assert adapters.source(engine.node.instances["m"], store) == "store"


def test_a_request_the_pipeline_serves_as_the_replica_takes_over_is_the_pipelines_first_token() -> None:
    # The pipelined instance's request is in flight when the node's own replica takes its place:
    # its first token ends the pipeline's cold start; the replica's ends at its own first token
    # (not at this request's, which came before the replica was ready).
    engine = parts(FakeMemoryManager(10_000), backend=TORCH)
    model, no_phases = record(), ColdStartPhases(init_s=0.0, load_s=0.0, profile_s=0.0)
    replica = bind(engine.node, "a", 100, users=1, script=says("x"))
    piped = FakeWorker()
    pipe = Bound(piped, model.artifact, Loaded(True, 0.0), Resident("a", 0, 0.0, 0.0, 0.0, 1), "pipeline")

    def replica_ready(run: Run) -> list[Chunk | Done | BaseException]:
        kv = engine.node.kv_account(model.artifact)
        engine.node.serve(model, replica, kv, PendingColdStart(time.monotonic(), no_phases, "host"))
        return says("y")(run)

    piped.script = replica_ready

    async def two_requests() -> None:
        engine.node.serve(
            model, pipe, engine.node.kv_account(model.artifact), PendingColdStart(0.0, no_phases, "pipeline")
        )
        await engine.requests.on_generate(msg(request("r1")))
        await engine.requests.on_generate(msg(request("r2")))

    asyncio.run(two_requests())
    assert [e.source for e in engine.bus.sent(subjects.cold_start_recorded())] == ["pipeline", "host"]
    assert replica.worker.runs[0].request_id == "r2"  # type: ignore[attr-defined]


def test_a_pipeline_stage_is_refused_where_the_backend_runs_none() -> None:
    engine = parts(FakeMemoryManager(10_000), backend=OPENVINO)
    stage = StartStage(model=record(), blocks=(0,), lo=0, hi=1, layers=1, nbytes=1)
    with pytest.raises(TesseraError) as refused:  # the bus answers it as a `Rejected`
        asyncio.run(engine.pipelines.start_stage(stage))
    assert refused.value.code is ErrorCode.INVALID_REQUEST and "openvino" in refused.value.message
    assert engine.manager.regions == {}


def test_a_torch_node_refuses_a_model_whose_checkpoint_its_loader_cannot_write() -> None:
    engine = parts(FakeMemoryManager(10_000), FakePool(), backend=TORCH)
    engine.bus.answers[subjects.loader_import("n")] = lambda m: Rejected(code=ErrorCode.UNAVAILABLE, message="x")
    with pytest.raises(TesseraError, match="cannot start on a torch node"):
        asyncio.run(engine.starts.start_instance(StartInstance(model=record())))


def test_every_backend_names_a_worker_entry_function_that_exists() -> None:
    for backend in BACKENDS.values():
        module, _, function = backend.entry.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), backend.name


async def test_the_controller_built_on_fakes_starts_its_parts_and_serves() -> None:
    book, bus = FakeMemoryManager(10_000, {"weights:old": 5}), FakeBus()
    pool = FakePool(lambda: FakeWorker(says("ok")))
    engine = EngineService(settings(), bus, workers=pool, memory_manager=book)  # type: ignore[arg-type]
    await engine.start()
    try:
        assert book.released == ["*"] and book.regions == {}  # an earlier run's reservations dropped
        await engine.starts.on_start(msg(StartInstance(model=record())))
        await engine.requests.on_generate(msg(request()))
        ready, accepted = bus.replies
        assert isinstance(ready, InstanceReady) and accepted == GenerateAccepted(request_id="r1")
        assert isinstance(bus.sent("stream.r1")[-1], Finished)
    finally:
        await engine.close()
    assert pool.taken[0].stopped
