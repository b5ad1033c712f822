"""One arena per node, shared by processes (Tangram §4), across real spawned processes: the
memory an owner maps is the same bytes in a worker (a host mapping here, CUDA IPC on a GPU),
and a worker loads into, or binds, the owner's arena. The in-process checks of the book, the
extension and the node arena are in `tests/unit/test_arena_sharing.py`; the `gpu` tests here
run the same checks on CUDA memory."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the arena's views are torch tensors (the `test` extra installs it)")

import torch

from cuda_ext import HostImage, TensorArena, TensorSpec
from cuda_ext.build import ensure
from cuda_ext.ledger import Placement
from cuda_ext.memory import ArenaHandle, SharedMemory, attach
from cuda_ext.native import Native
from services.engine.node_arena import NodeArena
from tests.unit.test_arena_sharing import checkpoint, model, needs_cuda


def in_child(target: Callable[..., None], *args: object, replies: int = 1) -> list[object]:
    """Run `target(*args, conn)` in a spawned process: what it sent on `conn`, once it exited cleanly."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(*args, child))
    p.start()
    got = [parent.recv() for _ in range(replies)]
    p.join(60)
    assert p.exitcode == 0
    return got


def _write_in_child(handle: ArenaHandle, conn: Connection) -> None:
    view = attach(handle)
    view[100:104] = torch.tensor([7, 8, 9, 10], dtype=torch.uint8, device=view.device)
    conn.send(view[:4].cpu().tolist())


def test_shared_memory_is_the_same_bytes_in_another_process() -> None:
    memory = SharedMemory(1 << 20)
    mine = memory.view()
    mine[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    (seen,) = in_child(_write_in_child, memory.handle)
    assert seen == [1, 2, 3, 4]  # what the owner wrote, seen by the other process
    assert mine[100:104].tolist() == [7, 8, 9, 10]  # and what it wrote, seen by the owner
    memory.close()


def _load_in_child(handle: ArenaHandle, specs: list[TensorSpec], placement: Placement, conn: Connection) -> None:
    arena = TensorArena.attach(handle)
    tensors = model(0)
    loaded = arena.load([specs], {s.name: tensors[s.name] for s in specs if s.digest in placement.copy}, placement)
    loaded.synchronize()
    conn.send((loaded.copied_bytes, loaded.reused_bytes, float(loaded.tensors["layer1.w"].sum())))


def test_a_worker_loads_into_the_owners_arena_and_the_weights_outlive_it() -> None:
    """Tangram across processes: a worker binds a model where the owner's book places it and
    exits; the weights stay, so the next load (here, the owner's) copies nothing."""
    image = HostImage.of(model(0))
    owner = TensorArena(1 << 16, device="cpu", shared=True)
    placement = owner.place([image.specs])
    copied, reused, total = in_child(_load_in_child, owner.share(), image.specs, placement)[0]
    assert copied == sum(s.nbytes for s in image.specs) and reused == 0
    assert total == pytest.approx(float(image.tensor("layer1.w").sum()))
    owner.ledger.release(placement.owner)  # type: ignore[union-attr]  (the worker is gone)

    again = owner.load([image.specs], image)
    assert again.copied_bytes == 0 and again.reused_bytes == sum(s.nbytes for s in image.specs)
    for spec in image.specs:  # the bytes the other process copied
        assert torch.equal(again.tensors[spec.name], image.tensor(spec.name))


def _open_in_child(handle: ArenaHandle, conn: Connection) -> None:
    native = Native(handle.index)
    address = native.ipc_open(handle.ipc)
    conn.send(native.read(address, 4))
    native.ipc_close(address)
    view = attach(handle)
    view[8:12] = torch.tensor([5, 6, 7, 8], dtype=torch.uint8, device=view.device)
    torch.cuda.synchronize()
    conn.send(bytes(view[:4].cpu().tolist()))


@pytest.mark.gpu
@needs_cuda
def test_device_memory_is_shared_with_another_process_by_cuda_ipc() -> None:
    ensure()
    memory = SharedMemory(1 << 24, "cuda:0")
    mine = memory.view()
    assert mine.device.type == "cuda" and mine.data_ptr() == memory.address
    mine[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    replies = in_child(_open_in_child, memory.handle, replies=2)
    assert replies[0] == bytes([1, 2, 3, 4])  # read through the extension
    assert replies[1] == bytes([1, 2, 3, 4])  # and through torch's view of the opened handle
    assert mine[8:12].tolist() == [5, 6, 7, 8]


@pytest.mark.gpu
@needs_cuda
def test_a_worker_loads_into_a_cuda_arena_it_opened_by_ipc() -> None:
    ensure()
    image = HostImage.of(model(0))
    owner = TensorArena(1 << 16, device="cuda", shared=True)
    placement = owner.place([image.specs])
    copied, _, _ = in_child(_load_in_child, owner.share(), image.specs, placement)[0]
    assert copied == sum(s.nbytes for s in image.specs)
    owner.ledger.release(placement.owner)  # type: ignore[union-attr]
    again = owner.load([image.specs], image)
    assert again.copied_bytes == 0
    for spec in image.specs:
        assert torch.equal(again.tensors[spec.name].cpu(), image.tensor(spec.name))


@pytest.mark.gpu
@needs_cuda
def test_the_owner_fills_a_cuda_arena_through_pinned_staging_and_a_worker_binds_it(tmp_path: Path) -> None:
    ensure()
    tensors = model(0)
    path, sizes = checkpoint(tmp_path, tensors)
    arena = NodeArena(1 << 20, "CUDA")
    filled = arena.fill(arena.place("w1", sizes), path)
    assert filled.filled == set(sizes)
    from cuda_ext import content_digests

    digests = content_digests(tensors)
    specs = [TensorSpec(n, digests[n], t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    copied, reused, total = in_child(_load_in_child, arena.handle, specs, filled)[0]
    assert copied == 0 and reused == 0
    assert total == pytest.approx(float(tensors["layer1.w"].sum()), rel=1e-5)
