"""TIDAL §5 across processes: the engine copies a model's tensors into the node's arena in
access order, counting each batch on a shared progress (`cuda_ext.progress`), and admits the
first request once M_prefetch bytes are in; the worker's forward pass waits, unit by unit, for
its own tensors. Real processes and a real host arena; no torch in the progress itself."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from cuda_ext.ledger import Placement
from cuda_ext.progress import FAILED, FillFailed, FillProgress, FillSignal, FillWaiter
from services.engine import node_arena
from services.engine.node_arena import NodeArena

pytest.importorskip("torch", reason="the checkpoints here are written with torch")

import torch

from tests.unit.test_arena_sharing import checkpoint, model

if TYPE_CHECKING:
    from services.engine.worker_pool import Worker
    from shared.messages import Artifact


def filling(tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path, dict[str, int], NodeArena, Placement]:
    """A small model, its checkpoint and its tensors' sizes, and a node arena where worker w1's
    load of it is placed and its fill begun."""
    tensors = model(4)
    path, sizes = checkpoint(tmp_path, tensors)
    return (tensors, path, sizes, *begun(sizes))


def begun(sizes: dict[str, int], capacity: int = 1 << 16, device: str = "CPU") -> tuple[NodeArena, Placement]:
    """A node arena where worker w1's load of `sizes` is placed and its fill begun."""
    arena = NodeArena(capacity, device)
    placement = arena.place("w1", sizes)
    arena.begin_fill(placement)
    return arena, placement


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


def test_the_units_needs_are_the_running_maximum_of_their_tensors_ranks(tmp_path: Path) -> None:
    progress = FillProgress()
    waiter = FillWaiter(FillSignal(progress.path, progress.begin(), ("a", "b", "c")), [["c"], ["a"], ["z"], ["b"]])
    assert waiter.needed == [3, 3, 3, 3]  # c is copied last: every unit after the first waits for it
    waiter = FillWaiter(FillSignal(progress.path, progress.begin(), ("a", "b")), [["z"], ["a"], ["b"]])
    assert waiter.needed == [0, 1, 2] and not waiter.complete
    waiter.wait(0)  # needs nothing: no wait at all


@pytest.mark.parametrize("copy_fails", [False, True], ids=["copied", "failed"])
def test_a_forward_pass_waiting_for_its_copy_steps_out_of_the_gate_and_back_in(copy_fails: bool) -> None:
    """While a step's forward pass waits for tensors still being copied, another instance has
    the node's headroom gate (`step_gate.py`): the wait is no computation. Then it takes its
    turn again and finishes the step holding it; or, its copy failed, it fails at once, with
    no turn taken again (the neighbour still holds the only one)."""
    from services.engine.step_gate import StepGate
    from services.engine.torch_engine.batching import EngineSampling

    gate = StepGate(multiprocessing.get_context("spawn"), capacity=1)
    mine, other = gate.claim(), gate.claim()
    sampling = EngineSampling(frozenset({0}), 8, 2, torch.device("cpu"), gate=gate, gate_slot=mine)
    progress = FillProgress()
    load = progress.begin()
    waiter = FillWaiter(FillSignal(progress.path, load, ("a", "b")), [["a"], ["b"]])
    waiter.around = sampling.aside
    progress.advance(load, 1)
    sampling._enter()  # the step's turn, the node's only one
    waiter.wait(0)  # its tensors are in: no wait, and the turn is kept
    assert sampling.holding
    failed: list[BaseException] = []

    def forward_pass() -> None:
        try:
            waiter.wait(1)
        except FillFailed as e:
            failed.append(e)

    forward = threading.Thread(target=forward_pass)
    forward.start()
    entered = threading.Event()

    def neighbour() -> None:
        if gate.enter(other, 0.0):
            entered.set()

    threading.Thread(target=neighbour, daemon=True).start()
    assert entered.wait(60), "the forward pass waiting for its copy kept the node's only turn"
    assert forward.is_alive()  # still waiting: unit 1's tensor is not in
    if copy_fails:
        progress.fail(load)
        forward.join(60)
        assert not forward.is_alive() and failed and not sampling.holding
        gate.leave(other)
        return
    progress.advance(load, 2)
    gate.leave(other)
    forward.join(60)
    assert not forward.is_alive() and not failed and sampling.holding  # back in its turn for the rest of the step


def test_the_fill_counts_its_batches_in_access_order_and_admits_after_the_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_arena, "FILL_BATCH_BYTES", 300)  # a batch per tensor or two
    _tensors, path, sizes, arena, placement = filling(tmp_path)
    order = list(sizes)  # the manifest's: access order
    progress = FillProgress()
    load = progress.begin()
    counts: list[int] = []
    advance = progress.advance
    monkeypatch.setattr(progress, "advance", lambda n, done: (counts.append(done), advance(n, done)))
    admitted_at: list[int] = []
    prefix = sizes[order[0]] + sizes[order[1]]
    arena.fill(placement, path, order, progress, load, prefix, lambda: admitted_at.append(counts[-1]))
    assert counts == sorted(counts) and counts[-1] == len(order) and len(counts) > 2
    assert admitted_at and admitted_at[0] >= 2  # not before the prefix was in
    assert admitted_at[0] < len(order)  # and before the rest: it streamed
    assert arena.held_bytes() == (sum(sizes.values()), 0)  # the fill's hold ended with it


def test_a_fills_tensors_are_held_until_it_ends_even_when_its_worker_dies(tmp_path: Path) -> None:
    _tensors, path, sizes, arena, placement = filling(tmp_path)
    arena.release("w1")  # its worker died mid-copy
    assert arena.held_bytes() == (sum(sizes.values()), 0)  # no eviction may take the ranges yet
    other = arena.place("w2", sizes)  # another load of the same model finds them resident ...
    (pending,) = arena.pending(other)
    assert pending.result is None  # ... and waits for the copy
    arena.fill(placement, path)
    assert pending.result is True
    arena.release("w2")
    assert arena.held_bytes() == (0, sum(sizes.values()))


def test_a_failed_fill_fails_the_loads_sharing_it_and_its_tensors_are_copied_afresh(tmp_path: Path) -> None:
    tensors, path, sizes, arena, placement = filling(tmp_path)
    other = arena.place("w2", sizes)
    (pending,) = arena.pending(other)
    progress = FillProgress()
    load = progress.begin()
    (path / "model.safetensors").unlink()  # the copy it came from went
    with pytest.raises(OSError):
        arena.fill(placement, path, (), progress, load)
    assert pending.result is False  # the sharing load fails rather than read them
    waiter = FillWaiter(FillSignal(progress.path, load, tuple(sizes)), [list(sizes)])
    assert waiter.done() == FAILED
    with pytest.raises(FillFailed):
        waiter.wait(0)
    assert arena.pending(arena.place("w3", sizes))[0].result is False  # held still by w2: never read
    for owner in ("w1", "w2", "w3"):  # their loads failed
        arena.release(owner)
    path, _ = checkpoint(tmp_path, tensors)
    again = arena.place("w4", sizes)  # idle now: evicted, and copied again
    assert again.copy == set(sizes) and arena.pending(again) == []


def test_torch_views_see_the_streamed_bytes(tmp_path: Path) -> None:
    from cuda_ext import TensorArena, TensorSpec, content_digests

    tensors = model(5)
    path, sizes = checkpoint(tmp_path, tensors)
    arena = NodeArena(1 << 16, "CPU")
    placement = arena.place("w1", sizes)
    arena.begin_fill(placement)
    filled = arena.fill(placement, path, list(sizes), None, 0, 0, None)
    digests = content_digests(tensors)
    specs = [TensorSpec(n, digests[n], t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    loaded = TensorArena.attach(arena.handle).load([specs], {}, filled)
    assert all(torch.equal(loaded.tensors[n], t) for n, t in tensors.items())


def test_a_model_bound_before_its_tensors_arrive_computes_what_a_whole_one_does(tmp_path: Path) -> None:
    """The worker's side for real: a tiny Llama bound in the node's arena before the engine has
    copied anything; its first forward pass waits at its first unit, and once the fill has run
    the greedy tokens are those of the same model loaded whole."""
    import threading

    from cuda_ext import TensorArena
    from services.engine.torch_engine.engine import TorchEngine
    from shared.artifact import checkpoint_tensor_bytes
    from shared.messages import SamplingParams
    from tests.unit.test_torch_batch_tiny import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    whole = TorchEngine.start(ckpt, TensorArena(16 << 20, device="cpu"))
    prompt = list(b"hello")
    expected = whole.generate(prompt, params).token_ids

    sizes = checkpoint_tensor_bytes(ckpt)
    arena, placement = begun(sizes, 16 << 20)
    progress = FillProgress()
    load = progress.begin()
    order = tuple(sizes)
    from dataclasses import replace

    sent = replace(placement, copy=frozenset(), filled=placement.copy)
    engine = TorchEngine.start(ckpt, TensorArena.attach(arena.handle), sent, FillSignal(progress.path, load, order))
    got: list[list[int]] = []
    forward = threading.Thread(target=lambda: got.append(engine.generate(prompt, params).token_ids))
    forward.start()
    forward.join(0.3)
    assert forward.is_alive() and not got  # waiting for its first unit's tensors
    arena.fill(placement, ckpt, order, progress, load)
    forward.join(60)
    assert got == [expected]


# The engine's side for real: a pre-warmed torch worker process (`Worker`), its pipe, the node's arena.


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


def test_a_counted_fill_admits_from_the_count_its_copy_stores_while_the_copy_goes_on(tmp_path: Path) -> None:
    """CUDA's fill path (the extension counts spans as they land, at an address) with the copy
    stood in for by one that stores the counts itself: admission comes from the count, in the
    middle of the one call."""
    import ctypes

    tensors = model(4)
    path, sizes = checkpoint(tmp_path, tensors)
    arena = NodeArena(1 << 16, "CPU")
    placement = arena.place("w1", sizes)
    progress = FillProgress()
    load = progress.begin()
    order = list(sizes)
    admitted = threading.Event()
    seen: list[int] = []

    class CountingCopy:
        counts_progress = True

        def copy_from_file(self, _path: Path, spans: list[tuple[int, int, int]], progress: int) -> None:
            word = ctypes.c_int64.from_address(progress)
            for k in range(1, len(spans) + 1):
                word.value = k
                if k == 2:  # the first two in: the prefix asked for
                    assert admitted.wait(30), "not admitted from the count"
                    seen.append(word.value)

        def discard(self, offset: int, nbytes: int) -> None: ...

    arena.memory = CountingCopy()  # type: ignore[assignment]
    prefix = sizes[order[0]] + sizes[order[1]]
    at: list[int] = []

    def admit() -> None:
        at.append(progress.done(load))
        admitted.set()

    arena.fill(placement, path, order, progress, load, prefix, admit)
    assert at == [2] and seen == [2]  # admitted once the prefix was counted, not before
    assert progress.done(load) == len(order)


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
    from tests.unit.test_arena_sharing import _load_in_child, in_child

    copied, reused, total = in_child(_load_in_child, arena.handle, specs, filled)[0]
    assert copied == 0 and reused == 0
    assert total == pytest.approx(float(big["layer1.w"].sum()), rel=1e-4)
