"""What a LoRA-able core is built for (`tiered_batch.kept_adapters`): as few of the base's kept
adapters as cover every linear and layer any of them updates, so that a base with a hundred
adapters on the same linears reads one of them at its build, and the cover still says which
adapters the core applies."""

from __future__ import annotations

from pathlib import Path

import msgspec

from services.engine.tiered_batch import kept_adapters
from shared.adapters import ADAPTER_MANIFEST, ADAPTER_WEIGHTS, AdapterArtifact, adapter_dir
from shared.messages import Artifact


def _keep(artifact: Artifact, adapter_id: str, targets: tuple[str, ...], layers: int, rank: int = 8) -> AdapterArtifact:
    d = adapter_dir(artifact, adapter_id)
    d.mkdir(parents=True)
    (d / ADAPTER_WEIGHTS).write_bytes(b"")
    kept = AdapterArtifact(
        adapter_id=adapter_id,
        path=str(d),
        base_artifact_id=artifact.artifact_id,
        rank=rank,
        alpha=16.0,
        scale=16.0 / rank,
        targets=targets,
        layers=layers,
        dtype="F32",
        nbytes=0,
        sha256="",
    )
    (d / ADAPTER_MANIFEST).write_bytes(msgspec.json.encode(kept))
    return kept


def test_adapters_on_the_same_linears_build_with_one_and_wider_ones_are_added(tmp_path: Path) -> None:
    artifact = Artifact(
        artifact_id="base",
        source_sha256="",
        path=str(tmp_path),
        context_length=2048,
        kv_bytes_per_token=1,
        weight_bytes=1,
    )
    assert kept_adapters(artifact).files == ()  # no adapters: a core that is not LoRA-able

    same = [_keep(artifact, f"qv{i:02}", ("q_proj", "v_proj"), 30, rank=8 * (1 + i % 2)) for i in range(10)]
    cover = kept_adapters(artifact)
    assert len(cover.files) == 1 and cover.targets == {"q_proj", "v_proj"} and cover.layers == 30
    assert all(cover.covers(a) for a in same)

    wider = _keep(artifact, "zz-all", ("q_proj", "k_proj", "v_proj", "o_proj"), 30)
    cover = kept_adapters(artifact)
    # The wider adapter covers the others' linears: the build reads it alone.
    assert cover.files == (str(Path(wider.path) / ADAPTER_WEIGHTS),)
    assert all(cover.covers(a) for a in [*same, wider])

    mlp = _keep(artifact, "mlp", ("gate_proj", "up_proj"), 30)
    cover = kept_adapters(artifact)
    assert len(cover.files) == 2 and cover.covers(mlp) and cover.targets >= {"gate_proj", "k_proj"}
    outside = AdapterArtifact(**{**msgspec.structs.asdict(mlp), "targets": ("down_proj",)})
    assert not cover.covers(outside)  # a linear no kept adapter updates: the core must be rebuilt
