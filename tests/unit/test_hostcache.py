"""The loader's host block cache under its byte budget (services/loader/hostcache.py): real
files, real copies; what it evicts is Tangram's choice (policy/eviction.py) on the reload
times it measured."""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

from policy.eviction import choose_evictions, over_budget
from services.loader.hostcache import HostCache, block_set, write_manifest
from shared.artifact import TORCH_MANIFEST, TORCH_WEIGHTS, compiled_cache_dir, torch_checkpoint
from shared.messages import Artifact, Tier

MB = 1024 * 1024
DEVICE = "CPU"


def named(store: Path, name: str, nbytes: int) -> Artifact:
    return Artifact(
        artifact_id=name,
        path=str(store / name),
        source_sha256=name,
        context_length=2048,
        kv_bytes_per_token=1,
        weight_bytes=nbytes,
    )


def artifact(store: Path, name: str, nbytes: int) -> Artifact:
    """An artifact in the store with a materialized blob of `nbytes` random bytes."""
    a = named(store, name, nbytes)
    blob_dir = compiled_cache_dir(a, DEVICE)
    blob_dir.mkdir(parents=True)
    (blob_dir / "model.blob").write_bytes(os.urandom(nbytes))
    write_manifest(a, DEVICE)
    return a


def on_disk(cache: HostCache) -> set[str]:
    return {p.name for p in cache.root.iterdir()}


def test_a_fill_past_the_budget_evicts_tangrams_choice_and_the_cache_stays_within_it(tmp_path: Path) -> None:
    store = tmp_path / "store"
    big, small, new = artifact(store, "big", 12 * MB), artifact(store, "small", 2 * MB), artifact(store, "new", 3 * MB)
    cache = HostCache(tmp_path / "shm", budget_bytes=16 * MB)
    assert not cache.stage(big, DEVICE).hit and not cache.stage(small, DEVICE).hit
    assert cache.used_bytes == 14 * MB and on_disk(cache) == {"big", "small"}

    # 3 MB more needs 1 MB freed: either one alone makes room; the policy picks on the reload
    # times this cache measured and how each was used.
    before = {k: copy.copy(r) for k, r in cache.entries.items()}
    expected = choose_evictions(before.values(), over_budget(before.values(), 16 * MB - 3 * MB), time.time())
    assert len(expected) == 1
    result = cache.stage(new, DEVICE)
    assert (
        not result.hit
        and (result.cache_dir / "model.blob").read_bytes()
        == (compiled_cache_dir(new, DEVICE) / "model.blob").read_bytes()
    )
    assert set(cache.entries) == {"big", "small", "new"} - set(expected)
    assert on_disk(cache) == set(cache.entries)  # the evicted copy's bytes are gone too
    assert cache.used_bytes <= cache.budget_bytes


def test_an_entry_bigger_than_what_idle_entries_free_is_still_cached_alone(tmp_path: Path) -> None:
    store = tmp_path / "store"
    a, b = artifact(store, "a", 6 * MB), artifact(store, "b", 9 * MB)
    cache = HostCache(tmp_path / "shm", budget_bytes=10 * MB)
    cache.stage(a, DEVICE)
    cache.stage(b, DEVICE)  # needs 5 MB freed: a goes
    assert set(cache.entries) == {"b"} and on_disk(cache) == {"b"}
    assert cache.stage(b, DEVICE).hit  # and b is served from the cache from then on


def test_a_hit_repairs_a_corrupted_block_from_the_store_and_a_new_tier_replaces_the_old(tmp_path: Path) -> None:
    store = tmp_path / "store"
    a = artifact(store, "a", 20 * MB)  # three 8 MiB blocks
    cache = HostCache(tmp_path / "shm", budget_bytes=64 * MB)
    staged = cache.stage(a, DEVICE)
    blob = staged.cache_dir / "model.blob"
    with blob.open("r+b") as f:
        f.seek(9 * MB)  # in the second block
        f.write(b"\xff" * 16)
    again = cache.stage(a, DEVICE)
    assert again.hit and again.repaired_blocks == 1
    assert blob.read_bytes() == (compiled_cache_dir(a, DEVICE) / "model.blob").read_bytes()

    start_dir = compiled_cache_dir(a, DEVICE, Tier.START)
    start_dir.mkdir(parents=True)
    (start_dir / "model.blob").write_bytes(os.urandom(MB))
    write_manifest(a, DEVICE, Tier.START)
    assert cache.verify(a, DEVICE, Tier.START) is None  # another tier is no hit
    cache.stage(a, DEVICE, Tier.START)
    assert cache.used_bytes == MB and cache.tiers["a"] == Tier.START
    assert not blob.exists()  # one tier per artifact: the STEADY copy went


def torch_artifact(store: Path, name: str, nbytes: int) -> Artifact:
    """An artifact in the store with a torch checkpoint: small files and `nbytes` of weights."""
    a = named(store, name, nbytes)
    ckpt = torch_checkpoint(a)
    ckpt.mkdir(parents=True)
    (ckpt / TORCH_WEIGHTS).write_bytes(os.urandom(nbytes))
    (ckpt / TORCH_MANIFEST).write_text('{"tensors": []}')
    (ckpt / "config.json").write_text('{"model_type": "llama"}')
    return a


def test_a_torch_checkpoint_is_cached_whole_and_a_corrupt_block_is_repaired(tmp_path: Path) -> None:
    """On a torch node the host cache holds the checkpoint's directory (`Tier.TORCH`), every
    file of it, checked by its block set's digests."""
    store = tmp_path / "store"
    a = torch_artifact(store, "t", 9 * MB)
    cache = HostCache(tmp_path / "shm", budget_bytes=64 * MB)
    miss = cache.stage(a, DEVICE, Tier.TORCH)
    assert not miss.hit and cache.tiers["t"] == Tier.TORCH
    files = {p.name: p.read_bytes() for p in torch_checkpoint(a).iterdir()}
    assert {p.name: p.read_bytes() for p in miss.cache_dir.iterdir()} == files
    assert cache.used_bytes == sum(len(b) for b in files.values())
    bs = block_set(a, DEVICE, Tier.TORCH)
    assert [f.path for f in bs.files][-1] == TORCH_WEIGHTS  # the small files first: read first
    with (miss.cache_dir / TORCH_WEIGHTS).open("r+b") as f:
        f.seek(5 * MB)  # inside one block
        f.write(b"\xff" * 16)
    hit = cache.stage(a, DEVICE, Tier.TORCH)
    assert hit.hit and hit.repaired_blocks == 1
    assert (hit.cache_dir / TORCH_WEIGHTS).read_bytes() == files[TORCH_WEIGHTS]
    assert cache.verify(a, DEVICE, Tier.STEADY) is None  # a compiled tier is another form


def test_room_reserved_for_a_copy_under_way_counts_against_the_budget(tmp_path: Path) -> None:
    """A copy arriving by multicast holds its bytes from `reserve` on: a fill meanwhile makes
    room around it (never evicting it) instead of overshooting the budget."""
    store = tmp_path / "store"
    big, small, arriving = (
        artifact(store, "big", 8 * MB),
        artifact(store, "small", 4 * MB),
        artifact(store, "arr", 6 * MB),
    )
    cache = HostCache(tmp_path / "shm", budget_bytes=16 * MB)
    cache.stage(big, DEVICE)
    cache.reserve(arriving, DEVICE, Tier.STEADY, 6 * MB)  # 8 + 6 of 16
    assert cache.used_bytes == 14 * MB
    cache.stage(small, DEVICE)  # 4 more: something cached must go, and the arriving copy cannot
    assert cache.used_bytes <= 16 * MB
    assert "arr" in cache.reserved and set(cache.entries) == {"small"}
    cache.adopt(arriving, Tier.STEADY, 6 * MB, 0.1)
    assert cache.reserved == {} and cache.used_bytes == 10 * MB
    cache.evict("arr")
    assert cache.used_bytes == 4 * MB
