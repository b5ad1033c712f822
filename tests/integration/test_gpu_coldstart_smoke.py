"""bench/gpu_coldstart.py's smoke run on the host: every part that runs without a GPU, for real
(a fresh naive process, the pre-warmed worker, the arena's miss and hit, decode against the
plain load), so that the one run on a GPU machine does not fail on a mistake found here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the benchmark runs torch (the `test` extra installs it)")
pytest.importorskip("transformers", reason="the benchmark runs transformers (the `test` extra installs it)")

ROOT = Path(__file__).resolve().parents[2]
KEYS = {
    "device",
    "naive_cold_ttft_s",
    "tessera_gpu_cold_hit_ttft_s",
    "tessera_gpu_cold_miss_ttft_s",
    "phases",
    "h2d_gbps",
    "load_8b_s",
    "hit_8b_ttft_s",
    "graph_capture_s",
    "graph_restore_s",
    "decode_tok_s",
    "decode_tok_s_plain",
    "targets",
}


def test_the_smoke_run_measures_every_host_part_and_reuses_the_resident_weights(tmp_path: Path) -> None:
    out = tmp_path / "gpu_coldstart.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_coldstart", "--smoke", "--out", str(out), "--budget-s", "240"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r == json.loads(proc.stdout)
    assert KEYS <= r.keys()
    assert r["errors"] == {"model_8b": "skipped: smoke run", "graphs": "skipped: smoke run"}
    assert r["device"] == "cpu (host fallback)"
    assert r["naive_cold_ttft_s"] > 0 and r["tessera_gpu_cold_miss_ttft_s"] > 0
    miss, hit = r["details"]["start_miss"], r["details"]["start_hit"]
    assert miss["copied_bytes"] > 0 and miss["reused_bytes"] == 0
    assert hit["copied_bytes"] == 0 and hit["reused_bytes"] > 0
    assert hit["token"] == miss["token"]  # the same weights, resident: the same first token
    assert r["details"]["decode"]["same_tokens"]
    assert set(r["phases"]["tessera_miss"]) >= {"worker_bind_s", "weight_copy_s", "graph_restore_s", "first_token_s"}
    assert r["targets"]["hit_8b_ttft_le_s"]["met"] is None  # not measured here, and said so
