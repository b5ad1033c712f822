"""A registered model for policy unit tests: `m` on artifact a1 (placement, the perf book)."""

from __future__ import annotations

from shared.messages import Artifact, ModelRecord

RECORD = ModelRecord(
    name="m",
    source="/x.gguf",
    ttft_slo_s=1.0,
    tpot_slo_s=0.1,
    keep_alive_s=60,
    created_at=0,
    artifact=Artifact(
        artifact_id="a1", path="/a", source_sha256="s", context_length=100, kv_bytes_per_token=2, weight_bytes=5
    ),
)
"""Model `m`, registered on artifact a1 (for the perf book's profiles)."""
