"""What a fresh interpreter loads: the torch worker's process imports no OpenVINO and the
engine's main process no runtime (the import floors themselves: tests/unit/test_floors.py)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def loaded_by(modules: str, runtimes: tuple[str, ...]) -> list[str]:
    """Which of `runtimes` a fresh interpreter has loaded after importing `modules`."""
    import subprocess
    import sys

    probe = f"import sys; import {modules}; print(sorted({{m.split('.')[0] for m in sys.modules if m.startswith({runtimes!r})}}))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    return list(ast.literal_eval(out.stdout))


def test_the_torch_worker_runs_without_openvino() -> None:
    # A GPU node's image may hold torch and no OpenVINO: the torch worker's process (what the
    # engine spawns for it) must not import it, not even through the engine's shared modules.
    assert loaded_by("services.engine.torch_engine.process", ("openvino",)) == []


def test_the_engine_service_imports_no_runtime() -> None:
    # The engine's main process spawns workers of either runtime and runs neither itself: on
    # a torch node it must start without OpenVINO, and on a CPU node without torch (its
    # workers import theirs). tests/e2e/test_torch_backend.py checks the running processes.
    assert loaded_by("services.engine.__main__", ("openvino", "torch", "transformers")) == []
