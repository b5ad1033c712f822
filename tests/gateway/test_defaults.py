"""Per-model generation defaults: the platform's, overridden by the model's metadata,
overridden by the registration; the length cap never past the context."""

from __future__ import annotations

from services.gateway.admin import generation_defaults
from services.gateway.protocol import RegisterModel
from shared.messages import Artifact, GenerationDefaults


def _artifact(context: int = 8192, **sampling: float) -> Artifact:
    return Artifact(
        artifact_id="a",
        path="/x",
        source_sha256="s",
        context_length=context,
        kv_bytes_per_token=1,
        weight_bytes=1,
        sampling=sampling,
    )


def _register(**kw: object) -> RegisterModel:
    return RegisterModel(name="m", source="/m.gguf", **kw)  # type: ignore[arg-type]


def test_a_model_without_metadata_gets_the_platform_defaults() -> None:
    assert generation_defaults(_artifact(), _register()) == GenerationDefaults()


def test_the_models_metadata_overrides_the_platform() -> None:
    d = generation_defaults(_artifact(temperature=0.2, top_p=0.9), _register())
    assert (d.temperature, d.top_p) == (0.2, 0.9)
    assert d.repetition_penalty == GenerationDefaults().repetition_penalty


def test_the_registration_overrides_the_metadata() -> None:
    d = generation_defaults(
        _artifact(temperature=0.2), _register(temperature=0.0, max_tokens=64, repetition_penalty=1.0)
    )
    assert (d.temperature, d.max_tokens, d.repetition_penalty) == (0.0, 64, 1.0)


def test_the_length_cap_never_exceeds_the_context() -> None:
    assert generation_defaults(_artifact(context=256), _register()).max_tokens == 256
    assert generation_defaults(_artifact(context=256), _register(max_tokens=10_000)).max_tokens == 256
