"""The simulator on the real cluster bench's setup (issue 37, setup (a)), beside the real run.

    .venv/bin/python -m bench.sim_cluster [--out bench/results]

Runs `bench.cluster`'s capacity search (its seed, load, ramp, keep-alive, start rate and
bisection steps) for Tessera and the real bench's exclusive baseline on the simulator
(`bench.sim.real_cluster`), with the node's hardware fitted to the real run's measurements
(`bench/results/cluster.json`, `bench/results/coldstart.json`: `real_cluster.fit_node`), and
writes `<out>/sim_cluster.json`: per policy its capacity (req/s) and curve, the simulated
`capacity_ratio_vs_exclusive` beside the real one, and whether they agree within 20 % (the
issue's target). Also the same search with every request judged by eq. 1 (LLM-Mesh's rule,
what the scheduler validates against) instead of `bench.cluster`'s mean TPOT: the gap between
the two is part of the answer. Prints the JSON. Takes seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from bench.sim.real_cluster import (
    BENCH_LOAD,
    EXCLUSIVE_CLUSTER,
    PROMPT_TOKENS,
    TESSERA_CLUSTER,
    ClusterSetup,
    cluster_models,
    fit_node,
    real_result,
    searched,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
AGREEMENT = 0.20
"""Issue 37: the simulator's capacity ratio within 20 % of the real one."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=REPO_ROOT / "bench" / "results", help="where the real runs are")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(f"[sim_cluster] {msg}", file=sys.stderr, flush=True)

    cluster = json.loads((args.results / "cluster.json").read_text())
    coldstart = json.loads((args.results / "coldstart.json").read_text())
    fit = fit_node(cluster, coldstart)
    search = cluster["search"]
    setup = ClusterSetup(
        replace(
            BENCH_LOAD,
            seed=cluster["seed"],
            burst=cluster["chat_burst"],
            spread_s=cluster["chat_burst_spread_s"],
            duration_s=search["duration_s_per_rate"],
            ramp_s=search["ramp_s_per_rate"],
        ),
        nodes=cluster["nodes"],
        steps=search["steps"],
    )
    assert abs(setup.start_rate - search["start_rate_req_per_s"]) < 1e-9, "the real run started elsewhere"
    for pol in (TESSERA_CLUSTER, EXCLUSIVE_CLUSTER):
        assert pol.keep_alive_s == cluster["keep_alive_s"], "the real run kept models alive for another time"

    sim = searched(setup, fit.hardware, log)
    log("the same search, every request judged by eq. 1")
    eq1 = searched(replace(setup, mean_tpot=False), fit.hardware, lambda m: log(f"eq. 1: {m}"))
    real = real_result(cluster)
    ratio_sim, ratio_real = sim["capacity_ratio_vs_exclusive"], real["capacity_ratio_vs_exclusive"]
    off = None if ratio_sim is None or not ratio_real else ratio_sim / ratio_real - 1.0
    result = {
        "setup": {
            "name": "a: bench.cluster's 3 models on 3 CPU nodes",
            "models": [
                {"name": m.name, "ttft_slo_s": m.ttft_slo_s, "tpot_slo_s": m.tpot_slo_s} for m in cluster_models()
            ],
            "nodes": setup.nodes,
            "node": cluster["core_share"],
            "load": asdict(setup.load),
            "prompt_tokens": PROMPT_TOKENS,
            "tokens_per_request": cluster["tokens_per_request"],
            "keep_alive_s": TESSERA_CLUSTER.keep_alive_s,
            "search": {"start_rate_req_per_s": setup.start_rate, "steps": setup.steps},
            "slo": "bench.cluster's: first token within the model's TTFT SLO, mean TPOT after it within its TPOT SLO",
        },
        "node_fit": fit.describe(),
        "sim": sim,
        "real": real,
        "sim_judged_by_eq1": eq1,
        "ratio_sim_over_real": None if off is None else round(1.0 + off, 4),
        "target": f"the simulator's capacity ratio within {AGREEMENT:.0%} of the real one",
        "target_met": off is not None and abs(off) <= AGREEMENT,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sim_cluster.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
