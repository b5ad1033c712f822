"""What a registration's source is and what weight format a checkpoint gets
(`services/loader/formats.py`)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from services.loader.formats import (
    INT4_ABOVE_PARAMS,
    NotImportable,
    checkpoint_params,
    default_weight_format,
    params_of_headers,
    source_format,
    weight_format_of,
)
from shared.messages import SourceFormat, WeightFormat

IR = ["openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml", "openvino_detokenizer.xml", "config.json"]
HF = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def test_an_ir_directory_as_optimum_cli_writes_it_is_openvino() -> None:
    assert source_format(IR) is SourceFormat.OPENVINO


def test_an_ir_beside_safetensors_is_still_an_ir() -> None:
    assert source_format([*IR, "model.safetensors"]) is SourceFormat.OPENVINO


@pytest.mark.parametrize(
    "missing", ["openvino_tokenizer.xml", "openvino_detokenizer.xml", "openvino_model.bin", "config.json"]
)
def test_an_ir_missing_a_part_is_refused_naming_it(missing: str) -> None:
    with pytest.raises(NotImportable, match=missing):
        source_format([f for f in IR if f != missing])


def test_a_checkpoint_is_hf_with_any_tokenizer_form() -> None:
    assert source_format(HF) is SourceFormat.HF
    assert source_format(["config.json", "model-00001-of-00002.safetensors", "tokenizer.model"]) is SourceFormat.HF
    assert source_format(["config.json", "model.safetensors", "vocab.json", "merges.txt"]) is SourceFormat.HF


def test_a_checkpoint_without_a_tokenizer_is_refused_saying_so() -> None:
    with pytest.raises(NotImportable, match="without its tokenizer"):
        source_format(["config.json", "model.safetensors", "tokenizer_config.json"])


@pytest.mark.parametrize("names", [[], ["notes.txt"], ["config.json"], ["model.safetensors", "tokenizer.json"]])
def test_a_directory_that_is_neither_is_refused(names: list[str]) -> None:
    with pytest.raises(NotImportable, match="neither"):
        source_format(names)


def test_small_checkpoints_default_to_int8_and_large_ones_to_int4() -> None:
    assert default_weight_format(135_000_000) is WeightFormat.INT8
    assert default_weight_format(1_700_000_000) is WeightFormat.INT8
    assert default_weight_format(INT4_ABOVE_PARAMS) is WeightFormat.INT8
    assert default_weight_format(INT4_ABOVE_PARAMS + 1) is WeightFormat.INT4
    assert default_weight_format(8_000_000_000) is WeightFormat.INT4


def test_params_count_every_tensor_and_skip_the_metadata() -> None:
    headers: list[dict[str, object]] = [
        {"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}},
        {
            "b": {"dtype": "BF16", "shape": [5], "data_offsets": [0, 10]},
            "c": {"dtype": "F16", "shape": [], "data_offsets": [10, 12]},
        },
    ]
    assert params_of_headers(headers) == 12 + 5 + 1


def test_params_are_read_from_the_shards_headers(tmp_path: Path) -> None:
    for i, shape in enumerate(([2, 3], [7])):
        header = json.dumps({"t": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
        (tmp_path / f"model-{i}.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    assert checkpoint_params(tmp_path) == 6 + 7


def test_an_irs_weight_format_is_the_type_holding_most_bytes() -> None:
    # int4 layers with int8 embeddings (NNCF's int4 default) read as int4; scales in f16 do not count.
    assert weight_format_of({"u4": 53_000_000, "u8": 28_000_000, "f16": 4_000_000, "i64": 100}) is WeightFormat.INT4
    assert weight_format_of({"u8": 135_000_000, "f16": 1_000_000}) is WeightFormat.INT8
    assert weight_format_of({"f16": 270_000_000, "f32": 100_000}) is WeightFormat.F16
    assert weight_format_of({"f32": 540_000_000, "i32": 10}) is WeightFormat.F32
    with pytest.raises(ValueError):
        weight_format_of({"i64": 8})
