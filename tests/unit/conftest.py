"""Fixtures of the unit tests that hold pure code against the engine library itself."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's IR, converted from its GGUF as the loader does (≈ 12 s here), once
    for every test that needs the real library."""
    from ops.localcluster import default_model_path
    from services.loader.convert import convert

    gguf = default_model_path()  # installed by `make install`, as every engine test needs it
    dest = tmp_path_factory.mktemp("ir") / "smol"
    convert(gguf, dest, "0" * 64, "unit-test")
    return dest
