"""Files as fixed-size blocks with checksums: what the host cache stores and verifies.

A manifest lists a file's size and the CRC-32 of each block. It is written once, from the
model store, when the artifact is materialized; every copy into the host cache is checked
against it, block by block, so a corrupted block is found, named and re-read from the store
alone (FaaScale §5 moves models in blocks; the block is the unit of integrity here too).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgspec

BLOCK_BYTES = 8 * 1024 * 1024


class Manifest(msgspec.Struct, frozen=True):
    name: str
    size: int
    block_bytes: int
    crc32: tuple[int, ...]


def manifest_of(path: Path, block_bytes: int = BLOCK_BYTES) -> Manifest:
    crcs = []
    with path.open("rb") as f:
        while block := f.read(block_bytes):
            crcs.append(zlib.crc32(block))
    return Manifest(name=path.name, size=path.stat().st_size, block_bytes=block_bytes, crc32=tuple(crcs))


def bad_blocks(path: Path, manifest: Manifest) -> list[int]:
    """Indices of the blocks of `path` that do not match the manifest (all, if it is missing
    or has the wrong size)."""
    every = list(range(len(manifest.crc32)))
    try:
        if path.stat().st_size != manifest.size:
            return every
    except FileNotFoundError:
        return every
    bad = []
    with path.open("rb") as f:
        for i, expected in enumerate(manifest.crc32):
            if zlib.crc32(f.read(manifest.block_bytes)) != expected:
                bad.append(i)
    return bad


@dataclass
class CopyResult:
    copied_bytes: int
    blocks: int


def copy_blocks(src: Path, dst: Path, manifest: Manifest, blocks: list[int] | None = None) -> CopyResult:
    """Copy the given blocks (all when None) from `src` into `dst`, checking each against the
    manifest as it is read; raise if the source itself is corrupt."""
    indices = list(range(len(manifest.crc32))) if blocks is None else blocks
    mode = "r+b" if dst.exists() and blocks is not None else "wb"
    copied = 0
    with src.open("rb") as fin, dst.open(mode) as fout:
        for i in indices:
            fin.seek(i * manifest.block_bytes)
            block = fin.read(manifest.block_bytes)
            if zlib.crc32(block) != manifest.crc32[i]:
                raise OSError(f"block {i} of {src} does not match its manifest: the store copy is corrupt")
            fout.seek(i * manifest.block_bytes)
            fout.write(block)
            copied += len(block)
        if blocks is None:
            fout.truncate(manifest.size)
    return CopyResult(copied, len(indices))


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to forget the file's cached pages, so the next read comes from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
