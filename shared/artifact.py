"""An artifact's layout, as the loader writes it and the engine reads it: where the IR of each
tier and each tier's compiled blob are, the configuration a tier is compiled with, and the
first pass that makes a compiled model run at full speed.

Paths and plain values (OpenVINO is only needed by `first_pass`'s caller), so the engine's
main process, the loader and the converter all agree on them cheaply.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from shared.messages import COMPILED_TIERS, Artifact, Tier

if TYPE_CHECKING:
    import openvino as ov

MODEL_XML = "openvino_model.xml"
START_DIR = "start"
"""Sub-directory of an artifact holding the start tier's IR (`services/loader/start_ir.py`)."""
TORCH_DIR = "torch"
"""Sub-directory of an artifact holding its torch checkpoint (the torch engine's, written at
registration where the node's engine is torch: `services/loader/torch_checkpoint.py`)."""
TORCH_WEIGHTS = "model.safetensors"
TORCH_MANIFEST = "manifest.json"
"""Every tensor of the torch checkpoint with its content digest, dtype and shape, in the order
a forward pass reads them."""
EMBED = "model.embed_tokens.weight"
NORM = "model.norm.weight"
HEAD = "lm_head.weight"


def layer_of(name: str) -> int | None:
    """The decoder layer a checkpoint tensor belongs to (`model.layers.<i>.…`), or None."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def compiled_cache_dir(artifact: Artifact, device: str, tier: Tier = Tier.STEADY) -> Path:
    """Where the compiled blob of one tier for this device lives, inside the artifact (keyed
    by device; the artifact itself is keyed by the OpenVINO version); for TORCH, the torch
    checkpoint (one for every device)."""
    if tier == Tier.TORCH:
        return torch_checkpoint(artifact)
    name = device.lower() if tier == Tier.STEADY else f"{device.lower()}-{tier}"
    return Path(artifact.path) / "compiled" / name


def model_xml(artifact: Artifact, tier: Tier = Tier.STEADY) -> Path:
    base = Path(artifact.path)
    return base / MODEL_XML if tier == Tier.STEADY else base / START_DIR / MODEL_XML


def reads_torch_checkpoint(engine_backend: str) -> bool:
    """The backend's workers read the artifact's torch checkpoint (not its OpenVINO files)."""
    return engine_backend in ("torch", "vllm")


def is_materialized(artifact: Artifact, device: str, backend: str = "openvino") -> bool:
    """What a node's engine reads is in the store: the torch checkpoint where `backend` reads
    one (no compiled OpenVINO tier: such a node's device may be one OpenVINO does not know, a
    CUDA GPU), else every tier compiled for `device`. The artifact's own OpenVINO files (its
    metadata and tokenizers) serve the gateway either way."""
    if reads_torch_checkpoint(backend):
        return has_torch_checkpoint(artifact)
    return all(has_tier(artifact, device, tier) for tier in compiled_tiers(artifact))


def compiled_tiers(artifact: Artifact) -> tuple[Tier, ...]:
    """The tiers OpenVINO compiles for this artifact at registration: STEADY, and START where
    the loader wrote one (`Artifact.start_tier`)."""
    return COMPILED_TIERS if artifact.start_tier else (Tier.STEADY,)


def torch_checkpoint(artifact: Artifact) -> Path:
    return Path(artifact.path) / TORCH_DIR


def has_torch_checkpoint(artifact: Artifact) -> bool:
    """Written whole or not at all (the manifest is written last, and the directory renamed into place)."""
    return (torch_checkpoint(artifact) / TORCH_MANIFEST).is_file()


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "uint8": 1, "int32": 4, "int64": 8}


def torch_tensor_bytes(artifact: Artifact) -> dict[str, int]:
    """The artifact's torch tensors as content hash → bytes (its checkpoint's manifest), for
    matching them against what a tensor arena holds; empty without a checkpoint."""
    return checkpoint_tensor_bytes(torch_checkpoint(artifact))


def stored_torch_checkpoints(store: Path, known: AbstractSet[str]) -> dict[str, dict[str, int]]:
    """The tensors (`checkpoint_tensor_bytes`) of every artifact in the model store that has a
    torch checkpoint and is not in `known`, by artifact id (an artifact's directory name)."""
    out: dict[str, dict[str, int]] = {}
    if not store.is_dir():
        return out
    for entry in store.iterdir():
        if entry.name not in known and (entry / TORCH_DIR / TORCH_MANIFEST).is_file():
            try:
                out[entry.name] = checkpoint_tensor_bytes(entry / TORCH_DIR)
            except (OSError, ValueError, KeyError):  # unreadable: known, with nothing to match
                out[entry.name] = {}
    return out


def safetensors_header(weights: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """A safetensors file's header size (with its 8-byte length prefix: where the data begins)
    and its tensors, each with its `data_offsets` in the data."""
    with weights.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def checkpoint_tensor_bytes(checkpoint: Path) -> dict[str, int]:
    path = checkpoint / TORCH_MANIFEST
    if not path.is_file():
        return {}
    out: dict[str, int] = {}
    for t in json.loads(path.read_text())["tensors"]:
        out[t["digest"]] = int(np.prod(t["shape"], dtype=np.int64)) * _ITEMSIZE[t["dtype"]]
    return out


def has_tier(artifact: Artifact, device: str, tier: Tier) -> bool:
    cache = compiled_cache_dir(artifact, device, tier)
    return model_xml(artifact, tier).is_file() and cache.is_dir() and any(cache.glob("*.blob"))


def compile_config(
    artifact: Artifact, device: str, threads: int, cache_dir: str | None = None, tier: Tier = Tier.STEADY
) -> dict[str, object]:
    """`cache_dir`: where the compiled blob is (the loader's host cache); the store's copy
    when None."""
    config: dict[str, object] = {"CACHE_DIR": cache_dir or str(compiled_cache_dir(artifact, device, tier))}
    if device == "CPU":
        config["INFERENCE_NUM_THREADS"] = threads
    return config


def first_pass(compiled: ov.CompiledModel) -> None:
    """One token through a throwaway infer request: the CPU plugin repacks the weights on a
    model's first forward pass, so after this the next pass runs at full speed."""
    compiled.create_infer_request().infer(
        {
            "input_ids": np.ones((1, 1), dtype=np.int64),
            "attention_mask": np.ones((1, 1), dtype=np.int64),
            "position_ids": np.zeros((1, 1), dtype=np.int64),
            "beam_idx": np.zeros(1, dtype=np.int32),
        }
    )
