"""Fixtures of the unit tests that hold pure code against the engine library itself."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smol() -> Path:
    """The default model's IR, converted from its GGUF as the loader does (≈ 12 s here) and
    materialized, once for every test that needs the real library (the OpenVINO batches' own
    tests and their conformance suite share it: `tests/conformance/ovbatches.py`)."""
    from tests.conformance.ovbatches import smol_artifact

    return Path(smol_artifact().path)


Refuses = Callable[[str, str], "str | None"]
"""refuses(kind, spec): what the engine library says of a structured-output spec of `kind`
("grammar", "regex" or "json_schema"): its error, or None when it compiles."""


@pytest.fixture(scope="session")
def library_refuses(smol: Path) -> Refuses:
    """The engine library's own verdict on a spec. The stateful `LLMPipeline` raises for a spec
    it cannot compile and serves on, where the continuous-batching one breaks for good; both
    compile specs with the same xgrammar."""
    import openvino_genai as ov_genai

    pipe = ov_genai.LLMPipeline(str(smol), "CPU", INFERENCE_NUM_THREADS=1)

    def refuses(kind: str, spec: str) -> str | None:
        config = ov_genai.GenerationConfig(max_new_tokens=1)
        config.structured_output_config = ov_genai.StructuredOutputConfig(**{kind: spec})
        try:
            pipe.generate("x", config)
        except RuntimeError as e:
            return str(e)
        return None

    return refuses
