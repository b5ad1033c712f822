from pathlib import Path

import pytest

from services.loader.service import LoaderService
from services.loader.settings import LoaderSettings
from services.loader.sources import ImportRefused, model_source, readable
from services.loader.store import artifact_id, kv_bytes_per_token, read_artifact


def test_artifacts_are_keyed_by_content_and_runtime_version() -> None:
    a = artifact_id("ab" * 32, "2026.4.1-22982-e213a147257-releases/2026/4")
    b = artifact_id("ab" * 32, "2026.5.0-1-abc")
    assert a != b
    assert "/" not in a and a.startswith("abababab")


def test_kv_bytes_per_token_of_smollm2_135m() -> None:
    # 30 layers, 3 KV heads of 64 dims (576 / 9 heads), keys and values, 2-byte elements.
    assert kv_bytes_per_token(layers=30, kv_heads=3, head_dim=64) == 23040


def test_an_incomplete_artifact_directory_is_not_an_artifact(tmp_path: Path) -> None:
    (tmp_path / "openvino_model.xml").write_text("<net/>")
    assert read_artifact(tmp_path) is None


@pytest.fixture
def loader(tmp_path: Path) -> LoaderService:
    allowed = tmp_path / "models"
    allowed.mkdir()
    settings = LoaderSettings(
        model_store=tmp_path / "store", allowed_model_dirs=[allowed], host_cache_dir=tmp_path / "cache"
    )
    return LoaderService(settings, bus=None)  # type: ignore[arg-type]


def _check(loader: LoaderService, source: str) -> object:
    """The loader's check of a model's source, under its allowed directories."""
    return readable(source, lambda s: model_source(s, loader.settings.allowed_model_dirs))


def test_import_refuses_files_outside_the_allowed_directories(loader: LoaderService, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.gguf"
    outside.write_bytes(b"GGUF....")
    with pytest.raises(ImportRefused, match="outside"):
        _check(loader, str(outside))


def test_import_refuses_relative_paths_and_non_gguf(loader: LoaderService, tmp_path: Path) -> None:
    with pytest.raises(ImportRefused, match="absolute"):
        _check(loader, "models/x.gguf")
    fake = tmp_path / "models" / "fake.gguf"
    fake.write_bytes(b"PK\x03\x04")
    with pytest.raises(ImportRefused, match="bad magic"):
        _check(loader, str(fake))
    with pytest.raises(ImportRefused, match="not a readable"):
        _check(loader, str(tmp_path / "models" / "missing.gguf"))


def test_what_a_node_reads_decides_whether_an_artifact_is_materialized_for_it(tmp_path: Path) -> None:
    # A torch or vLLM node reads the torch checkpoint alone (its device, a CUDA GPU, may be
    # none OpenVINO compiles for); an OpenVINO node reads every tier compiled for its device.
    from shared.artifact import (
        MODEL_XML,
        START_DIR,
        TORCH_DIR,
        TORCH_MANIFEST,
        compiled_cache_dir,
        is_materialized,
    )
    from shared.messages import Artifact, Tier

    art = Artifact("a", str(tmp_path), "s", 2048, 1, 1)
    assert not is_materialized(art, "CPU") and not is_materialized(art, "CUDA", "torch")
    (tmp_path / TORCH_DIR).mkdir()
    (tmp_path / TORCH_DIR / TORCH_MANIFEST).write_text("{}")
    assert is_materialized(art, "CUDA", "torch") and is_materialized(art, "CPU", "vllm")
    assert not is_materialized(art, "CPU", "openvino")
    (tmp_path / START_DIR).mkdir()
    for tier, xml in ((Tier.STEADY, tmp_path / MODEL_XML), (Tier.START, tmp_path / START_DIR / MODEL_XML)):
        xml.write_text("<net/>")
        cache = compiled_cache_dir(art, "CPU", tier)
        cache.mkdir(parents=True)
        (cache / "x.blob").write_bytes(b"0")
    assert is_materialized(art, "CPU", "openvino") and not is_materialized(art, "GPU", "openvino")
