"""Serverless under a skewed trace: many models on one node's memory, with and without pinning
the most popular, and with warm fallbacks (issue 35's benchmark).

    python -m bench.serverless [--duration 180] [--rate 0.5] [--seed 35] [--models 20]
        [--memory-budget-gib 4] [--keep-alive 5] [--runs plain pinned aliases]
        [--store DIR] [--out bench/results]

`--models` models (`bench/serverless_models.py`: copies of the real SmolLM2-135M and of the
SmolLM2-360M shape, each its own artifact) get requests with Zipf popularity and bursty
log-normal inter-arrival times (`bench/serverless_trace.py`), `--rate` requests a second in all
over `--duration` seconds, the same seeded trace in every run. Each run starts a `LocalCluster`
(one node, 2 inference threads) in a fresh home whose memory manager's budget
(`TESSERA_MEMORY_BUDGET_BYTES`) holds a few of the models at once, registers every model with a
`--keep-alive` of seconds (so idle models scale to zero within the trace) and generous SLOs
(TTFT 10 s, TPOT 1 s), then replays the trace open-loop (each request sent at its time, a
streamed chat completion of `--max-tokens` greedy tokens) and reads:

- `cold_starts_per_hour`: the engine's starts during the replay (`tessera_coldstart_seconds`'
  count) per hour of the trace's span (`--duration` of wall-clock replay, the same in every
  run): the trace is time-compressed, so this is a rate of the replay, comparable between runs,
  not a forecast for a real hour of traffic;
- `ttft_p50_s`, `ttft_p99_s`: sent → first content, over the answered requests;
- `timeouts_30s`: requests a 30 s client read timeout would have lost without progress
  comments (no data line for 30 s: before the first, between two, or before a failure);
- `timeouts_30s_with_progress`: the same when every line resets the timeout, the progress
  comments (`: tessera loading ...`, issue 35 part 4) included.

Runs:

- `plain`: every model scales to zero, nothing pinned;
- `pinned`: the `PINNED` most popular pinned (`POST /admin/models/{name}/pin` with
  `min_instances` 1, issue 35 part 1) and loaded before the replay starts;
- `aliases`: the popular big models (`ALIASED`) requested through an alias each (`POST
  /admin/models` with `fallbacks`: the big model, then the two most popular small ones), so a
  request finds a warm small model rather than waiting for the big one's start (part 3).

A run whose API is missing (the pin endpoint answers 404/405) is recorded with its figures
null and the reason; so is `timeouts_30s_with_progress` when the gateway sends no progress
(the `/v1/models` cards carry no `status` and no comment line arrived). The top-level
`timeouts_30s_with_progress` is the total over the runs that measured it (the target is 0).

Writes `<out>/serverless.json` and `<out>/serverless.png`; prints the JSON, progress on stderr.
Registration converts each model once into `--store` (kept between invocations, so a re-run
converts nothing: about 5 minutes the first time on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/serverless.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import serverless_trace
from bench.common import THREADS, machine_info, make_log
from bench.serverless_client import per_model, replay, rows, summarize
from bench.serverless_models import BenchModel, bench_models
from bench.serving_memory import RssSampler, descendants
from ops.localcluster import REPO_ROOT, LocalCluster

log = make_log("serverless")

RUNS = ("plain", "pinned", "aliases")
PINNED = 3
BIG_RANKS = frozenset({1, 4, 7, 12, 17})
"""The ranks on the big base: popular and rare ones."""
ALIASED = (1, 4)
"""The popular big models the `aliases` run requests through an alias."""
FALLBACK_RANKS = (0, 2)
"""The alias's fallbacks after its big model: the two most popular small models."""
TTFT_SLO_S, TPOT_SLO_S = 10.0, 1.0
REGISTER_TIMEOUT_S = 900.0
PIN_LOADED_TIMEOUT_S = 300.0
ENGINE = "engine@node-0"
STORE = Path.home() / ".cache" / "tessera" / "serverless-store"
FIGURES = ("cold_starts_per_hour", "ttft_p50_s", "ttft_p99_s", "timeouts_30s")


def alias_of(rank: int) -> str:
    return f"chat-{rank:02d}"


# --- the cluster ---------------------------------------------------------------------------------


class Admin:
    """The admin calls a run makes."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.http = httpx.Client(base_url=cluster.base_url, headers=cluster.admin_headers, timeout=60)

    def close(self) -> None:
        self.http.close()

    def register(self, m: BenchModel, keep_alive_s: float) -> float:
        t0 = time.perf_counter()
        body = {
            "name": m.name,
            "source": str(m.path),
            "keep_alive_s": keep_alive_s,
            "ttft_slo_s": TTFT_SLO_S,
            "tpot_slo_s": TPOT_SLO_S,
        }
        self.http.post("/admin/models", json=body, timeout=REGISTER_TIMEOUT_S).raise_for_status()
        return time.perf_counter() - t0

    def alias(self, name: str, fallbacks: list[str]) -> None:
        self.http.post("/admin/models", json={"name": name, "fallbacks": fallbacks}).raise_for_status()

    def pin(self, name: str) -> str | None:
        """Pin `name` (one instance); why not, or None."""
        r = self.http.post(f"/admin/models/{name}/pin", json={"min_instances": 1})
        if r.status_code in (404, 405):
            return f"no pin API (POST /admin/models/{name}/pin answered {r.status_code})"
        if not r.is_success:  # 409: the pinned set does not fit the node
            return f"pin {name}: HTTP {r.status_code}: {r.text[:300]}"
        return None

    def loaded(self) -> set[str]:
        status = self.http.get("/admin/instances", timeout=10).raise_for_status().json()
        return {i["model"] for n in status["nodes"] for i in n["instances"]}

    def wait_loaded(self, names: list[str], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if set(names) <= self.loaded():
                return True
            time.sleep(0.5)  # sync-ok: polling the instances with a deadline
        return False

    def progress_api(self) -> bool:
        """Whether the gateway reports loading states (`/v1/models` cards' `status`, issue 35
        part 4, which ships with the progress comments)."""
        cards = self.http.get("/v1/models", timeout=10).raise_for_status().json()["data"]
        return any("status" in c for c in cards)

    def cold_start_count(self) -> int:
        port = self.cluster.procs[ENGINE].http_port
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        return int(
            sum(
                s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
                if s.name == "tessera_coldstart_seconds_count"
            )
        )

    def cold_start_sources(self, since_wall: float) -> dict[str, int]:
        """Where the starts since `since_wall` read their weights from (the last 200 kept)."""
        starts = self.http.get("/admin/coldstarts", params={"limit": 200}, timeout=10).raise_for_status().json()
        return dict(Counter(e.get("source", "?") for e in starts if e.get("started_at", 0) >= since_wall))


class NodeSampler:
    """The node's booked memory and loaded instances, sampled every second in a thread."""

    def __init__(self, base_url: str) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=10)
        self.peak_used = 0
        self.peak_loaded = 0
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="node-sampler", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            try:
                node = self.http.get("/admin/instances").json()["nodes"][0]
            except (httpx.HTTPError, KeyError, IndexError, ValueError):
                continue
            self.peak_used = max(self.peak_used, int(node.get("memory_used_bytes", 0)))
            self.samples.append(len(node.get("instances", ())))
            self.peak_loaded = max(self.peak_loaded, self.samples[-1])

    def __enter__(self) -> NodeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.http.close()


# --- one run -------------------------------------------------------------------------------------


def null_run(reason: str) -> dict[str, Any]:
    return {**dict.fromkeys(FIGURES), "timeouts_30s_with_progress": None, "available": False, "reason": reason}


def schedule_for(
    run: str, models: list[BenchModel], arrivals: list[serverless_trace.Arrival]
) -> list[tuple[float, int, str]]:
    """(at_s, rank, name requested): the model's own name, or in `aliases` its alias."""
    aliased = set(ALIASED) if run == "aliases" else set()
    return [(a.at_s, a.rank, alias_of(a.rank) if a.rank in aliased else models[a.rank].name) for a in arrivals]


def prepare(run: str, admin: Admin, models: list[BenchModel]) -> tuple[str | None, dict[str, Any]]:
    """The run's own setup: why it cannot run (or None), and what it set up."""
    if run == "pinned":
        top = [m.name for m in models[:PINNED]]
        for name in top:
            why = admin.pin(name)
            if why is not None:
                return why, {}
        t0 = time.perf_counter()
        if not admin.wait_loaded(top, PIN_LOADED_TIMEOUT_S):
            return f"pinned models {top} not all loaded within {PIN_LOADED_TIMEOUT_S:.0f}s", {}
        return None, {"pinned": top, "pinned_loaded_s": time.perf_counter() - t0}
    if run == "aliases":
        aliases = {}
        for rank in ALIASED:
            fallbacks = [models[rank].name, *(models[r].name for r in FALLBACK_RANKS)]
            admin.alias(alias_of(rank), fallbacks)
            aliases[alias_of(rank)] = fallbacks
        return None, {"aliases": aliases}
    return None, {}


def bench_run(
    run: str,
    models: list[BenchModel],
    arrivals: list[serverless_trace.Arrival],
    args: argparse.Namespace,
    home: Path,
) -> tuple[dict[str, Any], dict[str, float]]:
    """One run on a fresh cluster: its figures, and each model's registration seconds."""
    env = {
        "TESSERA_INFERENCE_THREADS": str(THREADS),
        "TESSERA_MEMORY_BUDGET_BYTES": str(int(args.memory_budget_gib * 1024**3)),
    }
    cluster = LocalCluster(home=home, store=args.store, env=env)
    cluster.start(timeout_s=120.0)
    admin = Admin(cluster)
    try:
        register_s = {}
        for m in models:
            register_s[m.name] = admin.register(m, args.keep_alive)
            log(f"{run}: registered {m.name} ({m.base}) in {register_s[m.name]:.1f}s")
        why, setup = prepare(run, admin, models)
        if why is not None:
            log(f"{run}: not run: {why}")
            return null_run(why), register_s
        progress = admin.progress_api()
        schedule = schedule_for(run, models, arrivals)
        engine_pid = cluster.procs[ENGINE].pid
        before, since_wall, load_before = admin.cold_start_count(), time.time(), os.getloadavg()
        log(f"{run}: replaying {len(schedule)} requests over {args.duration:.0f}s")
        with NodeSampler(cluster.base_url) as node, RssSampler(lambda: [engine_pid, *descendants(engine_pid)]) as rss:
            records, _, wall_s = asyncio.run(replay(cluster.base_url, schedule, args.max_tokens))
        cold = admin.cold_start_count() - before
        res = summarize(records, args.duration, wall_s, cold)
        seen_progress = progress or res["progress_comments"] > 0
        if not seen_progress:
            res["timeouts_30s_with_progress"] = None
        res.update(
            {
                "available": True,
                # The host's load around this run: runs on a shared machine compare only at like load.
                "loadavg_before": list(load_before),
                "loadavg_after": list(os.getloadavg()),
                "progress_api": seen_progress,
                "cold_start_sources": admin.cold_start_sources(since_wall),
                "node_memory_peak_bytes": node.peak_used,
                "engine_rss_peak_bytes": rss.peak,
                "loaded_peak": node.peak_loaded,
                "loaded_mean": sum(node.samples) / len(node.samples) if node.samples else None,
                **setup,
                "per_model": per_model(records),
                "records": rows(records),
            }
        )
        log(
            f"{run}: {cold} starts in {wall_s:.0f}s ({res['cold_starts_per_hour']:.0f}/h), ttft p50 "
            f"{res['ttft_p50_s']} p99 {res['ttft_p99_s']}, timeouts_30s {res['timeouts_30s']}, errors {res['errors']}"
        )
        return res, register_s
    finally:
        admin.close()
        cluster.stop()


# --- results -------------------------------------------------------------------------------------


def plot(res: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    runs = [r for r in RUNS if r in res["runs"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    panels = (
        ("cold starts per replayed hour", [("cold_starts_per_hour", "")]),
        ("TTFT (s)", [("ttft_p50_s", "p50"), ("ttft_p99_s", "p99")]),
        (
            "requests lost to a 30 s timeout",
            [("timeouts_30s", "no progress"), ("timeouts_30s_with_progress", "progress")],
        ),
    )
    for ax, (title, keys) in zip(axes, panels, strict=True):
        width = 0.8 / len(keys)
        for i, (key, label) in enumerate(keys):
            values = [res["runs"][r].get(key) for r in runs]
            xs = [x + i * width for x in range(len(runs))]
            ax.bar(xs, [v or 0 for v in values], width, label=label or None)
            for x, v in zip(xs, values, strict=True):
                text = "n/a" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.3g}"
                ax.annotate(text, (x, v or 0), ha="center", va="bottom", fontsize=7)
        ax.set_xticks([x + (len(keys) - 1) * width / 2 for x in range(len(runs))], runs)
        ax.set_title(title, fontsize=10)
        if len(keys) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(
        f"bench/serverless.py: {len(res['models'])} models, {res['trace']['requests']} requests in "
        f"{res['trace']['duration_s']:.0f} s, node budget {res['memory_budget_gib']} GiB ({res['date']})",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=180.0, help="trace seconds (default 180)")
    ap.add_argument("--rate", type=float, default=0.5, help="requests a second, all models (default 0.5)")
    ap.add_argument("--seed", type=int, default=35)
    ap.add_argument("--models", type=int, default=20)
    ap.add_argument("--memory-budget-gib", type=float, default=4.0, help="the node's memory budget (default 4)")
    ap.add_argument("--keep-alive", type=float, default=5.0, help="seconds idle before scale to zero (default 5)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    ap.add_argument("--store", type=Path, default=STORE, help="model store kept between runs")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    if args.models <= max(*ALIASED, *FALLBACK_RANKS, PINNED - 1):
        ap.error(f"--models must be more than {max(*ALIASED, *FALLBACK_RANKS, PINNED - 1)}")
    load_before = os.getloadavg()
    started = time.perf_counter()
    models = bench_models(args.models, BIG_RANKS)
    arrivals = serverless_trace.generate(args.seed, args.models, args.rate, args.duration)
    runs: dict[str, Any] = {}
    register_s: dict[str, float] = {}
    for run in args.runs:
        with tempfile.TemporaryDirectory(prefix=f"tessera-serverless-{run}-") as home:
            try:
                runs[run], reg = bench_run(run, models, arrivals, args, Path(home))
                register_s = register_s or reg
            except Exception as e:  # one run failing leaves the others' results
                log(f"{run} failed: {type(e).__name__}: {e}")
                runs[run] = {**null_run(f"{type(e).__name__}: {e}"), "failed": True}
    with_progress = [
        r["timeouts_30s_with_progress"] for r in runs.values() if r.get("timeouts_30s_with_progress") is not None
    ]
    res = {
        "models": [
            {"name": m.name, "rank": m.rank, "base": m.base, "register_s": register_s.get(m.name)} for m in models
        ],
        "runs": runs,
        "timeouts_30s_with_progress": sum(with_progress) if with_progress else None,
        "trace": {
            "seed": args.seed,
            "duration_s": args.duration,
            "rate_per_s": args.rate,
            "requests": len(arrivals),
            "requests_per_rank": serverless_trace.popularity(arrivals, args.models),
            "zipf_s": serverless_trace.ZIPF_S,
            "iat_sigma": serverless_trace.IAT_SIGMA,
        },
        "memory_budget_gib": args.memory_budget_gib,
        "keep_alive_s": args.keep_alive,
        "max_tokens": args.max_tokens,
        "pinned_ranks": list(range(PINNED)),
        "aliased_ranks": list(ALIASED),
        "threads": THREADS,
        "machine": machine_info(load_before),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "bench_wall_s": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serverless.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, args.out / "serverless.png")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
