"""One arena per node, shared by processes (Tangram §4): the book (`cuda_ext.ledger`) in the
owner, the memory mapped by each worker (`cuda_ext.memory`: a host mapping here, CUDA IPC on a
GPU), the CUDA extension that makes and shares device memory (`cuda_ext.native`, built by
`cuda_ext.build`), and the engine's node arena over them (`services/engine/node_arena.py`).
The `gpu` tests at the end run the same checks on CUDA memory."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the arena's views are torch tensors (the `test` extra installs it)")

import torch

from cuda_ext import ArenaFull, HostImage, TensorArena, TensorSpec
from cuda_ext.build import build, driver_present, ensure
from cuda_ext.build import main as build_main
from cuda_ext.ledger import ArenaLedger
from cuda_ext.memory import SharedMemory
from cuda_ext.native import Native, NativeUnavailable
from services.engine.node_arena import NodeArena, arena_device

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none")


def model(seed: int, layers: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"embed": torch.randn(10, 8, generator=g)}
    for i in range(layers):
        out[f"layer{i}.w"] = torch.randn(8, 8, generator=g)
        out[f"layer{i}.b"] = torch.randn(3, generator=g)
    return out


def base_and_tune() -> tuple[dict[str, int], dict[str, int]]:
    """A model's tensors and a fine-tune's that changed one (layer2.w), as digest → bytes."""
    base = model(0)
    tune = dict(base)
    tune["layer2.w"] = base["layer2.w"] + 1
    return dict(pairs(HostImage.of(base))), dict(pairs(HostImage.of(tune)))


def pairs(image: HostImage) -> list[tuple[str, int]]:
    return [(s.digest, s.nbytes) for s in image.specs]


# The book.


def test_a_placement_packs_new_tensors_back_to_back_and_reuses_resident_ones() -> None:
    ledger = ArenaLedger(1 << 16, alignment=256)
    first = ledger.place([("a", 300), ("b", 100), ("a", 300)], "w1")
    assert first.offsets == {"a": 0, "b": 512} and first.copy == {"a", "b"}
    ledger.release("w1")
    assert set(ledger.idle()) == {"a", "b"} and ledger.resident_bytes() == 400
    second = ledger.place([("b", 100), ("c", 8)], "w2")
    assert second.offsets["b"] == 512 and second.copy == {"c"}  # b is where it was: not copied
    assert ledger.holds("w2") and not ledger.holds("w1")
    assert ledger.idle() == ["a"] and ledger.missing_bytes([("a", 300), ("d", 5)]) == 5


def test_a_placement_that_does_not_fit_takes_nothing() -> None:
    ledger = ArenaLedger(1024, alignment=256)
    ledger.place([("held", 512)], "w1")
    with pytest.raises(ArenaFull):
        ledger.place([("x", 256), ("y", 512)], "w2")
    assert ledger.digests() == {"held"} and ledger.allocator.used_bytes == 512 and not ledger.holds("w2")


# The memory, mapped by another process.


def test_a_discarded_range_gives_its_pages_back_and_reads_zeros() -> None:
    memory = SharedMemory(1 << 22)
    view = memory.view()
    view.fill_(5)
    memory.discard(1 << 20, 1 << 20)
    assert int(view[(1 << 20) : (2 << 20)].sum()) == 0
    assert int(view[: 1 << 20].sum()) == 5 << 20  # the rest is untouched


def test_an_attached_arena_loads_only_where_its_owner_places() -> None:
    owner = TensorArena(1 << 16, device="cpu", shared=True)
    attached = TensorArena.attach(owner.share())
    image = HostImage.of(model(1))
    with pytest.raises(ValueError, match="owner"):
        attached.load([image.specs], image)
    with pytest.raises(ValueError, match="shared=True"):
        TensorArena(1 << 16, device="cpu").share()


# The node's arena (the engine's).


def test_the_node_arena_holds_one_model_per_worker_and_keeps_what_a_stopped_one_held() -> None:
    base, other = HostImage.of(model(0)), HostImage.of(model(1))
    tensors = dict(pairs(base))
    arena = NodeArena(1 << 16, "CPU")
    first = arena.place("w1", tensors)
    assert first.copy == set(tensors)
    again = arena.place("w1", dict(pairs(other)))  # the worker bound another model: the first is idle
    assert not again.copy & set(tensors)
    arena.release("w1")
    assert arena.held_bytes() == (0, sum(tensors.values()) + sum(dict(pairs(other)).values()))
    assert arena.missing_bytes(tensors) == 0  # a worker that starts the first model copies nothing
    assert arena.place("w2", tensors).copy == frozenset()


def test_a_reload_after_a_failed_check_copies_again_what_the_first_load_copied() -> None:
    tensors = dict(pairs(HostImage.of(model(0))))
    arena = NodeArena(1 << 16, "CPU")
    arena.place("w1", tensors)
    assert arena.place("w1", tensors, discard=True).copy == set(tensors)
    assert arena.place("w1", tensors).copy == frozenset()  # an ordinary reload reuses them


def test_a_load_whose_copy_failed_leaves_nothing_a_later_load_would_trust(tmp_path: Path) -> None:
    path, sizes = checkpoint(tmp_path, model(4))
    arena = NodeArena(1 << 16, "CPU")
    placement = arena.place("w1", sizes)
    (path / "model.safetensors").unlink()  # the copy it came from went
    with pytest.raises(OSError):
        arena.fill(placement, path)
    arena.release("w1")  # its load failed with it
    assert arena.digests() == frozenset() and arena.missing_bytes(sizes) == sum(sizes.values())


def test_evicting_a_stopped_models_tensors_spares_those_another_model_holds() -> None:
    base_t, tune_t = base_and_tune()
    arena = NodeArena(1 << 16, "CPU")
    arena.place("w1", base_t)
    arena.place("w2", tune_t)
    arena.release("w1")
    freed = arena.evict_idle(base_t)
    only_base = set(base_t) - set(tune_t)
    assert len(only_base) == 1 and freed == 256  # the base's own layer2.w: 8 × 8 float32
    assert arena.digests() == set(tune_t)


def test_the_host_arena_takes_from_the_node_budget_what_its_tensors_fill_idle_or_held() -> None:
    # Its reservation with the memory manager: the pages its tensors fill (a host arena's
    # pages are taken only when written), with what starts under way will copy; two models
    # sharing tensors count them once.
    base_t, tune_t = base_and_tune()
    arena = NodeArena(1 << 16, "CPU")
    assert arena.committed_bytes() == 0 and arena.committed_bytes(base_t) == sum(base_t.values())
    arena.place("w1", base_t)
    alone = arena.committed_bytes()
    assert alone >= sum(base_t.values())  # its ranges, aligned
    # A start of the tune under way: only its own tensor is still to come.
    assert arena.committed_bytes(tune_t) == alone + 256  # its layer2.w, 8 × 8 float32
    arena.place("w2", tune_t)
    placed = arena.committed_bytes(tune_t)  # placed: counted once, not again as still to come
    assert placed == alone + 256
    arena.release("w1")  # idle, still taking its pages until evicted
    assert arena.committed_bytes() == placed
    assert arena.committed_bytes({"another": 1 << 20}) == 1 << 16  # never past the arena


def test_idle_tensors_go_for_the_node_budget_the_cheapest_first_and_held_ones_never() -> None:
    small, big = model(0, layers=1), {"big": torch.randn(64, 64)}
    small_t, big_t = dict(pairs(HostImage.of(small))), dict(pairs(HostImage.of(big)))
    arena = NodeArena(1 << 16, "CPU")
    arena.place("w1", small_t)
    arena.place("w2", big_t)
    arena.release("w1")
    arena.release("w2")
    before = arena.committed_bytes()
    # What a start under way will bind is spared, however cheap.
    assert arena.evict_cheapest(1, keep=set(small_t) | set(big_t)) == 0
    # Used alike: eq. 2 prices a small tensor's reload lower, and one alone frees enough.
    freed = arena.evict_cheapest(100)
    assert freed == 256
    assert set(big_t) <= arena.digests() and len(arena.digests()) == len(small_t) + len(big_t) - 1
    assert arena.committed_bytes() == before - freed
    assert arena.evict_cheapest(100, keep=set(small_t)) == 16384  # spared the small ones: the big one
    arena.place("w3", big_t)  # copied again, and held: never evicted
    assert arena.evict_cheapest(1 << 16) == 0  # the idle ones cannot free that: none go
    while arena.evict_cheapest(1):
        pass
    assert arena.digests() == set(big_t)


def test_a_load_has_the_room_the_models_in_use_leave() -> None:
    tensors, other = dict(pairs(HostImage.of(model(0)))), dict(pairs(HostImage.of(model(1))))
    arena = NodeArena(1 << 16, "CPU")
    arena.place("w1", tensors)
    assert arena.room_bytes(other) == (1 << 16) - sum(tensors.values())
    arena.release("w1")  # idle tensors make way for another model's load ...
    assert arena.room_bytes(other) == 1 << 16
    # ... but not for their own model's, which will hold them.
    assert arena.room_bytes(tensors) == (1 << 16) - sum(tensors.values())


def test_a_node_device_names_its_arena() -> None:
    assert [arena_device(d) for d in ("CPU", "CUDA", "CUDA:1", "cuda:0")] == ["cpu", "cuda:0", "cuda:1", "cuda:0"]


# The CUDA extension.


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.skipif(driver_present(), reason="this machine has a CUDA driver: the gpu tests run the extension")
def test_the_extension_builds_without_a_toolkit_and_says_why_it_cannot_run_here(tmp_path: Path) -> None:
    library = build(tmp_path / "ext.so")
    with pytest.raises(NativeUnavailable, match="no CUDA driver"):
        Native(0, library)
    with pytest.raises(NativeUnavailable, match="not built"):
        Native(0, tmp_path / "missing.so")
    assert build_main(["--if-cuda", "--out", str(tmp_path / "skipped.so")]) == 0
    assert not (tmp_path / "skipped.so").exists()  # built only where a driver is


# On CUDA.


@pytest.mark.gpu
@needs_cuda
def test_the_extensions_batched_copies_match_torchs_group_by_group() -> None:
    ensure()
    image = HostImage.of(model(3, layers=6))
    groups = [[s] for s in image.specs]
    for native in (True, False):
        arena = TensorArena(1 << 20, device="cuda")
        arena._copier = arena._copier.__class__(arena.device, streams=3, chunk_bytes=1024, native=native)
        assert (arena._copier.native is not None) == native
        loaded = arena.load(groups, image)
        for g, spec in enumerate(image.specs):
            loaded.wait(g)
            assert torch.equal(loaded.tensors[spec.name].cpu(), image.tensor(spec.name)), (native, spec.name)
        assert loaded.transfers == len(image.specs)


def checkpoint(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> tuple[Path, dict[str, int]]:
    """A torch checkpoint as registration writes it: the safetensors file and the manifest."""
    import json

    from safetensors.torch import save_file

    from cuda_ext import content_digests
    from shared.artifact import TORCH_MANIFEST, TORCH_WEIGHTS

    save_file(tensors, str(tmp_path / TORCH_WEIGHTS))
    digests = content_digests(tensors)
    manifest = [
        {"name": n, "digest": digests[n], "dtype": "float32", "shape": list(t.shape)} for n, t in tensors.items()
    ]
    (tmp_path / TORCH_MANIFEST).write_text(json.dumps({"tensors": manifest}))
    return tmp_path, {digests[n]: t.numel() * 4 for n, t in tensors.items()}


def test_the_owner_fills_the_arena_from_the_checkpoint_file_and_the_worker_reads_nothing(tmp_path: Path) -> None:
    tensors = model(4)
    path, sizes = checkpoint(tmp_path, tensors)
    arena = NodeArena(1 << 16, "CPU")
    placement = arena.place("w1", sizes)
    filled = arena.fill(placement, path)
    assert filled.copy == frozenset() and filled.filled == placement.copy == set(sizes)
    from cuda_ext import content_digests

    digests = content_digests(tensors)
    specs = [TensorSpec(n, digests[n], t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    worker = TensorArena.attach(arena.handle)  # as a worker maps it
    loaded = worker.load([specs], {}, filled)  # no source: nothing is read
    assert loaded.copied_bytes == 0 and loaded.reused_bytes == 0
    for name, t in tensors.items():
        assert torch.equal(loaded.tensors[name], t), name
    assert arena.fill(arena.place("w2", sizes), path).filled == frozenset()  # resident: nothing to copy


def test_a_checkpoint_whose_file_disagrees_with_its_manifest_is_refused(tmp_path: Path) -> None:
    path, sizes = checkpoint(tmp_path, model(4))
    arena = NodeArena(1 << 16, "CPU")
    wrong = {d: n * 2 for d, n in sizes.items()}
    with pytest.raises(ValueError, match="in its manifest"):
        arena.fill(arena.place("w1", wrong), path)
