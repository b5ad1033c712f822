"""TIDAL §5 across processes: the engine copies a model's tensors into the node's arena in
access order, counting each batch on a shared progress (`cuda_ext.progress`), and admits the
first request once M_prefetch bytes are in; the worker's forward pass waits, unit by unit, for
its own tensors. Here the waits and loads that run in real spawned processes (a waiting child,
a torch worker); the in-process checks are in `tests/unit/test_fill_progress.py`."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from cuda_ext.progress import FillFailed, FillProgress, FillSignal, FillWaiter
from services.engine import node_arena
from services.engine.node_arena import NodeArena

pytest.importorskip("torch", reason="the checkpoints here are written with torch")

import torch

from tests.unit.test_arena_sharing import checkpoint
from tests.unit.test_fill_progress import begun

if TYPE_CHECKING:
    from services.engine.worker_pool import Worker
    from shared.messages import Artifact


def _wait_in_child(signal: FillSignal, units: list[list[str]], unit: int, conn: Connection) -> None:
    waiter = FillWaiter(signal, units, timeout_s=60)
    conn.send("waiting")
    try:
        waiter.wait(unit)
        conn.send(waiter.done())
    except FillFailed as e:
        conn.send(f"failed: {e}")


def child(
    signal: FillSignal, units: list[list[str]], unit: int
) -> tuple[multiprocessing.process.BaseProcess, Connection]:
    ctx = multiprocessing.get_context("spawn")
    parent, end = ctx.Pipe()
    p = ctx.Process(target=_wait_in_child, args=(signal, units, unit, end))
    p.start()
    assert parent.recv() == "waiting"
    return p, parent


def test_a_unit_waits_in_another_process_until_its_tensors_and_those_before_it_are_counted() -> None:
    progress = FillProgress()
    load = progress.begin()
    signal = FillSignal(progress.path, load, ("a", "b", "c", "d"))
    units = [["a"], ["x", "c"], ["b", "d"]]  # x is resident: not waited for
    progress.advance(load, 2)  # a and b are in; unit 1 needs c
    p, conn = child(signal, units, 1)
    assert not conn.poll(0.2)  # still waiting (nothing to wait for would have answered)
    progress.advance(load, 3)
    assert conn.recv() >= 3
    p.join(30)


def test_a_unit_of_another_load_does_not_take_an_earlier_loads_count() -> None:
    progress = FillProgress()
    first = progress.begin()
    progress.advance(first, 4)
    second = progress.begin()  # the worker's next load: its count starts again
    p, conn = child(FillSignal(progress.path, second, ("a",)), [["a"]], 0)
    assert not conn.poll(0.2)
    progress.advance(second, 1)
    assert conn.recv() == 1
    p.join(30)


def test_a_failed_fill_fails_the_waiting_unit_instead_of_hanging_it() -> None:
    progress = FillProgress()
    load = progress.begin()
    p, conn = child(FillSignal(progress.path, load, ("a", "b")), [["a"], ["b"]], 1)
    progress.fail(load)
    assert str(conn.recv()).startswith("failed")
    p.join(30)


def _artifact(ckpt: Path) -> Artifact:
    from shared.messages import Artifact

    return Artifact("tiny", str(ckpt), "s", 2048, 1, 1)


async def _tokens(worker: Worker, prompt: list[int]) -> tuple[str, int]:
    """A greedy completion's text and token count."""
    from services.engine.node import Cancelled
    from services.engine.worker_wire import Chunk, Run
    from shared.messages import SamplingParams

    run = Run("r", "s", tuple(prompt), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), 0.0)
    text, tokens = "", 0
    async for msg in worker.generate(run, Cancelled()):
        if isinstance(msg, Chunk):
            text, tokens = text + msg.text, tokens + msg.tokens
    return text, tokens


@pytest.fixture
def tiny(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """A tiny Llama's torch checkpoint and its tensors' sizes (digest → bytes)."""
    from shared.artifact import checkpoint_tensor_bytes
    from tests.unit.test_torch_batch_tiny import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path)
    return ckpt, checkpoint_tensor_bytes(ckpt)


def third_batch_held(monkeypatch: pytest.MonkeyPatch, fail: bool) -> threading.Event:
    """Host fills copy a batch per tensor, and the third waits for the event returned (after
    admission at 0 bytes, once the load is done): then it copies, or with `fail` its copy
    fails. Not set within 60 s, it fails either way."""
    from cuda_ext.memory import SharedMemory

    monkeypatch.setattr(node_arena, "FILL_BATCH_BYTES", 1)
    copy = SharedMemory.copy_from_file
    batches = iter(range(1000))
    go = threading.Event()

    def held(self: SharedMemory, path: Path, spans: list[tuple[int, int, int]], threads: int = 0) -> None:
        if next(batches) == 2 and (not go.wait(60) or fail):
            raise OSError("the host cache's copy went" if fail else "the load was not admitted before its copy ended")
        copy(self, path, spans, threads)

    monkeypatch.setattr(SharedMemory, "copy_from_file", held)
    return go


async def admitted_at_zero(
    arena: NodeArena, ckpt: Path, sizes: dict[str, int], go: threading.Event
) -> tuple[Worker, asyncio.Future[tuple[str, int]]]:
    """A torch worker on `arena` that loaded the tiny model admitted at 0 bytes, a greedy
    request sent to it, and the held batch (`third_batch_held`) let go."""
    from services.engine.backends import TORCH, WorkerSpec
    from services.engine.worker_pool import Worker

    worker = Worker(TORCH, WorkerSpec("CPU", 1, kv_tokens=512, max_batch=2, arena=arena))
    try:
        await worker.ready(300)
        await worker.load(_artifact(ckpt), None, str(ckpt), 300, tensors=sizes, admit_bytes=0)
    except BaseException:
        worker.stop()
        raise
    request = asyncio.ensure_future(_tokens(worker, list(b"hello")))
    await asyncio.sleep(0)  # sync-ok: the request is sent (no time passes)
    go.set()
    return worker, request


def test_a_worker_admitted_before_its_copy_ends_answers_as_one_given_it_whole(
    tiny: tuple[Path, dict[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.engine.backends import TORCH, WorkerSpec
    from services.engine.worker_pool import Worker

    ckpt, sizes = tiny
    # A load that waited for the whole copy would never be done, and the copy fails after 60 s.
    go = third_batch_held(monkeypatch, fail=False)

    async def main() -> tuple[tuple[str, int], tuple[str, int], int]:
        arena = NodeArena(16 << 20, "CPU")
        worker, request = await admitted_at_zero(arena, ckpt, sizes, go)
        try:
            streamed = await request
            await asyncio.to_thread(worker.stop)
            arena.evict_idle(sizes)
            worker = Worker(TORCH, WorkerSpec("CPU", 1, kv_tokens=512, max_batch=2, arena=arena))
            await worker.ready(300)
            await worker.load(_artifact(ckpt), None, str(ckpt), 300, tensors=sizes)  # whole first
            return streamed, await _tokens(worker, list(b"hello")), arena.held_bytes()[0]
        finally:
            worker.stop()

    streamed, whole, held = asyncio.run(main())
    assert whole[1] == 6 and streamed == whole
    assert held == sum(sizes.values())


def test_a_copy_that_fails_after_admission_fails_the_request_and_stops_the_worker(
    tiny: tuple[Path, dict[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.engine import worker_pool
    from tests.helpers.cluster import wait_for

    ckpt, sizes = tiny
    go = third_batch_held(monkeypatch, fail=True)

    async def main() -> tuple[str, bool, bool]:
        arena = NodeArena(16 << 20, "CPU")
        worker, request = await admitted_at_zero(arena, ckpt, sizes, go)
        try:
            try:
                await request
                error = ""
            except (RuntimeError, worker_pool.WorkerDied) as e:
                error = str(e)
            await asyncio.to_thread(wait_for, lambda: worker.dead, 60, "the worker stopped on its fill's failure")
            again = arena.place("next", sizes)
            return error, worker.dead, again.copy == set(sizes)
        finally:
            worker.stop()

    error, dead, copied_afresh = asyncio.run(main())
    assert error  # the request failed rather than compute on missing weights
    assert dead and copied_afresh  # the next load copies every tensor again


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none")
def test_the_extension_counts_a_cuda_fill_as_it_lands_and_admits_before_its_end(tmp_path: Path) -> None:
    from cuda_ext.build import ensure

    ensure()
    big = {f"layer{i}.w": torch.randn(1024, 1024) for i in range(24)}  # 4 MiB each: chunks of many spans
    path, sizes = checkpoint(tmp_path, big)
    arena, placement = begun(sizes, 256 << 20, "CUDA")
    progress = FillProgress()
    load = progress.begin()
    order = list(sizes)
    counts: list[int] = []
    half = sum(sizes.values()) // 2
    filled = arena.fill(placement, path, order, progress, load, half, lambda: counts.append(progress.done(load)))
    # Admitted from the count once half was in (unless the copy ended before the watcher looked).
    assert all(c >= len(order) // 2 for c in counts)
    assert progress.done(load) == len(order)
    assert arena.fill_bps > 0
    digests = {d: n for n, d in zip(big, sizes, strict=True)}
    from cuda_ext import TensorSpec

    specs = [TensorSpec(n, d, torch.float32, (1024, 1024)) for d, n in digests.items()]
    from tests.integration.test_arena_sharing import _load_in_child, in_child

    copied, reused, total = in_child(_load_in_child, arena.handle, specs, filled)[0]
    assert copied == 0 and reused == 0
    assert total == pytest.approx(float(big["layer1.w"].sum()), rel=1e-4)
