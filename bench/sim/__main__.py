"""Discrete-event simulator of a shared CPU/GPU cluster serving many models (issue 6).

    .venv/bin/python -m bench.sim [--quick] [--out bench/results]

The command line (`bench.sim`'s docstring says what is simulated): the capacity searches of
Tessera, GPU-only and the exclusive baseline's settings, every policy at one common rate, the
scale run (a 1,000-node hour by default); writes `sim.json` and `sim.png` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from bench.capacity import SLO_TARGET
from bench.sim.hardware import GPU_ONLY, TESSERA, TPOT_SLO, Policy
from bench.sim.scale import EXCLUSIVE_GRID, ScaleJob, Setup, capacity, run_at, scale_run


def _describe(p: Policy) -> dict[str, Any]:
    return {
        "keep_alive_s": p.keep_alive_s,
        "limit_tpot_fraction": p.limit_tpot_fraction,
        "kind_order": list(p.exclusive_kinds),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true", help="a smaller search, for a smoke run")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--big-nodes", type=int, default=1000)
    ap.add_argument("--big-duration-s", type=float, default=3600.0)
    ap.add_argument("--big-rate-per-node", type=float, default=0.1)
    ap.add_argument(
        "--cells", type=int, default=2, help="run the scale run's cluster as this many cells, one process each"
    )
    ap.add_argument("--single-process", action="store_true", help="also time the scale run as one cell in one process")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(f"[sim] {msg}", file=sys.stderr, flush=True)

    setup = Setup(seed=args.seed, duration_s=300.0 if args.quick else 1200.0)
    steps = 3 if args.quick else 6
    result: dict[str, Any] = {
        "setup": asdict(setup),
        "slo": {"ttft_s": "max(2, input_len / 512)", "tpot_s": TPOT_SLO, "target": SLO_TARGET},
    }
    caps: dict[str, float] = {}
    curves: dict[str, list[tuple[float, float]]] = {}
    t0 = time.perf_counter()
    for pol in (TESSERA, GPU_ONLY):
        caps[pol.name], curves[pol.name] = capacity(setup, pol, steps=steps, log=log)
    grid = []
    best: tuple[float, Policy, list[tuple[float, float]]] | None = None
    for pol in EXCLUSIVE_GRID[:2] if args.quick else EXCLUSIVE_GRID:
        cap, pts = capacity(setup, pol, steps=steps, log=log)
        grid.append({**_describe(pol), "capacity_req_per_s": round(cap, 4)})
        if best is None or cap > best[0]:
            best = (cap, pol, pts)
    assert best is not None
    caps["exclusive"], excl, curves["exclusive"] = best
    search_s = time.perf_counter() - t0

    # Every policy at one common rate: the exclusive baseline's capacity.
    common = caps["exclusive"] or caps["tessera"] or 0.5
    per_policy = {}
    for pol in (TESSERA, excl, GPU_ONLY):
        st = run_at(setup, pol, common)
        per_policy[pol.name] = {"capacity_req_per_s": round(caps[pol.name], 4), "at_common_rate": st.summary()}
    per_policy["exclusive"]["settings"] = _describe(excl)
    per_policy["exclusive"]["settings_tried"] = grid
    per_policy["tessera"]["settings"] = {
        "keep_alive_s": TESSERA.keep_alive_s,
        "reject_over_slo": TESSERA.reject_over_slo,
    }

    def ratio(a: float, b: float) -> float | None:
        return round(a / b, 3) if b > 0 else None

    result["baselines"] = {
        "exclusive": "Knative/ServerlessLLM-style (LLM-Mesh's sllm+cpu): one model per "
        "instance, one instance per node, scale-out when every instance is at its concurrency "
        "limit (tuned per model size and node kind from the perf model), fixed keep-alive, "
        "weights loaded from the host cache at the same bandwidth as Tessera; the best of "
        f"{len(grid)} settings (settings_tried)",
        "gpu_only": "Tessera on the 4 GPU nodes alone",
    }
    result["policies"] = per_policy
    result["common_rate_req_per_s"] = round(common, 4)
    result["capacity_ratio_vs_exclusive"] = ratio(caps["tessera"], caps["exclusive"])
    result["capacity_ratio_cpu_gpu_vs_gpu_only"] = ratio(caps["tessera"], caps["gpu_only"])
    result["capacity_search_wall_s"] = round(search_s, 1)
    result["curves"] = {k: [[round(r, 4), round(a, 4)] for r, a in v] for k, v in curves.items()}

    # Scale: 1,000 nodes, one hour, models in proportion to the small setup (4 per node),
    # 0.1 req/s per node (every one replayed with the full policy stack).
    nodes = args.big_nodes
    n_cpu, n_gpu = nodes // 2, nodes - nodes // 2
    big_rate = args.big_rate_per_node * nodes
    big_models = setup.n_models * nodes // (setup.n_cpu + setup.n_gpu)
    cells = max(1, args.cells)
    log(
        f"scale run: {nodes} nodes, {big_models} models, {big_rate:g} req/s, "
        f"{args.big_duration_s:g} s, as {cells} cell(s) in parallel"
    )
    job = ScaleJob(args.seed, big_models, args.big_duration_s, big_rate, n_cpu, n_gpu, cells)
    big, wall = scale_run(job)
    result["sim_1000_nodes_1h_wall_s"] = round(wall, 2)
    result["scale_run"] = {
        "nodes": nodes,
        "cpu_nodes": n_cpu,
        "gpu_nodes": n_gpu,
        "models": big_models,
        "duration_s": args.big_duration_s,
        "rate_req_per_s": round(big_rate, 2),
        "rate_per_node_vs_small_setup_capacity": round(
            args.big_rate_per_node / max(caps["tessera"] / (setup.n_cpu + setup.n_gpu), 1e-9), 3
        ),
        "cells": cells,
        **big.summary(),
    }
    log(f"scale run took {wall:.1f}s")
    if args.single_process and cells > 1:
        one, one_wall = scale_run(replace(job, cells=1))
        result["scale_run"]["single_process"] = {"wall_s": round(one_wall, 2), **one.summary()}
        log(f"in one process it took {one_wall:.1f}s")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "sim.png")
    print(json.dumps({k: v for k, v in result.items() if k not in ("curves", "policies")}, indent=2))
    return 0


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, pts in result["curves"].items():
        xs, ys = zip(*pts, strict=True) if pts else ((), ())
        ax1.plot(xs, ys, marker="o", label=f"{name} (cap {result['policies'][name]['capacity_req_per_s']:.2f})")
    ax1.axhline(SLO_TARGET, color="grey", linestyle="--", linewidth=0.8)
    ax1.set_xscale("log")
    ax1.set_xlabel("mean request rate (req/s)")
    ax1.set_ylabel("SLO attainment")
    ax1.set_title("SLO attainment vs load (4 CPU + 4 GPU nodes)")
    ax1.legend(fontsize=8)
    names = list(result["policies"])
    common = [result["policies"][n]["at_common_rate"] for n in names]
    x = range(len(names))
    ax2.bar([i - 0.2 for i in x], [c["memory_held_gb_mean"] for c in common], 0.4, label="memory held (GB, mean)")
    ax2.bar([i + 0.2 for i in x], [c["cold_starts"] for c in common], 0.4, label="cold starts")
    ax2.set_xticks(list(x), names)
    ax2.set_title(f"at {result['common_rate_req_per_s']:.2f} req/s")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
