"""What weight format an import keeps, by source (`kept_weight_format`)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from services.loader.sources import ImportRefused, kept_weight_format
from shared.messages import SourceFormat, WeightFormat


def _checkpoint(tmp_path: Path, params: int) -> Path:
    header = json.dumps({"w": {"dtype": "BF16", "shape": [params], "data_offsets": [0, 0]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return tmp_path


def test_a_checkpoint_keeps_the_format_asked_for(tmp_path: Path) -> None:
    path = _checkpoint(tmp_path, 135_000_000)
    assert kept_weight_format(path, SourceFormat.HF, WeightFormat.F16) is WeightFormat.F16


def test_a_checkpoint_that_names_none_gets_its_sizes_default(tmp_path: Path) -> None:
    assert kept_weight_format(_checkpoint(tmp_path, 135_000_000), SourceFormat.HF, None) is WeightFormat.INT8
    big = _checkpoint(tmp_path, 8_000_000_000)
    assert kept_weight_format(big, SourceFormat.HF, None) is WeightFormat.INT4


def test_an_ir_is_checked_against_what_is_asked_or_kept_as_it_is(tmp_path: Path) -> None:
    assert kept_weight_format(tmp_path, SourceFormat.OPENVINO, None) is None
    assert kept_weight_format(tmp_path, SourceFormat.OPENVINO, WeightFormat.INT4) is WeightFormat.INT4


def test_a_gguf_refuses_a_weight_format(tmp_path: Path) -> None:
    assert kept_weight_format(tmp_path / "m.gguf", SourceFormat.GGUF, None) is None
    with pytest.raises(ImportRefused, match="keeps its own quantization"):
        kept_weight_format(tmp_path / "m.gguf", SourceFormat.GGUF, WeightFormat.INT4)


def test_a_checkpoint_on_a_loader_without_the_exporter_is_refused_naming_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A base install (no `hf` extra) answers a 400 that says what to install, not a failed
    conversion; an IR still registers there."""
    from importlib.util import find_spec

    from services.loader import sources as service

    monkeypatch.setattr(service, "find_spec", lambda name: None if name == "nncf" else find_spec(name))
    with pytest.raises(ImportRefused, match=r"nncf not installed.*tessera\[hf\]"):
        kept_weight_format(_checkpoint(tmp_path, 135_000_000), SourceFormat.HF, None)
    assert kept_weight_format(tmp_path, SourceFormat.OPENVINO, None) is None
