"""The loader's host block cache: compiled models in host memory, checked block by block.

TIDAL §4 and FaaScale §5 keep model bytes in host memory so that a start reads them from RAM,
not from the store; Tangram §3.2 decides what to evict. Here an entry is the form of an
artifact that the node's starts load (`Tier`: a compiled OpenVINO blob, or on a torch or vLLM
node the torch checkpoint), copied into a tmpfs directory (`/dev/shm` by default: host memory
that the engine's workers map directly) under a byte budget. Every stage verifies the copy
against the manifest written at materialization (a torch checkpoint's files, against its
block set's digests): a corrupted block is found by its checksum and re-read from the store,
alone. Synchronous: the service runs it on a thread.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from policy.eviction import Resident, choose_evictions, over_budget
from services.loader import blockset
from services.loader.blocks import (
    Manifest,
    bad_blocks,
    copy_blocks,
    drop_from_page_cache,
    manifest_of,
)
from services.loader.blockset import MULTICAST_BLOCK_BYTES, BlockSet, block_set_of
from services.loader.store import sha256_of
from shared.adapters import ADAPTER_CONFIG, ADAPTER_MANIFEST, ADAPTER_WEIGHTS, AdapterArtifact
from shared.artifact import TORCH_WEIGHTS, compiled_cache_dir
from shared.messages import COMPILED_TIERS, Artifact, Tier


def form_files(artifact: Artifact, device: str, tier: Tier) -> list[str]:
    """The files a start of this form reads, relative to its directory in the store
    (`compiled_cache_dir`), in the order it reads them: the one compiled blob; or the torch
    checkpoint's config, tokenizer and manifest, then its weights."""
    root = compiled_cache_dir(artifact, device, tier)
    if tier == Tier.TORCH:
        files = sorted(p.name for p in root.iterdir() if p.is_file() and p.name != TORCH_WEIGHTS)
        return [*files, TORCH_WEIGHTS]
    blobs = sorted(root.glob("*.blob"))
    if len(blobs) != 1:
        raise RuntimeError(f"expected one compiled blob for {artifact.artifact_id}, found {len(blobs)}")
    return [blobs[0].name]


def manifest_path(artifact: Artifact, device: str, tier: Tier = Tier.STEADY) -> Path:
    cache = compiled_cache_dir(artifact, device, tier)
    return cache.parent / f"{cache.name}.manifest"


def write_manifest(artifact: Artifact, device: str, tier: Tier = Tier.STEADY) -> Manifest:
    """Called once the blob is materialized: the checksums every later copy is held to."""
    blobs = sorted(compiled_cache_dir(artifact, device, tier).glob("*.blob"))
    if len(blobs) != 1:
        raise RuntimeError(f"expected one compiled blob for {artifact.artifact_id}, found {len(blobs)}")
    manifest = manifest_of(blobs[0])
    manifest_path(artifact, device, tier).write_bytes(msgspec.msgpack.encode(manifest))
    return manifest


def read_manifest(artifact: Artifact, device: str, tier: Tier = Tier.STEADY) -> Manifest:
    path = manifest_path(artifact, device, tier)
    if not path.exists():  # materialized before manifests existed: the store copy is the truth
        return write_manifest(artifact, device, tier)
    return msgspec.msgpack.decode(path.read_bytes(), type=Manifest)


def block_set(
    artifact: Artifact, device: str, tier: Tier = Tier.STEADY, block_bytes: int = MULTICAST_BLOCK_BYTES
) -> BlockSet:
    """The form's files (`form_files`) as a multicast's block set (SHA-256 per block), written
    beside them in the store the first time it is asked for: every node that moves it reads
    this one (so `block_bytes` counts only on that first call)."""
    cache = compiled_cache_dir(artifact, device, tier)
    path = cache.parent / f"{cache.name}.blocks"
    if path.exists():
        return msgspec.msgpack.decode(path.read_bytes(), type=BlockSet)
    bs = block_set_of(cache, form_files(artifact, device, tier), f"{artifact.artifact_id}/{device}/{tier}", block_bytes)
    tmp = path.with_suffix(f".tmp{id(bs)}")
    tmp.write_bytes(msgspec.msgpack.encode(bs))
    tmp.replace(path)  # atomic: two nodes asking at once write the same bytes
    return bs


ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_MANIFEST, ADAPTER_WEIGHTS)
ADAPTER_ENTRY = "adapter"
"""What the cache's listing says of an adapter's entry, where a model's says its tier."""


def adapter_key(adapter_id: str) -> str:
    """An adapter's entry (and directory) in the cache, beside the artifacts' ids."""
    return f"{ADAPTER_ENTRY}-{adapter_id}"


def _adapter_whole(store: Path, copy: Path, sha256: str) -> bool:
    """`copy` holds the adapter kept at `store`: its weights by the manifest's SHA-256, its
    config and manifest (a few hundred bytes) by their bytes."""
    try:
        small = all((copy / f).read_bytes() == (store / f).read_bytes() for f in (ADAPTER_CONFIG, ADAPTER_MANIFEST))
        return small and sha256_of(copy / ADAPTER_WEIGHTS) == sha256
    except OSError:
        return False


@dataclass(frozen=True)
class StageResult:
    cache_dir: Path
    hit: bool
    repaired_blocks: int


class HostCache:
    def __init__(self, root: Path, budget_bytes: int, on_evict: Callable[[str], None] | None = None) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.on_evict = on_evict
        self.reserved: dict[str, int] = {}
        """Bytes held for copies still arriving (`reserve`), by artifact: counted against the
        budget, never chosen for eviction, until `adopt` (or `evict`) ends them."""
        """Told each artifact whose copy is removed (the loader stops serving it to peers)."""
        self.entries: dict[str, Resident] = {}
        self.tiers: dict[str, Tier] = {}
        """The tier cached per artifact: one per artifact, the one its starts load."""
        shutil.rmtree(root, ignore_errors=True)  # a restarted loader starts empty and honest
        root.mkdir(parents=True, exist_ok=True)

    @property
    def used_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values()) + sum(self.reserved.values())

    def _dir(self, artifact: Artifact, device: str, tier: Tier) -> Path:
        return self.root / artifact.artifact_id / compiled_cache_dir(artifact, device, tier).name

    def stage(self, artifact: Artifact, device: str, tier: Tier = Tier.STEADY) -> StageResult:
        """Make the artifact's compiled blob present and whole in host memory."""
        return self.verify(artifact, device, tier) or self.fill(artifact, device, tier)

    def verify(self, artifact: Artifact, device: str, tier: Tier = Tier.STEADY) -> StageResult | None:
        """A hit: the cached copy, checked block by block (bad blocks re-read from the store).
        None when the artifact (this tier of it) is not cached."""
        if self.lookup(artifact, tier) is None:
            return None
        return self.check(artifact, device, tier)

    def lookup(self, artifact: Artifact, tier: Tier = Tier.STEADY) -> Resident | None:
        """The entry if this tier of the artifact is cached (counted as a use), unchecked."""
        entry = self.entries.get(artifact.artifact_id)
        if entry is None or self.tiers.get(artifact.artifact_id) != tier:
            return None
        entry.uses += 1
        entry.last_used = time.time()
        return entry

    def place(self, artifact: Artifact, device: str, tier: Tier = Tier.STEADY) -> Path:
        return self._dir(artifact, device, tier)

    def check(self, artifact: Artifact, device: str, tier: Tier = Tier.STEADY) -> StageResult:
        """Check the cached copy block by block; re-read the bad blocks from the store."""
        if tier == Tier.TORCH:
            return self._check_set(artifact, device, tier)
        manifest = read_manifest(artifact, device, tier)
        dst_dir = self._dir(artifact, device, tier)
        dst = dst_dir / manifest.name
        bad = bad_blocks(dst, manifest)
        if bad:
            copy_blocks(compiled_cache_dir(artifact, device, tier) / manifest.name, dst, manifest, bad)
        return StageResult(dst_dir, True, len(bad))

    def fill(self, artifact: Artifact, device: str, tier: Tier = Tier.STEADY) -> StageResult:
        """A miss: copy the blob in from the store, checking every block as it is read."""
        if tier == Tier.TORCH:
            bs = block_set(artifact, device, tier)
            size = bs.size
        else:
            manifest = read_manifest(artifact, device, tier)
            size = manifest.size
        dst_dir = self._dir(artifact, device, tier)
        now = time.time()
        self.evict(artifact.artifact_id)  # another tier of it, if cached
        self._make_room(size, now)
        dst_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        src = compiled_cache_dir(artifact, device, tier)
        if tier == Tier.TORCH:
            copy_set(src, dst_dir, bs)
        else:
            copy_blocks(src / manifest.name, dst_dir / manifest.name, manifest)
        self.entries[artifact.artifact_id] = Resident(artifact.artifact_id, size, time.perf_counter() - t0, now, now)
        self.tiers[artifact.artifact_id] = tier
        return StageResult(dst_dir, False, 0)

    def verify_adapter(self, adapter: AdapterArtifact) -> StageResult | None:
        """A hit: a LoRA adapter's kept files (issue 34: a few megabytes) in host memory,
        checked whole, copied again where they fail (`repaired_blocks` 1). None: not cached."""
        key = adapter_key(adapter.adapter_id)
        entry = self.entries.get(key)
        if entry is None:
            return None
        entry.uses += 1
        entry.last_used = time.time()
        if _adapter_whole(Path(adapter.path), self.root / key, adapter.sha256):
            return StageResult(self.root / key, True, 0)
        self.fill_adapter(adapter)
        return StageResult(self.root / key, True, 1)

    def fill_adapter(self, adapter: AdapterArtifact) -> StageResult:
        """A miss: the adapter's files copied in from the store, beside the models' blobs under
        the same budget and the same eviction by cost, and checked as they land."""
        key = adapter_key(adapter.adapter_id)
        src, dst, now = Path(adapter.path), self.root / key, time.time()
        self.evict(key)
        nbytes = sum((src / f).stat().st_size for f in ADAPTER_FILES)
        self._make_room(nbytes, now)
        t0 = time.perf_counter()
        tmp = self.root / f"{key}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for f in ADAPTER_FILES:
            shutil.copyfile(src / f, tmp / f)
        if not _adapter_whole(src, tmp, adapter.sha256):
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"the store's copy of adapter {adapter.adapter_id} fails its SHA-256")
        tmp.rename(dst)
        self.entries[key] = Resident(key, nbytes, time.perf_counter() - t0, now, now)
        return StageResult(dst, False, 0)

    def _check_set(self, artifact: Artifact, device: str, tier: Tier) -> StageResult:
        """`check` of a form of several files (the torch checkpoint), by its multicast block
        set's SHA-256s (its files are moved as one set)."""
        bs = block_set(artifact, device, tier)
        dst_dir = self._dir(artifact, device, tier)
        bad = blockset.bad_blocks(dst_dir, bs)
        if bad:
            copy_set(compiled_cache_dir(artifact, device, tier), dst_dir, bs, bad)
        return StageResult(dst_dir, True, len(bad))

    def reserve(self, artifact: Artifact, device: str, tier: Tier, nbytes: int) -> Path:
        """Room for a copy that arrives by other means (a multicast): evictions by cost as a
        fill makes them; the directory it goes in."""
        self.evict(artifact.artifact_id)
        self._make_room(nbytes, time.time())
        self.reserved[artifact.artifact_id] = nbytes
        place = self._dir(artifact, device, tier)
        place.mkdir(parents=True, exist_ok=True)
        return place

    def adopt(self, artifact: Artifact, tier: Tier, nbytes: int, load_s: float) -> None:
        """Count a copy that arrived in a reserved place as cached."""
        now = time.time()
        self.reserved.pop(artifact.artifact_id, None)
        self.entries[artifact.artifact_id] = Resident(artifact.artifact_id, nbytes, load_s, now, now)
        self.tiers[artifact.artifact_id] = tier

    def _make_room(self, nbytes: int, now: float) -> None:
        need = over_budget(self.entries.values(), self.budget_bytes - nbytes - sum(self.reserved.values()))
        for key in choose_evictions(self.entries.values(), need, now):
            self.evict(key)

    def evict(self, artifact_id: str) -> int:
        entry = self.entries.pop(artifact_id, None)
        self.tiers.pop(artifact_id, None)
        self.reserved.pop(artifact_id, None)
        if self.on_evict is not None:
            self.on_evict(artifact_id)
        shutil.rmtree(self.root / artifact_id, ignore_errors=True)
        return entry.nbytes if entry else 0

    def evict_all(self) -> tuple[list[str], int]:
        keys = list(self.entries)
        return keys, sum(self.evict(k) for k in keys)


def copy_set(src: Path, dst: Path, bs: BlockSet, blocks: list[int] | None = None) -> None:
    """Copy the given blocks (all when None) of a block set from `src` into `dst`, checking
    each: a block that does not match its digest in the store is an error, not a copy."""
    blockset.prepare(dst, bs)
    for i in range(bs.blocks) if blocks is None else blocks:
        data = blockset.read_block(src, bs, i)
        if not blockset.block_ok(bs, i, data):
            raise RuntimeError(f"block {i} of {bs.set_id} does not match its digest in the store")
        blockset.write_block(dst, bs, i, data)


def forget_store_pages(artifact: Artifact, device: str) -> None:
    """Drop the store's copies of the blobs from the OS page cache: the next start reads disk."""
    for tier in COMPILED_TIERS:
        for blob in compiled_cache_dir(artifact, device, tier).glob("*.blob"):
            drop_from_page_cache(blob)
