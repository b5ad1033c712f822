"""The loader's side of LoRA adapters (issue 34): read an adapter directory and its base's
shape, check the one against the other (`policy.adapters`), and keep a checked copy in the
store (`shared.adapters`), written beside and renamed into place: a refused or failed import
leaves nothing behind.

Blocking file work, run in a thread by the service (`LoaderService.on_import_adapter`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from policy.adapters import (
    AdapterRefused,
    BaseShape,
    TensorSpec,
    base_shape_from_config,
    base_shape_from_gguf,
    check_adapter,
)
from services.loader.store import sha256_of_dir
from shared.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_MANIFEST,
    ADAPTER_WEIGHTS,
    AdapterArtifact,
    AdapterImported,
    adapter_dir,
    read_manifest,
)
from shared.messages import ModelRecord, SourceFormat

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""safetensors' own limit on a header: a larger length prefix is not a safetensors file."""


def base_shape(base: ModelRecord) -> BaseShape:
    """The base's decoder sizes: from its artifact's config.json (a Hugging Face checkpoint's
    or an IR's), else from the metadata of the GGUF it was registered from."""
    config = Path(base.artifact.path) / "config.json"
    if config.is_file():
        return base_shape_from_config(json.loads(config.read_text()))
    if base.artifact.source_format is SourceFormat.GGUF and Path(base.source).is_file():
        import gguf

        reader = gguf.GGUFReader(base.source)
        scalars = {k: f.contents() for k, f in reader.fields.items() if len(f.types) == 1}
        return base_shape_from_gguf(scalars)
    raise AdapterRefused(f"the shape of base `{base.name}` cannot be read (no config.json in its artifact)")


def _header(data: bytes) -> tuple[int, dict[str, TensorSpec]]:
    """A safetensors file's header length (with its 8-byte prefix) and its tensors."""
    if len(data) < 8:
        raise AdapterRefused(f"{ADAPTER_WEIGHTS} is not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(MAX_HEADER_BYTES, len(data) - 8):
        raise AdapterRefused(f"{ADAPTER_WEIGHTS} is not a safetensors file (bad header length)")
    try:
        raw = json.loads(data[8 : 8 + n])
        raw.pop("__metadata__", None)
        tensors = {
            k: TensorSpec(
                str(v["dtype"]),
                tuple(int(d) for d in v["shape"]),
                (int(v["data_offsets"][0]), int(v["data_offsets"][1])),
            )
            for k, v in raw.items()
        }
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise AdapterRefused(f"{ADAPTER_WEIGHTS} is not a safetensors file (unreadable header)") from None
    return 8 + n, tensors


def _finite(data: bytes, start: int, tensors: dict[str, TensorSpec]) -> None:
    """Every element a finite number: a NaN or an infinity would poison every token."""
    for key, spec in tensors.items():
        raw = data[start + spec.offsets[0] : start + spec.offsets[1]]
        if spec.dtype == "BF16":  # bfloat16 is float32's upper half
            values = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            values = np.frombuffer(raw, dtype="<f4" if spec.dtype == "F32" else "<f2")
        if not np.isfinite(values).all():
            raise AdapterRefused(f"tensor {key!r} holds NaN or infinite values")


def read_config(source: Path) -> dict[str, Any]:
    path = source / ADAPTER_CONFIG
    if not path.is_file():
        raise AdapterRefused(f"the directory has no {ADAPTER_CONFIG}: not a PEFT adapter")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        raise AdapterRefused(f"{ADAPTER_CONFIG} is not JSON") from None
    if not isinstance(config, dict):
        raise AdapterRefused(f"{ADAPTER_CONFIG} is not a JSON object")
    return config


def read_weights(source: Path) -> bytes:
    path = source / ADAPTER_WEIGHTS
    if not path.is_file():
        pickled = (source / "adapter_model.bin").is_file()
        raise AdapterRefused(
            f"the directory has no {ADAPTER_WEIGHTS}"
            + (" (only a pickled adapter_model.bin: save it with safe_serialization=True)" if pickled else "")
        )
    return path.read_bytes()


def import_adapter(base: ModelRecord, source: Path, max_rank: int) -> AdapterImported:
    """Check the adapter at `source` against `base` and keep it in the base's artifact (or
    find it there); `AdapterRefused` says what does not fit."""
    t0 = time.perf_counter()
    config = read_config(source)
    weights = read_weights(source)
    start, tensors = _header(weights)
    fit = check_adapter(config, tensors, len(weights) - start, base_shape(base), max_rank)
    _finite(weights, start, tensors)
    adapter_id = sha256_of_dir(source)[:16]
    dest = adapter_dir(base.artifact, adapter_id)
    existing = read_manifest(dest)
    if existing is not None:
        return AdapterImported(adapter=existing, converted=False, seconds=time.perf_counter() - t0)
    artifact = AdapterArtifact(
        adapter_id=adapter_id,
        path=str(dest),
        base_artifact_id=base.artifact.artifact_id,
        rank=fit.rank,
        alpha=fit.alpha,
        scale=fit.scale,
        targets=fit.targets,
        layers=len(fit.layers),
        dtype=fit.dtype,
        nbytes=len(weights),
        sha256=hashlib.sha256(weights).hexdigest(),
    )
    try:
        _place(weights, json.dumps(config, indent=2), artifact, dest)
    except OSError:
        # Another loader of a shared store placed the same adapter first: theirs is as good.
        if (placed := read_manifest(dest)) is None:
            raise
        return AdapterImported(adapter=placed, converted=False, seconds=time.perf_counter() - t0)
    return AdapterImported(adapter=artifact, converted=True, seconds=time.perf_counter() - t0)


def _place(weights: bytes, config: str, artifact: AdapterArtifact, dest: Path) -> None:
    """The bytes checked (not the source again: it may have changed since) written into a
    temporary sibling, read back and hashed, the manifest last, then renamed to `dest`."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        (tmp / ADAPTER_WEIGHTS).write_bytes(weights)
        (tmp / ADAPTER_CONFIG).write_text(config)
        if hashlib.sha256((tmp / ADAPTER_WEIGHTS).read_bytes()).hexdigest() != artifact.sha256:
            raise OSError(f"the copy of {ADAPTER_WEIGHTS} in the store does not read back as written")
        (tmp / ADAPTER_MANIFEST).write_bytes(msgspec.json.encode(artifact))
        if dest.exists():  # a copy without its manifest: left by a crash, never used
            shutil.rmtree(dest)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
