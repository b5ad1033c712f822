"""The tensor arena (`cuda_ext`) on its host fallback: ranges, content-hash reuse, batched copies.

The same calls run on CUDA; the `gpu` tests at the end repeat the copy and reuse checks there.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the arena is built on torch (the `test` extra installs it)")

import torch

from cuda_ext import (
    ArenaFull,
    Block,
    CopyEngine,
    HostImage,
    RangeAllocator,
    Span,
    TensorArena,
    TensorSpec,
    content_digest,
)
from cuda_ext.copies import byte_view, coalesce

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none")


def model(seed: int, layers: int = 3, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {"embed": torch.randn(10, 8, generator=g).to(dtype)}
    for i in range(layers):
        out[f"layer{i}.w"] = torch.randn(8, 8, generator=g).to(dtype)
        out[f"layer{i}.b"] = torch.randn(3, generator=g).to(dtype)  # 12 bytes: not a multiple of the alignment
    return out


def groups_of(image: HostImage) -> list[list[TensorSpec]]:
    return [[s] for s in image.specs]


# Ranges.


def test_ranges_are_aligned_and_a_fresh_arena_packs_them_back_to_back() -> None:
    alloc = RangeAllocator(4096, alignment=256)
    a, b, c = alloc.allocate(1), alloc.allocate(300), alloc.allocate(256)
    assert [a, b, c] == [Block(0, 256), Block(256, 512), Block(768, 256)]
    assert all(x.offset % 256 == 0 for x in (a, b, c))
    assert alloc.used_bytes == 1024 and alloc.free_bytes == 4096 - 1024


def test_a_freed_range_is_reused_and_neighbours_coalesce() -> None:
    alloc = RangeAllocator(1024, alignment=256)
    blocks = [alloc.allocate(256) for _ in range(4)]
    with pytest.raises(ArenaFull):
        alloc.allocate(1)
    alloc.free(blocks[1])
    assert alloc.allocate(200) == Block(256, 256)  # the hole is reused, first fit
    alloc.free(Block(256, 256))
    alloc.free(blocks[2])
    assert alloc.largest_free == 512  # [256, 768) is one range again
    assert alloc.allocate(512) == Block(256, 512)


def test_allocate_many_is_contiguous_where_it_fits_and_all_or_nothing() -> None:
    alloc = RangeAllocator(2048, alignment=256)
    hole = alloc.allocate(256)
    alloc.allocate(256)
    alloc.free(hole)
    blocks = alloc.allocate_many([300, 100, 256])  # 1024 bytes: does not fit the 256-byte hole
    assert [b.offset for b in blocks] == [512, 1024, 1280]
    with pytest.raises(ArenaFull):
        alloc.allocate_many([256, 256, 256, 256])  # 768 bytes free, in two pieces
    assert alloc.used_bytes == 256 + 1024  # the failed call left nothing allocated
    assert [b.offset for b in alloc.allocate_many([256, 256, 256])] == [0, 1536, 1792]  # pieces where no range fits all


def test_freeing_what_is_not_allocated_is_refused() -> None:
    alloc = RangeAllocator(1024)
    block = alloc.allocate(10)
    alloc.free(block)
    with pytest.raises(ValueError):
        alloc.free(block)


def test_a_view_is_typed_aligned_and_shares_the_arena_memory() -> None:
    arena = TensorArena(1 << 16, device="cpu")
    block = arena.ledger.allocator.allocate(4 * 6)
    t = arena.view(block, torch.float32, (2, 3))
    t.fill_(1.5)
    assert t.dtype == torch.float32 and t.shape == (2, 3)
    assert t.data_ptr() % arena.alignment == arena.storage.data_ptr() % arena.alignment
    assert arena.storage[block.offset : block.offset + 24].view(torch.float32).tolist() == [1.5] * 6
    with pytest.raises(ValueError):
        arena.view(block, torch.float32, (100,))


# Content-hash reuse.


def test_a_load_copies_every_tensor_exactly() -> None:
    tensors = model(0, dtype=torch.bfloat16)
    image = HostImage.of(tensors)
    arena = TensorArena(1 << 16, device="cpu")
    loaded = arena.load([image.specs], image)
    loaded.synchronize()
    assert loaded.copied_bytes == image.nbytes  # with the padding between tensors, copied along
    assert loaded.reused_bytes == 0
    for name, t in tensors.items():
        assert loaded.tensors[name].dtype == torch.bfloat16
        assert torch.equal(loaded.tensors[name], t)
    # Packed in access order in the image and back to back in the arena: one copy for all.
    assert loaded.transfers == 1


def test_each_group_is_copied_apart_so_that_compute_can_wait_for_it_alone() -> None:
    image = HostImage.of(model(0))
    loaded = TensorArena(1 << 16, device="cpu").load(groups_of(image), image)
    assert loaded.transfers == len(image.specs) and len(loaded.waits) == len(image.specs)


def test_a_released_model_stays_resident_and_its_restart_copies_nothing() -> None:
    image = HostImage.of(model(0))
    arena = TensorArena(1 << 16, device="cpu")
    first = arena.load(groups_of(image), image)
    arena.release(first)
    assert len(arena.idle()) == len(image.specs)
    assert arena.digests() == {s.digest for s in image.specs}  # what a worker reports it holds
    again = arena.load(groups_of(image), image)
    assert again.copied_bytes == 0 and again.transfers == 0
    assert again.reused_bytes == sum(s.nbytes for s in image.specs)
    assert all(again.tensors[n].data_ptr() == first.tensors[n].data_ptr() for n in first.tensors)
    assert arena.idle() == []


def test_a_fine_tune_sharing_a_base_copies_only_what_differs() -> None:
    base = model(0)
    tuned = dict(base)
    tuned["layer2.w"] = base["layer2.w"] + 1  # one tensor of the fine-tune is its own
    arena = TensorArena(1 << 16, device="cpu")
    base_image = HostImage.of(base)
    arena.release(arena.load(groups_of(base_image), base_image))
    tuned_image = HostImage.of(tuned)
    loaded = arena.load(groups_of(tuned_image), tuned_image)
    assert loaded.copied_bytes == 256  # 8 × 8 float32 in one aligned range
    assert loaded.reused_bytes == sum(t.numel() * 4 for t in base.values()) - 8 * 8 * 4
    assert arena.missing_bytes(tuned_image.specs) == 0
    for name, t in tuned.items():
        assert torch.equal(loaded.tensors[name], t)


def test_equal_tensors_within_a_model_share_one_range() -> None:
    tensors = {"norm0": torch.ones(16), "norm1": torch.ones(16), "w": torch.zeros(4)}
    image = HostImage.of(tensors)
    arena = TensorArena(1 << 12, device="cpu")
    loaded = arena.load(groups_of(image), image)
    assert loaded.tensors["norm0"].data_ptr() == loaded.tensors["norm1"].data_ptr()
    assert loaded.copied_bytes == 2 * 256  # two distinct contents, one aligned range each
    assert len(loaded.digests) == 2


def test_a_held_resident_cannot_be_evicted_and_an_idle_one_frees_its_range() -> None:
    image = HostImage.of(model(0))
    arena = TensorArena(1 << 16, device="cpu")
    loaded = arena.load(groups_of(image), image)
    digest = image.specs[0].digest
    with pytest.raises(ValueError):
        arena.evict(digest)
    arena.release(loaded)
    used = arena.used_bytes
    arena.evict(digest)
    assert arena.resident(digest) is None and arena.used_bytes < used
    again = arena.load(groups_of(image), image)  # only the evicted tensor comes back
    assert again.copied_bytes == image.slot(image.specs[0].name).numel()  # the tensor and its padding


def test_a_load_that_does_not_fit_changes_nothing() -> None:
    image = HostImage.of(model(0, layers=8))
    arena = TensorArena(1024, device="cpu")
    with pytest.raises(ArenaFull):
        arena.load(groups_of(image), image)
    assert arena.used_bytes == 0 and arena.resident_bytes() == 0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_load_short_of_room_evicts_by_tangram_cost_the_papers_worked_example() -> None:
    # Tangram eq. 2 with the numbers, scaled to bytes: a 4 KiB idle model last used a
    # minute ago (p = 0.5) and a 1 KiB one just released (p = 1), the same reload bandwidth;
    # 1 KiB is needed. Their costs are 0.5 × 4 KiB / b and 1 × 1 KiB / b: the paper evicts the
    # small one (a per-byte order would take the big one).
    clock = Clock()
    arena = TensorArena(5 * 1024, device="cpu", reload_bps=1024.0, clock=clock)
    big = HostImage.of({"w": torch.ones(1024)})
    small = HostImage.of({"w": torch.full((256,), 2.0)})
    arena.release(arena.load([big.specs], big))
    loaded_small = arena.load([small.specs], small)
    clock.now = 60.0
    arena.release(loaded_small)
    newcomer = HostImage.of({"w": torch.full((256,), 3.0)})
    loaded = arena.load([newcomer.specs], newcomer)
    assert arena.resident(small.specs[0].digest) is None
    assert arena.resident(big.specs[0].digest) is not None
    assert torch.equal(loaded.tensors["w"], torch.full((256,), 3.0))


def test_a_load_reads_a_plain_mapping_of_host_tensors_too() -> None:
    tensors = model(1)
    specs = [TensorSpec(n, content_digest(t), t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    arena = TensorArena(1 << 16, device="cpu")
    loaded = arena.load([specs], tensors)
    assert all(torch.equal(loaded.tensors[n], t) for n, t in tensors.items())


def test_the_digest_is_of_the_bytes_alone() -> None:
    t = torch.arange(6, dtype=torch.float32)
    assert content_digest(t) == content_digest(t.view(2, 3))
    assert content_digest(t) != content_digest(t + 1)


# Batched copies.


def test_spans_that_continue_each_other_coalesce_and_others_do_not() -> None:
    src = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(64, dtype=torch.uint8)
    spans = [Span(src[0:8], dst[0:8]), Span(src[8:16], dst[8:16]), Span(src[32:40], dst[16:24])]
    merged = coalesce(spans)
    assert [s.src.numel() for s in merged] == [16, 8]
    transfer = CopyEngine(torch.device("cpu")).copy([spans])
    assert transfer.nbytes == 24 and transfer.transfers == 2
    assert dst[:16].tolist() == list(range(16)) and dst[16:24].tolist() == list(range(32, 40))


def test_large_spans_are_cut_into_chunks_and_copied_whole() -> None:
    src = torch.randint(0, 255, (1000,), dtype=torch.uint8)
    dst = torch.zeros(1000, dtype=torch.uint8)
    transfer = CopyEngine(torch.device("cpu"), chunk_bytes=128).copy([[Span(src, dst)]])
    assert transfer.transfers == 8
    assert torch.equal(src, dst)


def test_byte_view_refuses_a_strided_tensor() -> None:
    with pytest.raises(ValueError):
        byte_view(torch.zeros(4, 4).t())


# On a GPU.


@pytest.mark.gpu
@needs_cuda
def test_a_pinned_image_loads_onto_the_device_on_several_streams() -> None:
    tensors = {f"t{i}": torch.randn(1 << 16) for i in range(20)}
    image = HostImage.of(tensors)
    assert image.pinned
    arena = TensorArena(64 << 20)
    assert arena.device.type == "cuda"
    loaded = arena.load([[s] for s in image.specs], image)
    loaded.synchronize()
    for name, t in tensors.items():
        assert torch.equal(loaded.tensors[name].cpu(), t)
    arena.release(loaded)
    assert arena.load([image.specs], image).copied_bytes == 0


@pytest.mark.gpu
@needs_cuda
def test_compute_waits_on_the_device_for_its_group() -> None:
    tensors = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}
    image = HostImage.of(tensors)
    arena = TensorArena(64 << 20)
    loaded = arena.load([[s] for s in image.specs], image)
    total = torch.zeros((), device=arena.device)
    for g, spec in enumerate(image.specs):
        loaded.wait(g)
        total += loaded.tensors[spec.name].sum()
    assert total.item() == sum(i * (1 << 20) for i in range(8))
