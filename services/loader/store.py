"""The model store on disk: where an artifact lives, what it is called, what it costs.

An artifact is keyed by the source's content (a directory's: with the weight format asked
for) and the OpenVINO version that converted it, so a runtime upgrade gets a fresh conversion
instead of a stale one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec

from shared.messages import Artifact

META_FILE = "artifact.msgpack"
IR_FILES = (
    "openvino_model.xml",
    "openvino_model.bin",
    "openvino_tokenizer.xml",
    "openvino_tokenizer.bin",
    "openvino_detokenizer.xml",
    "openvino_detokenizer.bin",
)
# OpenVINO's CPU plugin keeps the KV cache in at most 16-bit elements; sizing with 2 bytes
# errs on the safe side when it chooses u8.
KV_ELEMENT_BYTES = 2


def artifact_id(source_sha256: str, openvino_version: str) -> str:
    runtime = openvino_version.split("-")[0]
    return f"{source_sha256[:16]}-ov{runtime}"


def artifact_dir(store: Path, aid: str) -> Path:
    return store / aid


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def sha256_of_dir(directory: Path, salt: str = "") -> str:
    """Of a model directory: its files' names and contents (in name order), then `salt` (what
    else makes the artifact: the weight format asked for)."""
    h = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    h.update(salt.encode())
    return h.hexdigest()


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int) -> int:
    """Keys and values for every layer: 2 × layers × kv_heads × head_dim × element bytes."""
    return 2 * layers * kv_heads * head_dim * KV_ELEMENT_BYTES


def read_artifact(directory: Path) -> Artifact | None:
    """The artifact stored in `directory`, or None if it is missing or incomplete."""
    meta = directory / META_FILE
    if not meta.is_file() or not all((directory / f).is_file() for f in IR_FILES):
        return None
    return msgspec.msgpack.decode(meta.read_bytes(), type=Artifact)


def write_artifact(directory: Path, artifact: Artifact) -> None:
    (directory / META_FILE).write_bytes(msgspec.msgpack.encode(artifact))
