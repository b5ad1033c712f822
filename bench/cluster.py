"""Capacity on the real local cluster: Tessera's placement against the exclusive baseline.

    python -m bench.cluster [--setup three|many] [--sim-only] [--duration S] [--ramp S] [--nodes 3]
                            [--steps 3] [--seed N] [--out bench/results]

`--setup` picks the work (`bench/cluster_setups.py`, issue 37): `three` (setup (a), the
default, below) or `many` (setup (b): 12 models, each a distinct artifact with one of (a)'s
three SLO pairs, popularity Zipf-skewed and each model ON and OFF in periods of tens of
seconds as in the Azure Functions trace (`bench.trace.generate`), seed 2, a 90 s counted
window after a 30 s ramp, the search from 1.5 req/s). `--duration`, `--ramp` and `--seed`
default to the setup's. Every model of the setup is registered once in the shared store
(`prepare_store`) before either policy runs.

Setup (a): for each policy (`TESSERA_PLACEMENT=tessera`, then `exclusive`), a fresh `LocalCluster` with
`--nodes` engine nodes, each pinned to its own cores with as many inference threads (one model
store shared by both runs, so each GGUF converts once), serves three models with different
SLOs and the same keep-alive (`--keep-alive`, 30 s), each a different artifact (the default GGUF, and two
copies with bytes appended: stand-ins for fine-tunes). The load's shape, at scale x:

| model | TTFT SLO | TPOT SLO | load |
|---|---|---|---|
| `chat` | 1.5 s | 0.25 s | bursts: every 6/x s (±25 %), 6 requests over 0.5 s |
| `assist` | 3.0 s | 0.25 s | Poisson, 0.25·x req/s |
| `batch` | 8.0 s | 0.5 s | Poisson, 0.15·x req/s |

Every request streams 32 tokens (`ignore_eos`). A request meets its SLO when it completes, its
first content arrives within the TTFT SLO of its send (retries after a 429/503 included), and
its mean time per output token is within the TPOT SLO.

Each policy's capacity is found as the simulator finds it (`bench.capacity.capacity_search`,
LLM-Mesh §8.1): the highest mean arrival rate (req/s, all models) at which SLO attainment
stays >= 0.95, doubling or halving from `--start-rate` (the load above at x = 1: 1.4 req/s)
and then `--steps` bisections, each rate a `--duration`-second load, counted, after a
`--ramp` of the same load that is not, on the same cluster (its instances as the previous
rate left them, as a running service's would be). Two rounds of
warm-up requests, one per model each, precede the first rate (not counted): the models start,
then serve a request the engines measure, so placement has a performance model; then, once
every instance serves from its continuous-batching core (each tiers up when its node is idle:
capacity is a steady state, `bench/coldstart.py` measures starts), one crowd of `--burst`
requests per model. The arrival
times come from `--seed`, the same for both policies at a given rate.

Exclusive (what a Knative or ServerlessLLM deployment does): a model's instance has a node to
itself and its requests queue on it; no sharing, no scale-out. Tessera: shadow validation on
measured performance, scale-out to other nodes (sharing them) when the queue would miss the
TTFT SLO. `--nodes` defaults to 3, the issue's cluster; on a machine with fewer cores each
node gets an equal CPU quota (`core_shares` in ops/localcluster.py), which the JSON records.

With more models than nodes (setup (b)) the exclusive baseline (`policy.scheduling.
_place_exclusive`) holds at most one model per node, three at a time: a request for a model
with no instance starts it only on a node running nothing (no instance, no start under way),
else it is refused (503, Retry-After 1 s) and the client retries for up to `RETRY_BUDGET_S`;
a node frees only when its model has been idle past the keep-alive. So exclusive scales tail
models to zero and starts them again, and a model waits while three others hold the nodes.

Prints one JSON object with `capacity_ratio_vs_exclusive` (Tessera's capacity over the
exclusive baseline's), and writes `<out>/cluster.json`: its `setups[SETUP]` (the others
kept) with the setup's `models`, `nodes`, and `real` and `sim` side by side, each with both
policies' `capacity_req_per_s`, `curves` and `capacity_ratio_vs_exclusive` (`sim`: the
simulator's search on the same setup and search, `bench.sim.real_cluster`, its node fitted to
the setup's own real run where it kept each request's node, else to setup (a)'s; seconds), and
`ratio_sim_over_real`. A real run of setup (a) also writes
the file's top-level keys (the format before the setups, which the fit reads); of another
setup, its runs and requests are kept in `setups[SETUP].real`. `<out>/cluster.png` is the one
figure, a row per setup: real against simulated, and each real request's TTFT against its
model's SLO at each policy's capacity. `--sim-only` runs no cluster: it fills
`setups[SETUP].sim` alone (`real` kept, or null).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/cluster.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.capacity import SLO_TARGET, attainment_interval, capacity_search
from bench.cluster_report import plot_report, read_report, real_side, setup_entry, simulated_side, with_setup
from bench.cluster_setups import SETUPS, THREE_MODELS, TOKENS, Load, Model, Setup, arrivals, base_rate
from bench.common import machine_info, make_log, percentile
from ops.localcluster import LocalCluster, core_shares, default_model_path

log = make_log("cluster")
REPO_ROOT = Path(__file__).resolve().parent.parent
RETRY_BUDGET_S = 30.0
MODELS = THREE_MODELS
"""Setup (a)'s models (`bench.cluster_setups`), by their old name."""
__all__ = ["MODELS", "TOKENS", "Load", "Model", "arrivals", "base_rate"]


async def one_request(http: httpx.AsyncClient, model: Model, prompt: str) -> dict[str, Any]:
    """Stream one request; retry 429/503 after Retry-After while the TTFT budget lasts."""
    sent = time.perf_counter()
    body = {
        "model": model.name,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    retries = 0
    while True:
        first = last = None
        rid = ""  # the gateway's request id: the services' logs name the request by it
        tokens = 0
        status = 0
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                status = r.status_code
                if status in (429, 503) and time.perf_counter() - sent < RETRY_BUDGET_S:
                    retries += 1
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                    continue
                if status != 200:
                    return {"model": model.name, "ok": False, "error": f"http {status}", "retries": retries}
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return {
                            "model": model.name,
                            "ok": False,
                            "error": event["error"].get("code"),
                            "retries": retries,
                        }
                    rid = rid or str(event.get("id", "")).removeprefix("chatcmpl-")
                    if event.get("usage"):
                        tokens = int(event["usage"]["completion_tokens"])
                    if event.get("choices") and event["choices"][0].get("delta", {}).get("content"):
                        now = time.perf_counter()
                        first = first or now
                        last = now
        except httpx.HTTPError as e:
            return {"model": model.name, "ok": False, "error": type(e).__name__, "retries": retries}
        if first is None or last is None:
            return {"model": model.name, "ok": False, "error": "no content", "retries": retries}
        ttft = first - sent
        tpot = (last - first) / (tokens - 1) if tokens > 1 else 0.0
        return {
            "model": model.name,
            "ok": True,
            "request_id": rid,
            "ttft_s": ttft,
            "tpot_s": tpot,
            "tokens": tokens,
            "retries": retries,
            "slo_met": ttft <= model.ttft_slo_s and tpot <= model.tpot_slo_s,
        }


async def drive(base_url: str, plan: list[tuple[float, str]], models: tuple[Model, ...]) -> list[dict[str, Any]]:
    by_name = {m.name: m for m in models}
    # Every request is a client of its own, as an open-loop load's are: a capped pool would
    # hold requests back in the client once that many are open, and count the wait as TTFT
    # (with 64, every model's first token came ~5 s late at 12.6 req/s, the lightly loaded
    # node's too: the client's queue, not the cluster's).
    limits = httpx.Limits(max_connections=len(plan) + 8, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:
        start = time.perf_counter()

        async def at(t: float, name: str, i: int) -> dict[str, Any]:
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            res = await one_request(http, by_name[name], f"Request {i}: tell me about the sea.")
            return {"at_s": t, **res}

        return list(await asyncio.gather(*(at(t, n, i) for i, (t, n) in enumerate(plan))))


def summarize(results: list[dict[str, Any]], models: tuple[Model, ...]) -> dict[str, Any]:
    def stats(rs: list[dict[str, Any]]) -> dict[str, Any]:
        ok = [r for r in rs if r["ok"]]
        ttft = [r["ttft_s"] for r in ok]
        tpot = [r["tpot_s"] for r in ok]
        return {
            "requests": len(rs),
            "completed": len(ok),
            "slo_met": sum(1 for r in ok if r["slo_met"]),
            "slo_attainment": sum(1 for r in ok if r["slo_met"]) / len(rs) if rs else None,
            "ttft_p50_s": percentile(ttft, 50) if ttft else None,
            "ttft_p99_s": percentile(ttft, 99) if ttft else None,
            "tpot_p50_s": percentile(tpot, 50) if tpot else None,
            "tpot_p99_s": percentile(tpot, 99) if tpot else None,
            "errors": sorted({r["error"] for r in rs if not r["ok"]}),
            "retries": sum(r["retries"] for r in rs),
        }

    return {"all": stats(results), **{m.name: stats([r for r in results if r["model"] == m.name]) for m in models}}


def prepare_store(store: Path, sources: dict[str, Path], keep_alive_s: float, models: tuple[Model, ...]) -> None:
    """Convert every model into the shared store before any measured run, and let the writes
    reach the disk: otherwise the first policy run pays for it (its registrations convert,
    and the page cache writes back the new artifacts during its load; measured: the first run
    of the bench scored lower than the second whatever the policy)."""
    with tempfile.TemporaryDirectory(prefix="tessera-cluster-prepare-") as home:
        cluster = LocalCluster(home=Path(home), store=store, nodes=1)
        try:
            cluster.start(timeout_s=180)
            register_models(cluster.base_url, sources, keep_alive_s, models)
        finally:
            cluster.stop()
    os.sync()


def register_models(base_url: str, sources: dict[str, Path], keep_alive_s: float, models: tuple[Model, ...]) -> None:
    """Register every model of the setup on its GGUF, with its SLOs."""
    for m in models:
        httpx.post(
            f"{base_url}/admin/models",
            timeout=900,
            json={
                "name": m.name,
                "source": str(sources[m.name]),
                "keep_alive_s": keep_alive_s,
                "ttft_slo_s": m.ttft_slo_s,
                "tpot_slo_s": m.tpot_slo_s,
            },
        ).raise_for_status()


VARIANTS = {
    "tessera": ("tessera", {}),
    "exclusive": ("exclusive", {}),
    # Ablation: Tessera's placement with instances on a node left to the OS scheduler instead
    # of taking turns by headroom (LLM-Mesh §5.1, services/engine/step_gate.py).
    "tessera-no-interleave": ("tessera", {"TESSERA_INTERLEAVE": "false"}),
}


SCHEDULER_COUNTERS = (
    "tessera_scheduler_scale_outs_total",
    "tessera_scheduler_scale_to_zero_total",
    "tessera_scheduler_preemptions_total",
)


def scheduler_counters(cluster: LocalCluster) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{cluster.procs['scheduler'].http_port}/metrics", timeout=10).text
    return {
        name: sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith(name) and not line.startswith(name + "_created")
        )
        for name in SCHEDULER_COUNTERS
    }


PLACED = re.compile(r"placed ([0-9a-f]+) .*?node_id='([^']+)'")


def placed_on(scheduler_log: Path) -> dict[str, str]:
    """Each request's node, by its id, from the scheduler's placement lines (DEBUG): the last
    placement of a request placed again (after a preemption) wins."""
    out: dict[str, str] = {}
    if scheduler_log.exists():
        for line in scheduler_log.read_text(errors="replace").splitlines():
            if (m := PLACED.search(line)) is not None:
                out[m.group(1)] = m.group(2)
    return out


def run_policy(
    variant: str,
    nodes: int,
    store: Path,
    sources: dict[str, Path],
    load: Load,
    start_rate: float,
    steps: int,
    keep_alive_s: float,
    keep_logs: Path | None = None,
    rates: list[float] | None = None,
) -> dict[str, Any]:
    """One policy's capacity search on a cluster of its own: every rate tried, in the order
    tried, with its summary and requests."""
    policy, extra = VARIANTS[variant]
    models = load.setup.models
    per_node, _ = core_shares(nodes)
    points: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix=f"tessera-cluster-{policy}-") as home:
        cluster = LocalCluster(
            home=Path(home),
            store=store,
            nodes=nodes,
            node_env=per_node,
            env={
                "TESSERA_PLACEMENT": policy,
                "TESSERA_HEARTBEAT_INTERVAL_S": "0.25",
                "TESSERA_MAX_INFLIGHT": "256",
                "TESSERA_WORKER_REFILL_DELAY_S": "1",
                **extra,
                # The scheduler logs each placement at DEBUG: each request's node (`placed_on`),
                # what the simulator's node is fitted from. It logs little else there.
                "TESSERA_LOG_LEVEL": "DEBUG",
            },
        )
        try:
            t = time.perf_counter()
            cluster.start(timeout_s=180)
            log(f"{variant}: {nodes} nodes up in {time.perf_counter() - t:.1f}s")
            register_models(cluster.base_url, sources, keep_alive_s, models)
            # Warm-up: each model starts (its request measures nothing: it shared the start),
            # then serves one request the engines measure, so placement has a performance model.
            warm = [
                w
                for _ in range(2)
                for w in asyncio.run(drive(cluster.base_url, [(0.0, m.name) for m in models], models))
            ]
            log(f"{variant}: warm-up {[(w['model'], w['ok']) for w in warm]}")
            # Capacity is a steady state: every instance on its continuous-batching core (the
            # tier-up each start does once its node is idle; bench/coldstart.py measures starts).
            tiers = wait_steady(cluster.base_url)
            # And one crowd per model on those cores, as the load brings them (a new core's
            # first crowd prefills everything: the next ones find their prefix cached).
            crowd = [(0.0, m.name) for m in models for _ in range(load.burst)]
            warm += asyncio.run(drive(cluster.base_url, crowd, models))
            # What the crowd scaled out serves from its core too before the first rate.
            tiers = wait_steady(cluster.base_url)
            log(f"{variant}: instances {tiers}; warm-up crowd {sum(w['ok'] for w in warm)}/{len(warm)} ok")

            def attainment(rate: float) -> float:
                plan = load.plan(rate)
                before = scheduler_counters(cluster)
                t = time.perf_counter()
                results = load.counted(asyncio.run(drive(cluster.base_url, plan, models)))
                wall = time.perf_counter() - t
                nodes_of = placed_on(Path(home) / "logs" / "scheduler.log")
                # A request that failed has no id (its node is none).
                results = [{**r, "node": nodes_of.get(r.get("request_id", ""))} for r in results]
                after = scheduler_counters(cluster)
                status = httpx.get(f"{cluster.base_url}/admin/instances", timeout=10).json()
                summary = summarize(results, models)
                att = float(summary["all"]["slo_attainment"] or 0.0)
                points.append(
                    {
                        "rate_req_per_s": rate,
                        "requests": len(results),
                        "slo_attainment": att,
                        "slo_attainment_ci95": attainment_interval(summary["all"]["slo_met"], len(results)),
                        "summary": summary,
                        "wall_s": wall,
                        **{k.removeprefix("tessera_scheduler_"): after[k] - before[k] for k in SCHEDULER_COUNTERS},
                        "instances_at_end": {
                            n["node_id"]: sorted(i["model"] for i in n["instances"]) for n in status["nodes"]
                        },
                        "results": results,
                    }
                )
                log(
                    f"{variant}: {rate:.3f} req/s ({len(results)} requests counted) → SLO attainment {att:.3f} "
                    + ", ".join(f"{m.name} {summary[m.name]['slo_attainment'] or 0:.2f}" for m in models)
                )
                return att

            if rates:  # a look at these rates, no search
                cap = max((r for r in rates if attainment(r) >= SLO_TARGET), default=0.0)
            else:
                cap, _ = capacity_search(attainment, start_rate, steps=steps)
            records = httpx.get(f"{cluster.base_url}/admin/coldstarts?limit=1000", timeout=10).json()
            starts = len(records)
        finally:
            cluster.stop()
            if keep_logs is not None:
                shutil.copytree(Path(home) / "logs", keep_logs / variant, dirs_exist_ok=True)
    log(f"{variant}: capacity {cap:.3f} req/s")
    return {
        "policy": variant,
        "capacity_req_per_s": cap,
        "cold_starts": starts,
        # Each start as the engines recorded it (its model, source, tier, phases, total): what
        # a start costs on a node at this quota, beside others serving.
        "cold_start_records": records,
        "tiers_before": tiers,
        "points": points,
    }


def wait_steady(base_url: str, timeout_s: float = 180.0) -> dict[str, str]:
    """Wait until every instance serves from its STEADY tier; their tiers then (or at the
    deadline: the run goes on and the JSON says so)."""
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = httpx.get(f"{base_url}/admin/instances", timeout=10).json()["nodes"]
        tiers = {f"{i['model']}@{n['node_id']}": i.get("tier", "") for n in nodes for i in n["instances"]}
        if all(t == "steady" for t in tiers.values()) or time.monotonic() > deadline:
            return tiers
        time.sleep(0.5)


def at_rate(run: dict[str, Any], rate: float) -> dict[str, Any] | None:
    return next((p for p in run["points"] if p["rate_req_per_s"] == rate), None)


def simulated_ratio() -> dict[str, Any] | None:
    """The simulator's capacity ratio from its committed result, and the setup it is for."""
    path = REPO_ROOT / "bench" / "results" / "sim.json"
    if not path.exists():
        return None
    sim = json.loads(path.read_text())
    return {"capacity_ratio_vs_exclusive": sim.get("capacity_ratio_vs_exclusive"), "setup": sim.get("setup")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", choices=sorted(SETUPS), default="three", help="the work (bench/cluster_setups.py)")
    ap.add_argument(
        "--sim-only",
        action="store_true",
        help="no real cluster: the simulator's search alone, into setups[SETUP].sim of <out>/cluster.json",
    )
    ap.add_argument(
        "--duration", type=float, default=None, help="seconds of counted arrivals at each rate tried (the setup's)"
    )
    ap.add_argument(
        "--ramp", type=float, default=None, help="seconds of each rate's load sent first and not counted (the setup's)"
    )
    ap.add_argument(
        "--nodes",
        type=int,
        default=3,
        help="engine nodes, each pinned to its own cores (sharing them past one per core)",
    )
    ap.add_argument("--keep-alive", type=float, default=30.0, help="every model's keep-alive (s)")
    ap.add_argument("--seed", type=int, default=None, help="the arrivals' seed (the setup's)")
    ap.add_argument("--burst", type=int, default=6, help="chat requests per burst")
    ap.add_argument(
        "--burst-spread",
        type=float,
        default=0.5,
        help="seconds over which a burst's requests arrive (evenly; 0: at once)",
    )
    ap.add_argument(
        "--start-rate",
        type=float,
        default=None,
        help="first rate tried (req/s; default: the setup's, (a): the load at x=1)",
    )
    ap.add_argument("--steps", type=int, default=3, help="bisections after the bracketing")
    ap.add_argument(
        "--rates", type=float, nargs="+", default=None, help="measure at these rates only (no search): implies --only"
    )
    ap.add_argument("--keep-logs", type=Path, default=None, help="copy each run's service logs here")
    ap.add_argument(
        "--ablate-interleave",
        action="store_true",
        help="also run Tessera with TESSERA_INTERLEAVE=false (the headroom gate off)",
    )
    ap.add_argument(
        "--only",
        choices=sorted(VARIANTS),
        action="append",
        default=None,
        help="run only this variant (repeatable): writes <out>/cluster-only.json, no comparison",
    )
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    setup = SETUPS[args.setup]
    seed = setup.seed if args.seed is None else args.seed
    duration = setup.duration_s if args.duration is None else args.duration
    ramp = setup.ramp_s if args.ramp is None else args.ramp
    load = Load(seed, duration, args.burst, args.burst_spread, ramp, setup)
    start_rate = args.start_rate or setup.start_rate(args.burst)
    if args.sim_only:
        return write_setup(args, setup, load, start_rate, real=None, fitted_from=None)
    load_before = os.getloadavg()
    started = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="tessera-cluster-shared-") as tmp:
        gguf = default_model_path()
        sources = {}
        for m in setup.models:
            if not m.suffix:
                sources[m.name] = gguf
                continue
            copy = Path(tmp) / f"{gguf.stem}-{m.name}.gguf"
            shutil.copyfile(gguf, copy)
            with copy.open("ab") as f:
                f.write(m.suffix)
            sources[m.name] = copy
        store = Path(tmp) / "store"
        log(
            f"setup {setup.name}: capacity search from {start_rate:.2f} req/s, {duration:.0f}s per rate "
            f"after a {ramp:.0f}s ramp, on {args.nodes} nodes"
        )
        t = time.perf_counter()
        prepare_store(store, sources, args.keep_alive, setup.models)
        log(f"{len(setup.models)} models converted into the shared store in {time.perf_counter() - t:.1f}s")
        variants = args.only or ["tessera", "exclusive"] + (["tessera-no-interleave"] if args.ablate_interleave else [])
        for variant in variants:
            runs.append(
                run_policy(
                    variant,
                    args.nodes,
                    store,
                    sources,
                    load,
                    start_rate,
                    args.steps,
                    args.keep_alive,
                    args.keep_logs,
                    args.rates,
                )
            )
    caps = {r["policy"]: r["capacity_req_per_s"] for r in runs}
    if args.only or args.rates:  # no comparison: the runs and their requests, for a look
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cluster-only.json").write_text(json.dumps(runs, indent=2) + "\n")
        print(json.dumps(caps, indent=2))
        return 0
    ratio = caps["tessera"] / caps["exclusive"] if caps["exclusive"] > 0 else None
    result = {
        "capacity_req_per_s": caps,
        "capacity_ratio_vs_exclusive": ratio,
        "target": "tessera's capacity above the exclusive baseline's (LLM-Mesh: +44-63 %)"
        + ("; issue 37, many models: at least 1.44x" if setup.name == "many" else ""),
        "target_met": ratio is not None and ratio >= (1.44 if setup.name == "many" else 1.0) and ratio > 1.0,
        "simulator": simulated_ratio(),
        "slo_target": SLO_TARGET,
        "search": {
            "start_rate_req_per_s": start_rate,
            "steps": args.steps,
            "duration_s_per_rate": duration,
            "ramp_s_per_rate": ramp,
            "note": "one load per rate, on the cluster as the previous rate left it",
        },
        "curves": {r["policy"]: sorted((p["rate_req_per_s"], p["slo_attainment"]) for p in r["points"]) for r in runs},
        "curves_ci95": {
            r["policy"]: sorted((p["rate_req_per_s"], *p["slo_attainment_ci95"]) for p in r["points"]) for r in runs
        },
        "setup": setup.name,
        "models": [{"name": m.name, "ttft_slo_s": m.ttft_slo_s, "tpot_slo_s": m.tpot_slo_s} for m in setup.models],
        "nodes": args.nodes,
        "core_share": core_shares(args.nodes)[1],
        "node_env": core_shares(args.nodes)[0],
        "keep_alive_s": args.keep_alive,
        "seed": seed,
        "chat_burst": args.burst,
        "chat_burst_spread_s": args.burst_spread,
        "tokens_per_request": TOKENS,
        "runs": [
            {**{k: v for k, v in r.items() if k != "points"}, "points": [strip(p) for p in r["points"]]} for r in runs
        ],
        "requests_at_capacity": {
            r["policy"]: (p["results"] if (p := at_rate(r, r["capacity_req_per_s"])) else []) for r in runs
        },
        "machine": machine_info(load_before),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "bench_wall_s": time.perf_counter() - started,
    }
    # The JSON first (`write_setup` makes its folder): a half-hour run is never lost to its plot.
    print(json.dumps({k: v for k, v in result.items() if k not in ("requests_at_capacity", "runs")}, indent=2))
    code = write_setup(
        args, setup, load, start_rate, real=result, fitted_from=result if setup.name == "three" else None
    )
    return code


def write_setup(
    args: argparse.Namespace,
    setup: Setup,
    load: Load,
    start_rate: float,
    real: dict[str, Any] | None,
    fitted_from: dict[str, Any] | None,
) -> int:
    """Write `setups[setup]` of `<out>/cluster.json` (the other setups kept): the real run's
    side (None: kept as it was, or null), and the simulator's on the same load and search,
    its node fitted to setup (a)'s real run (`fitted_from`, else `cluster.json`'s); for setup
    (a)'s real run, the file's top-level keys too (the format before issue 37's setups)."""
    path = args.out / "cluster.json"
    report = read_report(path)
    fit_source = fitted_from or (
        report if "runs" in report else read_report(REPO_ROOT / "bench" / "results" / "cluster.json")
    )
    coldstart = read_report(REPO_ROOT / "bench" / "results" / "coldstart.json")
    t = time.perf_counter()
    own = real if real is not None else report.get("setups", {}).get(setup.name, {}).get("real")
    sim = simulated_side(
        load, args.nodes, args.steps, start_rate, fit_source, coldstart, lambda m: log(f"sim: {m}"), own=own
    )
    log(f"setup {setup.name} simulated in {time.perf_counter() - t:.1f}s: {sim['capacity_req_per_s']}")
    if real is not None:
        real_kept: Any = {
            **real_side(real),
            **({} if setup.name == "three" else {k: real[k] for k in ("runs", "requests_at_capacity", "machine")}),
        }
    else:
        real_kept = report.get("setups", {}).get(setup.name, {}).get("real")
    if real is not None and setup.name == "three":
        report = {**report, **real}
    entry = setup_entry(setup, load, args.nodes, args.keep_alive, real_kept, sim)
    report = with_setup(report, setup.name, entry)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    plot_report(report, args.out / "cluster.png")
    log(f"wrote {path} (setups.{setup.name}) and {args.out / 'cluster.png'}")
    print(
        json.dumps(
            {k: v for k, v in entry.items() if k != "real"}
            | {"real": real_side(real) if real else real_kept and real_side(real_kept)},
            indent=2,
        )
    )
    return 0


def strip(point: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in point.items() if k != "results"}


if __name__ == "__main__":
    raise SystemExit(main())
