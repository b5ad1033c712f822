"""Where an artifact's files are: the IR of each tier and each tier's compiled blob.

Paths only (no runtime import), so the engine's main process, the loader and the converter
can all agree on them cheaply.
"""

from __future__ import annotations

from pathlib import Path

from shared.messages import Artifact, Tier

MODEL_XML = "openvino_model.xml"
START_DIR = "start"
"""Sub-directory of an artifact holding the start tier's IR (`services/loader/start_ir.py`)."""


def compiled_cache_dir(artifact: Artifact, device: str, tier: Tier = Tier.STEADY) -> Path:
    """Where the compiled blob of one tier for this device lives, inside the artifact (keyed
    by device; the artifact itself is keyed by the OpenVINO version)."""
    name = device.lower() if tier == Tier.STEADY else f"{device.lower()}-{tier}"
    return Path(artifact.path) / "compiled" / name


def model_xml(artifact: Artifact, tier: Tier = Tier.STEADY) -> Path:
    base = Path(artifact.path)
    return base / MODEL_XML if tier == Tier.STEADY else base / START_DIR / MODEL_XML


def has_tier(artifact: Artifact, device: str, tier: Tier) -> bool:
    cache = compiled_cache_dir(artifact, device, tier)
    return model_xml(artifact, tier).is_file() and cache.is_dir() and any(cache.glob("*.blob"))
