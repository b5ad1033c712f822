"""Load test: many concurrent streaming clients over three models, one scaled to zero midway.

    python -m bench.load [--clients 200] [--duration 60] [--out bench/results]

A `LocalCluster` on loopback (one node) serves three names on the default GGUF: `load-a`,
`load-b` (keep-alive 300 s) and `load-c` (keep-alive 3 s), with `TESSERA_REJECT_OVER_SLO=4`
(a request predicted past 4 × its TTFT SLO is refused with 429 rather than queued). `--clients` asyncio clients each
loop for `--duration` seconds: pick a model (round-robin by client), stream a chat request
(`max_tokens` 16), record how it ended, go again; a 429/503 is an answer too (recorded by
kind), after which the client waits the `Retry-After` it was given. The clients of `load-c`
pause from 40 % to 60 % of the run, so `load-c` scales to zero and its next requests
cold-start under load. Before the clock starts, three requests per model warm it up (and give
the scheduler the measurements its admission uses). After the deadline no client starts a request, and those in flight get
up to 60 s to end; any that has not is "lost" (the target is none).

Reports `requests`, `completed`, `errors` by kind, `lost`, TTFT and TPOT percentiles (all
completed requests, and the warm ones: not waiting on a cold start), cold starts, and writes
`<out>/load.json` and `<out>/load.png`. Stops by itself; binds nothing but loopback.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/load.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.common import machine_info, make_log, percentile
from ops.localcluster import LocalCluster, default_model_path

log = make_log("load")
REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS = (("load-a", 300.0), ("load-b", 300.0), ("load-c", 3.0))
TOKENS = 16
DRAIN_S = 60.0


async def one(http: httpx.AsyncClient, model: str, t0: float) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something about rivers."}],
        "max_tokens": TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    out: dict[str, Any] = {"model": model, "at_s": sent - t0}
    first = last = None
    tokens = 0
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                out["kind"] = f"http_{r.status_code}"
                out["retry_after_s"] = float(r.headers.get("retry-after", "1"))
                return out
            done = False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    continue
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out["kind"] = f"stream_{event['error'].get('code')}"
                    return out
                if event.get("usage"):
                    tokens = int(event["usage"]["completion_tokens"])
                choices = event.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
            if not done:
                out["kind"] = "no_done"
                return out
    except httpx.TimeoutException:
        out["kind"] = "timeout"
        return out
    except httpx.HTTPError as e:
        out["kind"] = type(e).__name__
        return out
    out["kind"] = "completed"
    if first is not None and last is not None:
        out["ttft_s"] = first - sent
        out["tpot_s"] = (last - first) / (tokens - 1) if tokens > 1 else None
    return out


async def drive(base_url: str, clients: int, duration_s: float) -> tuple[list[dict[str, Any]], int, float]:
    results: list[dict[str, Any]] = []
    started = 0
    t0 = time.perf_counter()
    deadline = t0 + duration_s
    pause = (t0 + 0.4 * duration_s, t0 + 0.6 * duration_s)
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(120.0), limits=limits) as http:

        async def client(i: int) -> None:
            nonlocal started
            model = MODELS[i % len(MODELS)][0]
            while time.perf_counter() < deadline:
                if model == "load-c" and pause[0] <= time.perf_counter() < pause[1]:
                    await asyncio.sleep(pause[1] - time.perf_counter())
                    continue
                started += 1
                res = await one(http, model, t0)
                results.append(res)
                if res["kind"].startswith("http_"):
                    await asyncio.sleep(min(res.get("retry_after_s", 1.0), max(0.0, deadline - time.perf_counter())))

        tasks = [asyncio.create_task(client(i)) for i in range(clients)]
        _, pending = await asyncio.wait(tasks, timeout=duration_s + DRAIN_S)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return results, started, time.perf_counter() - t0


def summarize(results: list[dict[str, Any]], started: int, cold_times: list[tuple[float, float]]) -> dict[str, Any]:
    done = [r for r in results if r["kind"] == "completed" and "ttft_s" in r]

    def in_cold_start(r: dict[str, Any]) -> bool:
        return any(a <= r["at_s"] <= b for a, b in cold_times)

    warm = [r for r in done if not in_cold_start(r)]
    ttft = [r["ttft_s"] for r in done]
    warm_ttft = [r["ttft_s"] for r in warm]
    tpot = [r["tpot_s"] for r in done if r.get("tpot_s") is not None]
    kinds = Counter(r["kind"] for r in results)
    p50, p99 = (percentile(warm_ttft, 50), percentile(warm_ttft, 99)) if warm_ttft else (None, None)
    return {
        "requests": started,
        "completed": kinds.get("completed", 0),
        "errors": {k: v for k, v in kinds.items() if k != "completed"},
        "lost": started - len(results),
        "ttft_p50_s": percentile(ttft, 50) if ttft else None,
        "ttft_p99_s": percentile(ttft, 99) if ttft else None,
        "tpot_p50_s": percentile(tpot, 50) if tpot else None,
        "tpot_p99_s": percentile(tpot, 99) if tpot else None,
        "warm_ttft_p50_s": p50,
        "warm_ttft_p99_s": p99,
        "warm_ttft_p99_over_p50": p99 / p50 if p50 and p99 is not None else None,
        "per_model": {m: Counter(r["kind"] for r in results if r["model"] == m) for m, _ in MODELS},
    }


def plot(results: list[dict[str, Any]], duration_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for m, _ in MODELS:
        pts = [(r["at_s"], r["ttft_s"]) for r in results if r["model"] == m and "ttft_s" in r]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=4, label=m)
    rejected = [r["at_s"] for r in results if r["kind"].startswith("http_")]
    if rejected:
        ax.scatter(rejected, [0] * len(rejected), s=4, marker="|", color="grey", label="429/503 (retried)")
    ax.axvspan(0.4 * duration_s, 0.6 * duration_s, color="orange", alpha=0.12, label="load-c paused (scales to zero)")
    ax.set_xlabel("request sent (s after the start)")
    ax.set_ylabel("TTFT (s)")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.legend(fontsize=8, markerscale=3)
    ax.set_title("Load: streaming clients over three models, one scaled to zero midway")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tessera-load-") as home:
        # Admission refuses what would be far past its SLO (429) instead of queueing it.
        cluster = LocalCluster(
            home=Path(home), env={"TESSERA_KEEP_ALIVE_CHECK_S": "0.25", "TESSERA_REJECT_OVER_SLO": "4"}
        )
        try:
            cluster.start(timeout_s=120)
            for name, keep in MODELS:
                httpx.post(
                    f"{cluster.base_url}/admin/models",
                    timeout=900,
                    json={"name": name, "source": str(default_model_path()), "keep_alive_s": keep},
                ).raise_for_status()
            # Warm-up, not measured: each model starts and the engine reports the measurements
            # the scheduler's performance model (and so its admission) is fitted from.
            for name, _ in MODELS:
                for _ in range(3):
                    httpx.post(
                        f"{cluster.base_url}/v1/chat/completions",
                        timeout=120,
                        json={
                            "model": name,
                            "max_tokens": TOKENS,
                            "messages": [{"role": "user", "content": "Say something about rivers."}],
                        },
                    ).raise_for_status()
            log(f"{args.clients} clients for {args.duration:.0f}s at {cluster.base_url}")
            before = time.time()
            results, started, wall = asyncio.run(drive(cluster.base_url, args.clients, args.duration))
            starts = [
                s
                for s in httpx.get(f"{cluster.base_url}/admin/coldstarts?limit=1000", timeout=10).json()
                if s["started_at"] >= before
            ]
        finally:
            cluster.stop()
    t_begin = before
    cold_times = [(s["started_at"] - t_begin, s["started_at"] - t_begin + s["total_s"]) for s in starts]
    summary = summarize(results, started, cold_times)
    result = {
        **summary,
        "clients": args.clients,
        "duration_s": args.duration,
        "wall_s": wall,
        "max_tokens": TOKENS,
        "cold_starts": [
            {"model": s["model"], "source": s.get("source"), "total_s": s["total_s"], "at_s": s["started_at"] - t_begin}
            for s in starts
        ],
        "targets": {
            "lost": {"value": summary["lost"], "target": "== 0", "pass": summary["lost"] == 0},
            "warm_ttft_p99_over_p50": {
                "value": summary["warm_ttft_p99_over_p50"],
                "target": "<= 2",
                "pass": (summary["warm_ttft_p99_over_p50"] or 99) <= 2,
            },
        },
        "machine": machine_info(load_before),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(results, args.duration, args.out / "load.png")
    log(f"wrote {args.out / 'load.json'} and {args.out / 'load.png'}")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
