"""The peers of `bench/coldstart.py` (llama.cpp, OpenVINO GenAI on the GGUF), each run in a fresh
process by `bench/peers.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.coldstart_client import log
from bench.common import median
from ops.localcluster import REPO_ROOT

PEER_TIMEOUT_S = 600.0


# --- peers ---------------------------------------------------------------------------------------


def run_peer(which: str, gguf: Path) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    p = subprocess.run(
        [sys.executable, "-m", "bench.peers", which, str(gguf)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=PEER_TIMEOUT_S,
        check=False,
    )
    if p.returncode != 0:
        raise RuntimeError(f"peer {which} exited with {p.returncode}:\n{p.stderr[-2000:]}")
    lines = [ln for ln in p.stdout.splitlines() if ln.strip().startswith("{")]
    if not lines:
        raise RuntimeError(f"peer {which} printed no JSON:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


def bench_peer(which: str, runs: int, gguf: Path) -> list[dict[str, Any]]:
    out = []
    for i in range(runs):
        r = run_peer(which, gguf)
        log(
            f"{which} run {i + 1}/{runs}: cold ttft {r['cold_ttft_s']:.3f}s "
            + ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items())
            + f"; decode {r['decode_tok_s']:.1f} tok/s"
        )
        out.append(r)
    return out


def median_phases(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {k: median([r["phases"][k] for r in runs]) for k in runs[0]["phases"]}
