"""What `bench/serving.py` makes of its runs: the issue's ratios and targets, and the plot of tok/s
against concurrency."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bench.serving_runs import LLAMA_PARALLEL, MAX_TOKENS, SYSTEMS


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def ratios(res: dict[str, Any]) -> dict[str, float | None]:
    """The issue's comparisons (None where a side was not run)."""

    def get(system: str, c: int, key: str) -> float | None:
        value = (res.get(system) or {}).get(str(c), {}).get(key)
        return None if value is None else float(value)

    return {
        "tessera_over_pipeline_tok_s_c32": ratio(get("tessera", 32, "tok_s"), get("pipeline", 32, "tok_s")),
        "tessera_over_pipeline_tok_s_c64": ratio(get("tessera", 64, "tok_s"), get("pipeline", 64, "tok_s")),
        "tessera_over_llama_server_tok_s_c32": ratio(get("tessera", 32, "tok_s"), get("llama_server", 32, "tok_s")),
        "tessera_over_pipeline_tpot_p50_c1": ratio(get("tessera", 1, "tpot_p50_s"), get("pipeline", 1, "tpot_p50_s")),
    }


def targets(res: dict[str, Any], r: dict[str, float | None]) -> dict[str, Any]:
    """The targets (issue 32's: c=1 TPOT within 5 % of the pipeline's, c=32 and c=64 throughput
    at least 0.95x it), pass/fail (None where the figures are missing)."""

    def at_least(v: float | None, bound: float) -> dict[str, Any]:
        return {"value": v, "target": f">= {bound}", "pass": None if v is None else v >= bound}

    mixed = (res.get("mixed") or {}).get("tessera") or {}
    refused = None
    if res.get("tessera"):
        # Every run at c <= 64: the levels and the mixed run's (31 or 32 requests at once).
        runs = [*res["tessera"].values(), *(mixed[k] for k in ("short", "short_alone") if k in mixed)]
        statuses = [s for run in runs for s, n in run["errors"].items() for _ in range(n)]
        statuses += [mixed["long"]["status"]] if mixed.get("long") else []
        refused = sum(1 for s in statuses if s == "429" or s.startswith("5"))
    tpot = r["tessera_over_pipeline_tpot_p50_c1"]
    return {
        "tessera_over_pipeline_c32": at_least(r["tessera_over_pipeline_tok_s_c32"], 0.95),
        "tessera_over_pipeline_c64": at_least(r["tessera_over_pipeline_tok_s_c64"], 0.95),
        "tessera_over_llama_server_c32": at_least(r["tessera_over_llama_server_tok_s_c32"], 3.0),
        "tessera_429_5xx": {"value": refused, "target": "== 0", "pass": None if refused is None else refused == 0},
        "mixed_short_ttft_p99_ratio": {
            "value": mixed.get("ratio"),
            "target": "<= 2",
            "pass": None if mixed.get("ratio") is None else mixed["ratio"] <= 2,
        },
        "tpot_c1_within_5pct": {"value": tpot, "target": "<= 1.05", "pass": None if tpot is None else tpot <= 1.05},
    }


def plot(res: dict[str, Any], levels: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "tessera": "Tessera (gateway)",
        "pipeline": "ContinuousBatchingPipeline (one process)",
        "llama_server": f"llama-server --parallel {LLAMA_PARALLEL}",
    }
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for system in SYSTEMS:
        by_c = res.get(system) or {}
        pts = [(c, by_c[str(c)]["tok_s"]) for c in levels if str(c) in by_c and by_c[str(c)]["tok_s"]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=labels[system])
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent clients (back to back)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Serving SmolLM2-135M on {os.cpu_count()} cores: {MAX_TOKENS}-token greedy streams")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
