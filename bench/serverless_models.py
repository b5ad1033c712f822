"""The 20 models of `bench/serverless.py`: distinct artifacts from two GGUFs.

The store keys an artifact by its source's content (`services/loader/store.py`), so names
registered on one file share one artifact, one worker and one reservation: twenty names on the
default GGUF would cost the node one model's memory. Each model here is a copy of its base GGUF
whose `general.name` is rewritten in place (same length, so no offset moves): a different
sha256, hence its own artifact, its own conversion, and its own worker and memory when served.
The weights stay the base's, so each copy serves exactly as its base does.

Bases: the real SmolLM2-135M (small) and the SmolLM2-360M shape with random weights from
`bench/shaped_models.py` (big: 2.5 times the bytes, a slower start and decode).
Copies are written once into `<shaped cache>/serverless/` and reused.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gguf

from bench import shaped_models

SMALL, BIG = shaped_models.REAL, "smollm2-360m"


@dataclass(frozen=True)
class BenchModel:
    name: str
    rank: int
    """Popularity rank, 0 the most requested."""
    base: str
    """`SMALL` or `BIG`."""
    path: Path


def copies_dir() -> Path:
    return shaped_models.cache_dir() / "serverless"


def tagged(name: bytes, tag: str) -> bytes:
    """`name` with its tail replaced by `tag`, the same length."""
    raw = tag.encode()
    if len(raw) >= len(name):
        raise ValueError(f"tag {tag!r} is not shorter than the name {name!r}")
    return name[: len(name) - len(raw)] + raw


def write_copy(base: Path, dest: Path, tag: str) -> None:
    """`base` copied to `dest` with `tag` at the end of its `general.name` (whole or absent)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}-", dir=dest.parent)
    os.close(fd)
    try:
        shutil.copyfile(base, tmp)
        reader = gguf.GGUFReader(tmp, "r+")
        value = reader.fields["general.name"].parts[-1]  # the string's bytes, a view into the file
        value[:] = list(tagged(bytes(value), tag))
        reader.data.flush()
        del reader
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)


def ensure_copy(base: str, tag: str) -> Path:
    dest = copies_dir() / f"{base}-{tag.strip('#')}.gguf"
    if not dest.is_file():
        write_copy(shaped_models.ensure(base), dest, tag)
    return dest


def bench_models(n: int, big_ranks: frozenset[int]) -> list[BenchModel]:
    """`n` models, by popularity rank; those at `big_ranks` on the big base."""
    out = []
    for rank in range(n):
        base = BIG if rank in big_ranks else SMALL
        name = f"sl-{rank:02d}-{'big' if base == BIG else 'small'}"
        out.append(BenchModel(name, rank, base, ensure_copy(base, f"#{rank:02d}")))
    return out
