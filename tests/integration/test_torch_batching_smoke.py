"""bench/torch_batching.py's smallest run on the host: both sides and the one-request path
measured on the real model, the ratio of each crowd written, so that the benchmark (and its
GPU run, bfloat16) does not fail on a mistake found here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the benchmark runs torch (the `test` extra installs it)")

ROOT = Path(__file__).resolve().parents[2]


def test_a_small_run_measures_both_sides_for_every_crowd(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.torch_batching", "--crowds", "1,2", "--tokens", "3", "--out", str(tmp_path)],
        cwd=ROOT,
        # torch on one intra-op thread (tests/helpers/torch_threads.py says why): the ratios it
        # writes are the benchmark's business on its own machine, this run checks its plumbing.
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "torch_batching.json").read_text())
    for side in ("tessera", "library", "ratio_tessera_over_library", "one_at_a_time"):
        assert set(result[side]) == {"1", "2"}, side
        assert all(v > 0 for v in result[side].values()), side
    assert result["tokens_per_request"] == 3 and result["dtype"] in ("float32", "bfloat16")
    assert result["speedup_over_one_at_a_time"] > 0
