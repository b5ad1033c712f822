from pathlib import Path

import pytest

from services.loader.blocks import bad_blocks, copy_blocks, manifest_of


@pytest.fixture
def source(tmp_path: Path) -> Path:
    p = tmp_path / "model.blob"
    p.write_bytes(bytes(range(256)) * 100)  # 25,600 bytes: 7 blocks of 4 KiB
    return p


def test_a_faithful_copy_has_no_bad_blocks(source: Path, tmp_path: Path) -> None:
    m = manifest_of(source, block_bytes=4096)
    assert len(m.crc32) == 7
    copy = tmp_path / "copy.blob"
    copy_blocks(source, copy, m)
    assert copy.read_bytes() == source.read_bytes()
    assert bad_blocks(copy, m) == []


def test_a_flipped_byte_names_its_block_and_only_that_block_is_reread(source: Path, tmp_path: Path) -> None:
    m = manifest_of(source, block_bytes=4096)
    copy = tmp_path / "copy.blob"
    copy_blocks(source, copy, m)
    data = bytearray(copy.read_bytes())
    data[4096 * 3 + 17] ^= 0xFF
    copy.write_bytes(bytes(data))
    assert bad_blocks(copy, m) == [3]
    result = copy_blocks(source, copy, m, blocks=[3])
    assert result.copied_bytes == 4096
    assert bad_blocks(copy, m) == []
    assert copy.read_bytes() == source.read_bytes()


def test_a_missing_or_truncated_copy_is_all_bad(source: Path, tmp_path: Path) -> None:
    m = manifest_of(source, block_bytes=4096)
    assert bad_blocks(tmp_path / "absent", m) == list(range(7))
    short = tmp_path / "short"
    short.write_bytes(source.read_bytes()[:5000])
    assert bad_blocks(short, m) == list(range(7))


def test_a_corrupt_source_is_refused_rather_than_cached(source: Path, tmp_path: Path) -> None:
    m = manifest_of(source, block_bytes=4096)
    data = bytearray(source.read_bytes())
    data[0] ^= 1
    source.write_bytes(bytes(data))
    with pytest.raises(OSError, match="corrupt"):
        copy_blocks(source, tmp_path / "copy", m)
