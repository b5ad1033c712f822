"""LoRA adapters on a registered base (issue 34): their records, the messages that import
them, and where the store keeps them. Defined once here, beside `shared.messages` (which they
build on).

An adapter is registered against a base model's name; the loader checks it against the base
(`policy.adapters`) and keeps a checked copy inside the base's artifact, at
`<artifact>/adapters/<adapter_id>/`:
- `adapter_model.safetensors`: the PEFT file as registered (OpenVINO GenAI's `Adapter` reads
  it as it is; vLLM's `LoRARequest` and PEFT read the directory);
- `adapter_config.json`: PEFT's config, as registered;
- `manifest.json`: the `AdapterArtifact` (msgspec JSON), written last: a directory with it is
  whole (the directory is written beside and renamed into place).
A start reads those few megabytes; nothing is converted at request time.

For the engine that applies them (tests/integration/test_adapter_genai.py checks this much):
OpenVINO GenAI's `Adapter(<path>/adapter_model.safetensors)` reads the kept file as it is, on
an IR exported from the base's checkpoint; a pipeline built with `adapters=AdapterConfig(...)`
is LoRA-able, and a generation's `GenerationConfig.adapters = AdapterConfig(adapter,
AdapterArtifact.scale)` gives PEFT's greedy tokens (alpha 1 would apply the raw B·A). Its
continuous-batching pipeline applies one adapter set to every request of a step: `step()`
ignores a request's own `GenerationConfig.adapters`, and `generate` applies the first
request's set to all (refused while requests run); a pipeline built without adapters, or an
adapter on linears the build's adapters do not update, applies nothing, silently. An OpenVINO
engine batches by adapter (`services/engine/core.py`, `policy/adapter_turns.py`).
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec

from shared.messages import TTFT_SLO_PER_TOKEN_S, AdapterRef, Artifact, Message, ModelRecord

ADAPTERS_DIR = "adapters"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_MANIFEST = "manifest.json"


class AdapterArtifact(Message, frozen=True):
    """A checked adapter in the store: what an engine applies on its base's artifact."""

    adapter_id: str
    """sha256 (16 hex) of the adapter directory's files (names and contents)."""
    path: str
    """Directory holding `ADAPTER_WEIGHTS`, `ADAPTER_CONFIG` and `ADAPTER_MANIFEST`."""
    base_artifact_id: str
    """The artifact it was checked against and lies in (`Artifact.artifact_id`)."""
    rank: int
    alpha: float
    """adapter_config.json's `lora_alpha`."""
    scale: float
    """The update's factor: `alpha / rank` (`alpha / √rank` with rsLoRA). OpenVINO GenAI's
    `Adapter` reads raw A and B from the safetensors: an engine passes this as the adapter's
    alpha in its `AdapterConfig` to get PEFT's output."""
    targets: tuple[str, ...]
    """The linears it updates (`q_proj`, `v_proj`, ...)."""
    layers: int
    """How many decoder layers it updates."""
    dtype: str
    """The safetensors element type of its matrices (F32, F16, BF16)."""
    nbytes: int
    """Bytes of `ADAPTER_WEIGHTS`: what a start reads and a node holds for it."""
    sha256: str
    """Of `ADAPTER_WEIGHTS` (hex): checked again on the copy before the manifest is written."""


class AdapterRecord(Message, frozen=True):
    """A registered adapter name. Served by that name (it shares the models' namespace),
    on `base`'s weights."""

    name: str
    base: str
    """The base model's registered name."""
    source: str
    """The adapter directory it was registered from."""
    adapter: AdapterArtifact
    keep_alive_s: float
    """Idle seconds after which the adapter is dropped from its base's instances (its base
    keeps its own keep-alive)."""
    ttft_slo_s: float
    tpot_slo_s: float
    created_at: float
    ttft_slo_per_token_s: float = TTFT_SLO_PER_TOKEN_S
    min_instances: int = 0
    """Keep warm (issue 35): its base's instances kept running whatever the traffic, at least
    this many (`policy.keep_warm.with_adapter_pins`), and the adapter never dropped from them
    for idleness once loaded. 0: dropped after `keep_alive_s`."""
    priority: int = 0
    """Its base is kept at least at this priority (evictions and preemptions)."""


class ImportAdapter(Message, frozen=True):
    """Gateway → any loader: check the adapter at `source` against `base` and keep a checked
    copy in the store (or find it there). Answered `AdapterImported` or `Rejected`
    (`IMPORT_FAILED`, saying what does not fit)."""

    base: ModelRecord
    source: str


class AdapterImported(Message, frozen=True):
    adapter: AdapterArtifact
    converted: bool
    """False when the store held this adapter for this base already."""
    seconds: float


class StageAdapter(Message, frozen=True):
    """Engine → its node's loader: the host-cache copy of the adapter kept at `path`
    (`AdapterArtifact.path`, in the store). Answered `shared.cache_messages.Staged`: on a hit,
    the copy's directory, checked against the manifest's SHA-256 (`hit` true); on a miss, `path`
    itself (`hit` false), the loader filling its cache after the answer; or `Rejected`."""

    path: str


def adapters_root(artifact: Artifact) -> Path:
    return Path(artifact.path) / ADAPTERS_DIR


def adapter_dir(artifact: Artifact, adapter_id: str) -> Path:
    return adapters_root(artifact) / adapter_id


def read_manifest(directory: Path) -> AdapterArtifact | None:
    """The adapter kept in `directory` (`adapter_dir`), or None where it is missing or
    incomplete: what a start reads to find the file it applies and the scale it applies it at."""
    path = directory / ADAPTER_MANIFEST
    if not path.is_file() or not (directory / ADAPTER_WEIGHTS).is_file():
        return None
    try:
        return msgspec.json.decode(path.read_bytes(), type=AdapterArtifact)
    except msgspec.DecodeError:
        return None


def adapter_ref(record: AdapterRecord) -> AdapterRef:
    """What a request for `record` carries to its base's engine; a pinned adapter's keep-alive
    is endless (its engine never drops it for idleness; a later request after an unpin brings
    its keep-alive back)."""
    a = record.adapter
    return AdapterRef(
        name=record.name,
        adapter_id=a.adapter_id,
        path=a.path,
        scale=a.scale,
        nbytes=a.nbytes,
        keep_alive_s=math.inf if record.min_instances > 0 else record.keep_alive_s,
    )
