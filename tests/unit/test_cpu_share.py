"""`cpu_share.drop_mapped_pages`: a mapped file's pages leave the process's RSS, and its
mapping still reads the file."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from services.engine.cpu_share import drop_mapped_pages

SIZE = 16 << 20


def resident_bytes_of(path: Path) -> int:
    """The resident bytes of this process's mappings of `path` (`/proc/self/smaps`)."""
    real, total, ours = os.path.realpath(path), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
                ours = len(fields) == 6 and fields[5] == real
            elif ours and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def test_a_mapped_files_pages_leave_the_rss_and_read_back(tmp_path: Path) -> None:
    weights = tmp_path / "openvino_model.bin"
    weights.write_bytes(bytes(range(256)) * (SIZE // 256))
    other = tmp_path / "other.bin"
    other.write_bytes(b"\x01" * SIZE)
    with open(weights, "rb") as f, open(other, "rb") as g:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        kept = mmap.mmap(g.fileno(), 0, prot=mmap.PROT_READ)
    try:
        for i in range(0, SIZE, mmap.PAGESIZE):  # touched: resident
            mapped[i], kept[i]
        assert resident_bytes_of(weights) == SIZE and resident_bytes_of(other) == SIZE

        assert drop_mapped_pages(str(weights)) == SIZE
        assert resident_bytes_of(weights) == 0
        assert resident_bytes_of(other) == SIZE  # another file's mapping is left alone
        assert mapped[SIZE - 1] == 255 and mapped[257] == 1  # a touch reads the file again
        assert drop_mapped_pages(str(tmp_path / "not-mapped.bin")) == 0
    finally:
        mapped.close()
        kept.close()
