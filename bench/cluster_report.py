"""`bench/results/cluster.json`'s `setups` (issue 37): for each setup of `bench.cluster_setups`,
its models and nodes, and the real run's and the simulator's capacities side by side, each
with both policies' capacities (req/s), curves and `capacity_ratio_vs_exclusive`; and the plot
of real against simulated, one panel per setup.

A run of `bench.cluster --setup X` replaces `setups[X]` alone; the simulated side is the
simulator's capacity search on the same setup and search (`bench.sim.real_cluster`), its node
fitted to setup (a)'s real run (`real_cluster.fit_node`: the same node kind in every setup).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bench.cluster_setups import Load, Setup
from bench.sim.real_cluster import ClusterSetup, fit_from_run, fit_node, searched


def real_side(result: Mapping[str, Any]) -> dict[str, Any]:
    """A real run's comparison (`bench.cluster`'s result) as a setup's `real`."""
    return {
        "capacity_req_per_s": result["capacity_req_per_s"],
        "curves": result["curves"],
        "capacity_ratio_vs_exclusive": result["capacity_ratio_vs_exclusive"],
        **{k: result[k] for k in ("curves_ci95", "search", "date") if k in result},
    }


def simulated_side(
    load: Load,
    nodes: int,
    steps: int,
    start_rate: float,
    fitted_from: Mapping[str, Any],
    coldstart: Mapping[str, Any],
    log: Callable[[str], None] = lambda _: None,
    own: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The simulator's capacity search on `load`'s setup, as a setup's `sim`: its node fitted
    to what the engines measured in this setup's own real run (`own`) where it kept that,
    else to setup (a)'s real run."""
    base = fit_node(fitted_from, coldstart)
    mine = fit_from_run(own, base) if own is not None else None
    fit = mine or base
    source = (
        "this setup's real run (its requests' decode beside each other on their nodes, its"
        " cold-start records) and setup (a)'s prefill"
        if mine is not None
        else "setup (a)'s real run (cluster.json) and coldstart.json"
    )
    setup = ClusterSetup(load, nodes=nodes, steps=steps, first_rate=start_rate)
    return {
        **searched(setup, fit.hardware, log),
        "search": {
            "start_rate_req_per_s": start_rate,
            "steps": steps,
            "duration_s_per_rate": load.duration_s,
            "ramp_s_per_rate": load.ramp_s,
        },
        "node_fit": {**fit.describe(), "from": source},
    }


def setup_entry(setup: Setup, load: Load, nodes: int, keep_alive_s: float, real: Any, sim: Any) -> dict[str, Any]:
    return {
        "title": setup.title,
        "models": [{"name": m.name, "ttft_slo_s": m.ttft_slo_s, "tpot_slo_s": m.tpot_slo_s} for m in setup.models],
        "nodes": nodes,
        "seed": load.seed,
        "keep_alive_s": keep_alive_s,
        "real": real,
        "sim": sim,
        "ratio_sim_over_real": ratio_over(sim, real),
    }


def ratio_over(sim: Any, real: Any) -> float | None:
    """The simulated capacity ratio over the real one (issue 37's target: within 20 %)."""
    a = (sim or {}).get("capacity_ratio_vs_exclusive")
    b = (real or {}).get("capacity_ratio_vs_exclusive")
    return None if a is None or not b else round(a / b, 4)


def with_setup(report: Mapping[str, Any], name: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    """`report` with `setups[name]` replaced, every other key and setup kept."""
    return {**report, "setups": {**report.get("setups", {}), name: dict(entry)}}


def read_report(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def requests_at_capacity(report: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """A setup's real requests at each policy's capacity: setup (a)'s at the report's top level
    (its format before the setups), another's in its `real` side."""
    if name == "three":
        return report.get("requests_at_capacity") or {}
    return (report.get("setups", {}).get(name, {}).get("real") or {}).get("requests_at_capacity") or {}


def plot_report(report: Mapping[str, Any], path: Path) -> None:
    """The one figure of `cluster.json`, a row per setup: SLO attainment against rate, real
    (solid) and simulated (dashed); and each real request's TTFT against its model's SLO at
    each policy's capacity. None where matplotlib is not installed (the `bench` extra: `make test`
    has no plots)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return

    setups = sorted(report.get("setups", {}).items(), key=lambda kv: kv[0] != "three")
    rows = max(len(setups), 1)
    fig, axes = plt.subplots(rows, 2, figsize=(11.5, 4.2 * rows), squeeze=False)
    colors = {"tessera": "tab:blue", "exclusive": "tab:orange"}
    for (ax, scatter), (name, entry) in zip(axes, setups, strict=False):
        for side, style in (("real", "-"), ("sim", "--")):
            data = entry.get(side)
            if not data or "curves" not in data:
                continue
            for policy, curve in data["curves"].items():
                pts = sorted((float(p[0]), float(p[1])) for p in curve)
                cap = data["capacity_req_per_s"].get(policy)
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    style,
                    marker="o" if side == "real" else "x",
                    color=colors.get(policy),
                    label=f"{side} {policy}: {cap:g} req/s",
                )
        ax.axhline(0.95, color="red", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("mean arrival rate (req/s)")
        ax.set_ylabel("SLO attainment")
        ax.set_ylim(0, 1.05)
        real_ratio = (entry.get("real") or {}).get("capacity_ratio_vs_exclusive")
        sim_ratio = (entry.get("sim") or {}).get("capacity_ratio_vs_exclusive")
        shown = [f"{r:.2f}" if r is not None else "none" for r in (real_ratio, sim_ratio)]
        ax.set_title(f"{entry.get('title', name)}\ncapacity ratio real {shown[0]}, sim {shown[1]}", fontsize=9)
        if ax.get_legend_handles_labels()[0]:  # a setup with neither side yet has no curves
            ax.legend(fontsize=7)
        slo = {m["name"]: m["ttft_slo_s"] for m in entry.get("models", ())}
        for policy, results in requests_at_capacity(report, name).items():
            shares = sorted(
                (r["at_s"], r["ttft_s"] / slo[r["model"]]) for r in results if r.get("ok") and r["model"] in slo
            )
            scatter.scatter(
                [t[0] for t in shares], [t[1] for t in shares], s=8, color=colors.get(policy), label=f"real {policy}"
            )
        scatter.axhline(1.0, color="red", linestyle="--", linewidth=1, label="its model's TTFT SLO")
        scatter.set_yscale("log")
        scatter.set_ylabel("TTFT / its model's TTFT SLO")
        scatter.set_xlabel("request sent (s after the start)")
        scatter.set_title("every request at each policy's capacity", fontsize=9)
        if scatter.get_legend_handles_labels()[0]:
            scatter.legend(fontsize=7)
    fig.suptitle("Capacity on the local cluster: real services against the simulator, a row per setup")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
