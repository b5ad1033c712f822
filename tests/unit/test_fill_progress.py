"""TIDAL §5 across processes: the engine copies a model's tensors into the node's arena in
access order, counting each batch on a shared progress (`cuda_ext.progress`), and admits the
first request once M_prefetch bytes are in; the worker's forward pass waits, unit by unit, for
its own tensors. Here what runs in one process over a real host arena (the waits and loads in
spawned processes: tests/integration/test_fill_progress.py); no torch in the progress itself."""

from __future__ import annotations

import multiprocessing
import threading
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
    pass


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
    sampling = EngineSampling(8, 2, torch.device("cpu"), gate=gate, gate_slot=mine)
    progress = FillProgress()
    load = progress.begin()
    waiter = FillWaiter(FillSignal(progress.path, load, ("a", "b")), [["a"], ["b"]])
    waiter.around = sampling.aside
    progress.advance(load, 1)
    sampling.pending = True  # a step was formed
    with sampling.turn():  # the step's turn, the node's only one
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
    assert not pending.done()  # ... and waits for the copy
    arena.fill(placement, path)
    assert pending.result() is True
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
    assert pending.result() is False  # the sharing load fails rather than read them
    waiter = FillWaiter(FillSignal(progress.path, load, tuple(sizes)), [list(sizes)])
    assert waiter.done() == FAILED
    with pytest.raises(FillFailed):
        waiter.wait(0)
    assert arena.pending(arena.place("w3", sizes))[0].result() is False  # held still by w2: never read
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
    expected = [t for t, _ in whole.steps(prompt, params)]

    sizes = checkpoint_tensor_bytes(ckpt)
    arena, placement = begun(sizes, 16 << 20)
    progress = FillProgress()
    load = progress.begin()
    order = tuple(sizes)
    from dataclasses import replace

    sent = replace(placement, copy=frozenset(), filled=placement.copy)
    engine = TorchEngine.start(ckpt, TensorArena.attach(arena.handle), sent, FillSignal(progress.path, load, order))
    got: list[list[int]] = []
    forward = threading.Thread(target=lambda: got.append([t for t, _ in engine.steps(prompt, params)]))
    forward.start()
    forward.join(0.3)
    assert forward.is_alive() and not got  # waiting for its first unit's tensors
    arena.fill(placement, ckpt, order, progress, load)
    forward.join(60)
    assert got == [expected]


# The engine's side for real: a pre-warmed torch worker process (`Worker`), its pipe, the node's arena.


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
