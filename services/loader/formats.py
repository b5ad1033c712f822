"""What a registration's source is, and what weight format a Hugging Face checkpoint gets:
plain functions of a directory's listing and a checkpoint's facts (the loader's I/O shell
reads them; `convert.py` acts on the answer)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

from shared.messages import SourceFormat, WeightFormat

IR_MODEL = "openvino_model.xml"
IR_TOKENIZERS = ("openvino_tokenizer.xml", "openvino_detokenizer.xml")
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""Any one of these makes a checkpoint's tokenizer (a fast tokenizer, a SentencePiece model,
a BPE vocabulary with its merges)."""

INT4_ABOVE_PARAMS = 3_000_000_000
"""A checkpoint of more parameters than this is kept in int4 by default, a smaller one in
int8: at 1-2 B parameters int8 keeps the model's quality (optimum-intel's own default above
1 B) at half the f16 size; above a few billion, int4 is what fits a CPU node's memory (an 8 B
model: 4.6 GB against 8.5 GB in int8)."""

REFUSED_EXIT = 3
"""The converter's exit status for a source it refuses (`NotImportable`; the reason is its
stderr's last line)."""


class NotImportable(ValueError):
    """A source the loader refuses, with the reason the client is told."""


def source_format(names: Iterable[str]) -> SourceFormat:
    """What a directory holding the files `names` is: an OpenVINO IR (with both tokenizer
    models), a Hugging Face checkpoint (config.json, safetensors weights, a tokenizer), or
    neither (`NotImportable`, saying what is missing)."""
    files = set(names)
    if IR_MODEL in files:
        missing = [f for f in (IR_MODEL.replace(".xml", ".bin"), *IR_TOKENIZERS, "config.json") if f not in files]
        if missing:
            raise NotImportable(
                f"an OpenVINO IR directory without {', '.join(missing)} (export it with `optimum-cli export "
                "openvino`, which converts the tokenizer too)"
            )
        return SourceFormat.OPENVINO
    weights = any(f.endswith(".safetensors") for f in files)
    if "config.json" in files and weights:
        if not any(f in files for f in HF_TOKENIZER_FILES):
            raise NotImportable(
                f"a Hugging Face checkpoint without its tokenizer (none of {', '.join(HF_TOKENIZER_FILES)})"
            )
        return SourceFormat.HF
    raise NotImportable(
        "neither a Hugging Face checkpoint (config.json and *.safetensors) nor an OpenVINO IR directory "
        f"({IR_MODEL} and its tokenizer models)"
    )


def default_weight_format(params: int) -> WeightFormat:
    """A checkpoint's weight format where its registration names none (`INT4_ABOVE_PARAMS`)."""
    return WeightFormat.INT4 if params > INT4_ABOVE_PARAMS else WeightFormat.INT8


def params_of_headers(headers: Iterable[Mapping[str, object]]) -> int:
    """Parameters in safetensors files, from their headers (name → dtype, shape, offsets)."""
    total = 0
    for header in headers:
        for name, entry in header.items():
            if name == "__metadata__" or not isinstance(entry, Mapping):
                continue
            count = 1
            for dim in entry["shape"]:  # type: ignore[attr-defined]
                count *= int(dim)
            total += count
    return total


def safetensors_header(path: Path) -> dict[str, object]:
    """A safetensors file's header (its first 8 bytes give its length): no tensor is read."""
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header: dict[str, object] = json.loads(f.read(size))
    return header


def checkpoint_params(checkpoint: Path) -> int:
    return params_of_headers(safetensors_header(p) for p in sorted(checkpoint.glob("*.safetensors")))


def weight_format_of(bytes_by_type: Mapping[str, int]) -> WeightFormat:
    """The weight format of an IR whose weight constants take these bytes per element type
    (OpenVINO's names: u4, i8, f16, ...): the type holding most of them."""
    kinds = {
        "u4": WeightFormat.INT4,
        "i4": WeightFormat.INT4,
        "u8": WeightFormat.INT8,
        "i8": WeightFormat.INT8,
        "f16": WeightFormat.F16,
        "f32": WeightFormat.F32,
    }
    by_format: dict[WeightFormat, int] = {}
    for kind, n in bytes_by_type.items():
        if kind in kinds:
            by_format[kinds[kind]] = by_format.get(kinds[kind], 0) + n
    if not by_format:
        raise ValueError("the IR has no weight constants")
    return max(by_format, key=lambda f: by_format[f])
