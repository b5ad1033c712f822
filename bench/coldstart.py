"""Cold-start benchmark: Tessera's scale-from-zero TTFT against llama.cpp and naive OpenVINO.

    python -m bench.coldstart [--trials 5] [--peer-runs 3] [--out bench/results]

One run starts a local cluster in a temporary home, registers SmolLM2-135M-Instruct with a
1-second keep-alive (so the scheduler scales it to zero between requests), and measures:

- `tessera_cold_ttft_s` (= `tessera_cold_host_ttft_s`, the issue's "host-cache hit"): request
  sent → first SSE content token, the model scaled to zero and its worker evicted
  (`POST /admin/cache/evict?tier=resident`), so the start stages the blob from the loader's
  host cache (`source: "host"`); its median phases in `tessera_host_phases`, and the split of
  Load into the loader's answer (`tessera_host_stage_s`) and the worker's import
  (`tessera_host_worker_load_s`);
- `tessera_cold_resident_ttft_s`: the same with the compiled weights still resident in an idle
  worker (`source: "resident"`, a tier above the host cache; `tessera_resident_phases`);
- `tessera_cold_disk_ttft_s`, `tessera_disk_phases`: the same, but every cache is dropped
  after each scale to zero (`POST /admin/cache/evict?tier=all`: the resident model, the
  loader's host cache, and the store files from the OS page cache), so the start reads the
  model store from disk (`source: "store"`);
- `burst`: 16 concurrent streamed first requests on the model scaled to zero (resident): TTFT
  p50/p99, failures, and how many cold starts they caused (1 expected);
- `tessera_warm_ttft_s`: the same on the loaded model (back-to-back requests);
- `tessera_decode_tok_s`: (completion tokens - 1) / (last token - first token) of a
  128-token streamed request with `ignore_eos`.

Then, with the cluster stopped, each peer in a fresh process (`bench/peers.py`, median of
`--peer-runs`): llama.cpp (import → load → first token; decode) and OpenVINO GenAI loading
the GGUF directly (import → load+convert → first token; then warm TTFT and decode in-process).

`targets` compares the ratios with the project's targets. Prints one JSON object and writes `<out>/coldstart.json` and `<out>/coldstart.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/coldstart.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.common import (
    COLDSTART_LOG_TIMEOUT_S,
    EVICT_TIMEOUT_S,
    PHASES,
    THREADS,
    ChatStream,
    TesseraClient,
    chat_body,
    machine_info,
    make_log,
    median,
    median_index,
    percentile,
    resident_ids,
    stream_chat,
)
from ops.localcluster import REPO_ROOT, LocalCluster, default_model_path

MODEL_NAME = "bench-smollm2-135m"
KEEP_ALIVE_S = 1.0
PROMPT = "Write a short poem about the sea."  # the same prompt as bench/peers.py
COLD_MAX_TOKENS = 16
DECODE_TOKENS = 128

BURST_SIZE = 16
BURST_MAX_TOKENS = 8

BURST_REQUEST_TIMEOUT_S = 180.0
BURST_SETTLE_S = 2.0
PEER_TIMEOUT_S = 600.0

log = make_log("bench")


# --- Tessera -------------------------------------------------------------------------------------


class Tessera(TesseraClient):
    """The client, with the bench model's streamed request and cache eviction."""

    def wait_zero(self) -> float:
        """Wait until the bench model is scaled to zero; the seconds it took."""
        return self.wait_scaled_to_zero(MODEL_NAME, note=f" (keep-alive {KEEP_ALIVE_S}s)")

    def stream(self, max_tokens: int, ignore_eos: bool = False) -> dict[str, Any]:
        """One streamed chat request; times from just before sending it."""
        res = stream_chat(self.http, chat_body(MODEL_NAME, PROMPT, max_tokens, ignore_eos))
        sent, arrivals = res["sent"], res["arrivals"]
        return {
            "sent_wall": res["sent_wall"],
            "ttft_s": arrivals[0] - sent,
            "first": arrivals[0],
            "last": arrivals[-1],
            "usage": res["usage"],
            "text": "".join(res["chunks"]),
        }

    def evict(self, artifact_id: str, tier: str = "resident", timeout_s: float = EVICT_TIMEOUT_S) -> dict[str, Any]:
        """`POST /admin/cache/evict?tier=<tier>` until the bench model's artifact is among the
        resident models dropped (`host` and `all` drop the resident models too, then the deeper
        caches); see `TesseraClient.evict_until`."""
        answers, evict_s = self.evict_until(artifact_id, {"tier": tier}, timeout_s)
        freed: dict[str, int] = {}
        for e in (e for answer in answers for e in answer):
            t = str(e.get("tier"))
            freed[t] = freed.get(t, 0) + int(e.get("freed_bytes", 0))
        return {
            "tier": tier,
            "freed_bytes": sum(freed.values()),
            "freed_bytes_by_tier": freed,
            "artifact_ids": resident_ids(answers[-1]),
            "calls": len(answers),
            "evict_s": evict_s,
        }


async def _burst_one(http: httpx.AsyncClient) -> dict[str, Any]:
    """One streamed request of the burst: its TTFT, or the status/error that ended it."""
    t0 = time.perf_counter()
    chat = ChatStream()
    async with http.stream("POST", "/v1/chat/completions", json=chat_body(MODEL_NAME, PROMPT, BURST_MAX_TOKENS)) as r:
        if r.status_code != 200:
            await r.aread()
            return {"ok": False, "status": r.status_code, "error": r.text[:300]}
        async for line in r.aiter_lines():
            if not chat.feed(line):
                break
    problem = chat.problem()
    if problem is not None:
        return {"ok": False, "status": 200, "error": problem}
    return {"ok": True, "status": 200, "ttft_s": chat.arrivals[0] - t0}


async def _burst(base_url: str, n: int) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    timeout = httpx.Timeout(BURST_REQUEST_TIMEOUT_S, connect=10.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as http:

        async def bounded(i: int) -> dict[str, Any]:
            # A hard bound on the whole request (httpx's timeouts are per read, not total).
            try:
                return await asyncio.wait_for(_burst_one(http), BURST_REQUEST_TIMEOUT_S)
            except TimeoutError:
                return {"ok": False, "status": None, "error": f"no end within {BURST_REQUEST_TIMEOUT_S}s"}
            except httpx.HTTPError as e:
                return {"ok": False, "status": None, "error": f"{type(e).__name__}: {e}"}

        results = await asyncio.gather(*(bounded(i) for i in range(n)))
    return [{"index": i, **r} for i, r in enumerate(results)]


def burst(client: Tessera, n: int) -> dict[str, Any]:
    """n concurrent first requests on the model scaled to zero; how many starts they caused."""
    sent_wall = time.time()
    t0 = time.perf_counter()
    results = asyncio.run(_burst(client.base_url, n))
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    # The start's record is written once its first token is out; wait for it (bounded), then a
    # little longer so that a second start, if the burst caused one, is counted too.
    starts: list[dict[str, Any]] = []
    deadline = time.monotonic() + COLDSTART_LOG_TIMEOUT_S
    while time.monotonic() < deadline:
        starts = client.cold_starts_since(MODEL_NAME, sent_wall)
        if starts:
            break
        time.sleep(0.1)
    time.sleep(BURST_SETTLE_S)
    starts = client.cold_starts_since(MODEL_NAME, sent_wall)
    ttfts = [r["ttft_s"] for r in ok]
    return {
        "n": n,
        "succeeded": len(ok),
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
        "cold_starts": len(starts),
        "errors": [{"index": r["index"], "status": r["status"], "error": r["error"]} for r in results if not r["ok"]],
        "ttft_runs_s": sorted(ttfts),
        "cold_start_sources": [e.get("source") for e in starts],
        "wall_s": wall,
        "max_tokens": BURST_MAX_TOKENS,
    }


def _proc_stats() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds used: utime + stime) of every process, from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        out[int(d.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    return out


def cpu_seconds(cluster: LocalCluster) -> dict[str, float]:
    """CPU time (user + system) used so far by each process of the cluster and its live
    descendants (the engine runs its instances in worker processes), from /proc."""
    stats = _proc_stats()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out = {}
    for name, proc in cluster.procs.items():
        if not proc.alive() or proc.pid not in stats:
            continue
        total, todo = 0.0, [proc.pid]
        while todo:
            pid = todo.pop()
            total += stats[pid][1]
            todo.extend(children.get(pid, ()))
        out[name] = total
    return out


def quiesce(cluster: LocalCluster, timeout_s: float = 30.0) -> None:
    """Wait until the engine has its pre-warmed worker, the loader its cached blob, and the
    bound worker its STEADY tier: the steady state that warm runs measure."""
    from tests.helpers.cluster import metric

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # ... and no worker is still on the START tier (its tier-up would share the cores).
        if (
            metric(cluster, "engine@node-0", "tessera_engine_prewarmed_workers") >= 1
            and metric(cluster, "loader@node-0", "tessera_loader_host_cache_entries") >= 1
            and metric(cluster, "engine@node-0", "tessera_engine_bound_workers", tier="start") == 0
        ):
            return
        time.sleep(0.2)
    log("WARNING: the cluster did not settle before a side-by-side round")


def settle(cluster: LocalCluster, idle_cpu_s: float = 0.02, window_s: float = 0.2, timeout_s: float = 10.0) -> float:
    """Wait until the cluster's processes together use under `idle_cpu_s` of CPU in a
    `window_s` window (an evicted worker's exit, the loader's re-check and the pool's refill
    are done): a scaled-to-zero model's next request finds the node quiet, as the peers'
    starts do. Returns the seconds waited."""
    t0 = time.monotonic()
    before = sum(cpu_seconds(cluster).values())
    while time.monotonic() - t0 < timeout_s:
        time.sleep(window_s)
        now = sum(cpu_seconds(cluster).values())
        if now - before < idle_cpu_s:
            break
        before = now
    else:
        log(f"WARNING: the cluster did not go quiet within {timeout_s}s")
    return time.monotonic() - t0


def cold_trials(
    client: Tessera,
    trials: int,
    what: str,
    expect: str,
    evict: str | None = None,
    tier: str = "resident",
    cluster: LocalCluster | None = None,
) -> list[dict[str, Any]]:
    """Cold starts from zero; with `evict` (an artifact id), the caches down to `tier` are
    dropped after each scale to zero (`resident`: the start stages the blob from the host
    cache; `all`: it reads the model store from disk). A start whose `source` is not `expect`
    is logged (and kept: its source is in the result)."""
    out: list[dict[str, Any]] = []
    for i in range(trials):
        waited = client.wait_zero()
        evicted = client.evict(evict, tier) if evict else None
        settled = settle(cluster) if cluster is not None else 0.0
        res = client.stream(COLD_MAX_TOKENS)
        entry = client.cold_start_after(MODEL_NAME, res["sent_wall"])
        if entry.get("source") != expect:
            log(f"WARNING: {what} trial {i + 1}: source {entry.get('source')!r}, expected {expect!r}")
        out.append(
            {
                "ttft_s": res["ttft_s"],
                "waited_for_zero_s": waited,
                "evicted": evicted,
                "settled_s": settled,
                "record": entry,
                "text": res["text"],
            }
        )
        log(
            f"{what} trial {i + 1}/{trials}: ttft {res['ttft_s']:.3f}s, engine total "
            f"{entry['total_s']:.3f}s, source {entry.get('source')}, from cache "
            f"{entry.get('loaded_from_cache')}, phases "
            + ", ".join(f"{p} {entry['phases'][f'{p}_s']:.3f}" for p in PHASES)
        )
    return out


def summarize_cold(cold: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "ttft_s": median([c["ttft_s"] for c in cold]),
        "ttft_trials_s": [c["ttft_s"] for c in cold],
        "engine_total_trials_s": [c["record"]["total_s"] for c in cold],
        "phases": {p: median([c["record"]["phases"][f"{p}_s"] for c in cold]) for p in PHASES},
        "phase_trials": [{p: c["record"]["phases"][f"{p}_s"] for p in PHASES} for c in cold],
        # Outside the engine's clock: gateway, scheduler, bus and HTTP, per trial.
        "overhead_trials_s": [c["ttft_s"] - c["record"]["total_s"] for c in cold],
        "waited_for_zero_s": [c["waited_for_zero_s"] for c in cold],
        "sources": [c["record"].get("source") for c in cold],
        "loaded_from_cache": [c["record"].get("loaded_from_cache") for c in cold],
        # Load = asking the loader for the blob (a hit verifies its blocks) + the worker's import.
        "stage_s": median([c["record"].get("stage_s", 0.0) for c in cold]),
        "worker_load_s": median([c["record"].get("worker_load_s", 0.0) for c in cold]),
        "tiers": [c["record"].get("tier") for c in cold],
    }


def bench_tessera(trials: int, warm_runs: int, decode_runs_n: int = 3) -> dict[str, Any]:
    gguf = default_model_path()
    with tempfile.TemporaryDirectory(prefix="tessera-bench-") as home:
        cluster = LocalCluster(home=Path(home), env={"TESSERA_INFERENCE_THREADS": str(THREADS)})
        client: Tessera | None = None
        try:
            t = time.perf_counter()
            cluster.start(timeout_s=120.0)
            log(f"cluster up in {time.perf_counter() - t:.1f}s at {cluster.base_url}")
            t = time.perf_counter()
            reg = cluster.register_default_model(keep_alive_s=KEEP_ALIVE_S, name=MODEL_NAME)
            log(
                f"registered {MODEL_NAME} from {gguf.name} in {time.perf_counter() - t:.1f}s "
                f"(converted={reg.get('converted')}, import_s={reg.get('import_s')})"
            )
            client = Tessera(cluster.base_url)
            artifact_id = str(reg["artifact"]["artifact_id"])  # type: ignore[index]

            # The very first start of the model loads it from the store; it is not one of the
            # trials (which measure a start from zero with the weights still resident).
            first = client.stream(COLD_MAX_TOKENS)
            first_entry = client.cold_start_after(MODEL_NAME, first["sent_wall"])
            log(
                f"first start ({first_entry.get('source')}): ttft {first['ttft_s']:.3f}s, "
                f"engine total {first_entry['total_s']:.3f}s"
            )

            cold = cold_trials(client, trials, "cold (resident)", expect="resident", cluster=cluster)

            client.wait_zero()
            log(f"burst: {BURST_SIZE} concurrent streamed first requests on the model scaled to zero")
            burst_result = burst(client, BURST_SIZE)
            log(
                f"burst: {burst_result['succeeded']}/{BURST_SIZE} ok, ttft p50 "
                f"{burst_result['ttft_p50_s']}, p99 {burst_result['ttft_p99_s']}, "
                f"{burst_result['cold_starts']} cold start(s) {burst_result['cold_start_sources']}, "
                f"errors {burst_result['errors']}"
            )

            host = cold_trials(
                client,
                trials,
                "cold (worker evicted, host cache)",
                expect="host",
                evict=artifact_id,
                tier="resident",
                cluster=cluster,
            )
            disk = cold_trials(
                client,
                trials,
                "cold (all caches dropped, from disk)",
                expect="store",
                evict=artifact_id,
                tier="all",
                cluster=cluster,
            )

            # Warm: one request loads it (discarded), then back-to-back requests on the live
            # instance, once its worker has tiered up (a warm instance's steady state).
            client.stream(COLD_MAX_TOKENS)
            quiesce(cluster)
            client.stream(COLD_MAX_TOKENS)  # in case it scaled to zero meanwhile
            records_before = len(client.cold_starts())
            warm = [client.stream(COLD_MAX_TOKENS)["ttft_s"] for _ in range(warm_runs)]
            # Decode: the median of `peer_runs` requests, as the peers' decode is a median too
            # (one 128-token request swings ±15 % on this machine).
            decode_runs = []
            for _ in range(max(1, decode_runs_n)):
                cpu_before = cpu_seconds(cluster)
                dec = client.stream(DECODE_TOKENS, ignore_eos=True)
                cpu_after = cpu_seconds(cluster)
                span = dec["last"] - dec["first"]
                n_done = int((dec["usage"] or {}).get("completion_tokens", 0))
                if n_done >= 2 and span > 0:
                    decode_runs.append((n_done - 1) / span)
            # Where the CPU went during the decode request: on 2 cores, whatever the services
            # use besides the engine's inference threads is taken from them.
            decode_cpu = {k: round(cpu_after[k] - v, 3) for k, v in cpu_before.items() if k in cpu_after}
            records_after = len(client.cold_starts())
            log(f"warm ttft {[round(w, 4) for w in warm]}")
            if records_after != records_before:
                log(f"WARNING: {records_after - records_before} cold start(s) during the warm runs")
            usage = dec["usage"] or {}
            completion = int(usage.get("completion_tokens", 0))
            if not decode_runs:
                raise RuntimeError(f"decode runs too short to time: usage={usage}")
            decode = median(decode_runs)
            log(f"decode: {completion} tokens, {decode:.1f} tok/s over {span:.2f}s; CPU s {decode_cpu}")

            # Side by side: this machine's speed drifts by ±30 % over minutes, so the stack's
            # warm TTFT and decode are compared with the in-process pipeline in alternating
            # rounds, the peer in a fresh process on the same converted model, the cluster idle.
            side = []
            for i in range(max(1, decode_runs_n)):
                # Steady state: a replacement worker warming or the host cache filling after the
                # previous round's starts would share the cores with the runs below.
                quiesce(cluster)
                client.stream(COLD_MAX_TOKENS)  # a resident start if it scaled to zero
                t_warm = median([client.stream(COLD_MAX_TOKENS)["ttft_s"] for _ in range(warm_runs)])
                d = client.stream(DECODE_TOKENS, ignore_eos=True)
                n_done = int((d["usage"] or {}).get("completion_tokens", 0))
                t_dec = (n_done - 1) / (d["last"] - d["first"])
                peer = run_peer("openvino", Path(str(reg["artifact"]["path"])))  # type: ignore[index]
                llama_round = run_peer("llamacpp", gguf)
                (h,) = cold_trials(
                    client, 1, "side-by-side host", "host", evict=artifact_id, tier="resident", cluster=cluster
                )
                (k,) = cold_trials(
                    client, 1, "side-by-side disk", "store", evict=artifact_id, tier="all", cluster=cluster
                )
                side.append(
                    {
                        "tessera_warm_ttft_s": t_warm,
                        "inproc_warm_ttft_s": peer["warm_ttft_s"],
                        "tessera_decode_tok_s": t_dec,
                        "inproc_decode_tok_s": peer["decode_tok_s"],
                        "tessera_host_ttft_s": h["ttft_s"],
                        "tessera_disk_ttft_s": k["ttft_s"],
                        "llamacpp_cold_ttft_s": llama_round["cold_ttft_s"],
                    }
                )
                log(
                    f"side by side {i + 1}: warm {t_warm:.4f} vs {peer['warm_ttft_s']:.4f} s, "
                    f"decode {t_dec:.1f} vs {peer['decode_tok_s']:.1f} tok/s"
                )
        finally:
            if client is not None:
                client.close()
            cluster.stop()

    c, h, d = summarize_cold(cold), summarize_cold(host), summarize_cold(disk)
    return {
        "cold_ttft_s": c["ttft_s"],
        "cold_ttft_trials_s": c["ttft_trials_s"],
        "engine_total_trials_s": c["engine_total_trials_s"],
        "phases": c["phases"],
        "phase_trials": c["phase_trials"],
        "overhead_trials_s": c["overhead_trials_s"],
        "waited_for_zero_s": c["waited_for_zero_s"],
        "cold_sources": c["sources"],
        "cold_loaded_from_cache": c["loaded_from_cache"],
        "host": h,
        "host_evictions": [x["evicted"] for x in host],
        "disk": d,
        "disk_evictions": [x["evicted"] for x in disk],
        "first_start": {
            "ttft_s": first["ttft_s"],
            "engine_total_s": first_entry["total_s"],
            "source": first_entry.get("source"),
            "loaded_from_cache": first_entry.get("loaded_from_cache"),
            "phases": {p: first_entry["phases"][f"{p}_s"] for p in PHASES},
        },
        "burst": burst_result,
        "warm_ttft_s": median(warm),
        "warm_ttft_runs_s": warm,
        "cold_starts_during_warm": records_after - records_before,
        "decode_tok_s": decode,
        "decode_runs_tok_s": decode_runs,
        "side_by_side": {
            "rounds": side,
            "warm_ttft_ratio": median([r["tessera_warm_ttft_s"] / r["inproc_warm_ttft_s"] for r in side]),
            "decode_ratio": median([r["tessera_decode_tok_s"] / r["inproc_decode_tok_s"] for r in side]),
            "host_ratio_vs_llamacpp": median([r["tessera_host_ttft_s"] / r["llamacpp_cold_ttft_s"] for r in side]),
            "disk_ratio_vs_llamacpp": median([r["tessera_disk_ttft_s"] / r["llamacpp_cold_ttft_s"] for r in side]),
        },
        "decode_completion_tokens": completion,
        "decode_cpu_s": decode_cpu,
        "decode_wall_s": dec["last"] - dec["first"] + dec["ttft_s"],
        "sample": cold[0]["text"] if cold else "",
        "registration": {"converted": reg.get("converted"), "import_s": reg.get("import_s")},
    }


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


# --- targets -------------------------------------------------------------------------------------


def targets(
    t_cold: float,
    t_host: float,
    t_disk: float,
    l_cold: float,
    o_cold: float,
    warm_ratio: float,
    decode_ratio: float,
    side_host: float,
    side_disk: float,
) -> dict[str, dict[str, Any]]:
    """Each ratio with its target (and stretch target, where there is one) and whether it is met.
    The warm TTFT and decode ratios are the side-by-side (interleaved) ones."""

    def at_most(value: float, target: float, stretch: float | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"value": value, "target": f"<= {target}", "pass": value <= target}
        if stretch is not None:
            out |= {"stretch": f"<= {stretch}", "stretch_pass": value <= stretch}
        return out

    def at_least(value: float, target: float) -> dict[str, Any]:
        return {"value": value, "target": f">= {target}", "pass": value >= target}

    # The issue's `tessera_cold_ttft_s` is the host-cache hit; scaled to zero with the weights
    # still resident in a worker is a tier above it, reported beside.
    return {
        "cold_ttft_ratio_vs_llamacpp": at_most(t_host / l_cold, 1.0, stretch=0.5),
        "naive_over_tessera_cold": at_least(o_cold / t_host, 10.0),
        "resident_ratio_vs_llamacpp": at_most(t_cold / l_cold, 1.0, stretch=0.5),
        "disk_ratio_vs_llamacpp": at_most(t_disk / l_cold, 2.0),
        "host_ratio_vs_llamacpp_side_by_side": at_most(side_host, 1.0, stretch=0.5),
        "disk_ratio_vs_llamacpp_side_by_side": at_most(side_disk, 2.0),
        "warm_ttft_ratio_vs_inproc": at_most(warm_ratio, 1.2),
        "decode_ratio_vs_inproc": at_least(decode_ratio, 0.9),
    }


# --- plot ----------------------------------------------------------------------------------------


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Each bar is the breakdown of the median run itself, so its segments add up to the median
    # total (medians of the phases taken one by one need not).
    def tessera_parts(trials: list[float], phase_trials: list[dict[str, float]]) -> list[tuple[str, float]]:
        i = median_index(trials)
        tp = phase_trials[i]
        overhead = trials[i] - sum(tp.values())
        return [
            ("init", tp["init"]),
            ("load", tp["load"]),
            ("profile", tp["profile"]),
            ("prefill", tp["prefill"]),
            ("stack overhead", max(0.0, overhead)),
        ]

    lp = result["llamacpp_phase_runs"][median_index(result["llamacpp_cold_ttft_runs_s"])]
    op = result["openvino_naive_phase_runs"][median_index(result["openvino_naive_cold_ttft_runs_s"])]
    systems = [
        (
            "Tessera, scaled to zero\n(weights resident)",
            result["tessera_cold_resident_ttft_s"],
            tessera_parts(result["tessera_cold_resident_ttft_trials_s"], result["tessera_resident_phase_trials_s"]),
        ),
        (
            "Tessera, worker evicted\n(host-cache hit)",
            result["tessera_cold_host_ttft_s"],
            tessera_parts(result["tessera_cold_host_ttft_trials_s"], result["tessera_host_phase_trials_s"]),
        ),
        (
            "Tessera, all caches dropped\n(from disk)",
            result["tessera_cold_disk_ttft_s"],
            tessera_parts(result["tessera_cold_disk_ttft_trials_s"], result["tessera_disk_phase_trials_s"]),
        ),
        (
            "llama.cpp (new process)",
            result["llamacpp_cold_ttft_s"],
            [("import", lp["import_s"]), ("load", lp["load_s"]), ("first token", lp["first_token_s"])],
        ),
        (
            "OpenVINO on the GGUF\n(new process, converts at load)",
            result["openvino_naive_cold_ttft_s"],
            [("import", op["import_s"]), ("load", op["load_s"]), ("first token", op["first_token_s"])],
        ),
    ]
    colors = {
        "init": "#9ecae1",
        "import": "#9ecae1",
        "load": "#3182bd",
        "profile": "#fdae6b",
        "prefill": "#31a354",
        "first token": "#31a354",
        "stack overhead": "#bdbdbd",
    }
    labels = {
        "prefill": "prefill / first token",
        "first token": "prefill / first token",
        "init": "init / import",
        "import": "init / import",
    }

    fig, ax = plt.subplots(figsize=(10, 5.8))
    seen: set[str] = set()
    longest = max(total for _, total, _ in systems)
    for y, (_name, total, parts) in enumerate(systems):
        left = 0.0
        for phase, secs in parts:
            label = labels.get(phase, phase)
            ax.barh(
                y,
                secs,
                left=left,
                color=colors[phase],
                edgecolor="white",
                height=0.6,
                label=None if label in seen else label,
            )
            seen.add(label)
            left += secs
        ax.text(max(left, total) + longest * 0.01, y, f"{total:.2f} s", va="center", fontsize=10)
    ax.set_yticks(range(len(systems)), [s[0] for s in systems])
    ax.invert_yaxis()
    ax.set_xlim(0, longest * 1.15)
    ax.set_xlabel("seconds from request (or process start) to first token, median")
    ax.set_title(f"Cold start to first token, SmolLM2-135M-Instruct Q4_1, CPU, {THREADS} threads")
    ax.grid(axis="x", alpha=0.3)
    fig.legend(loc="lower center", ncol=5, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=130)
    plt.close(fig)


# --- main ----------------------------------------------------------------------------------------


def source_results(source: str, run: dict[str, Any], evictions: Any) -> dict[str, Any]:
    """The results of the cold starts from one source (`host`: the host cache, `disk`: the
    store on disk), under their keys in the results file."""
    return {
        f"tessera_cold_{source}_ttft_s": run["ttft_s"],
        f"tessera_cold_{source}_ttft_trials_s": run["ttft_trials_s"],
        f"tessera_cold_{source}_sources": run["sources"],
        f"tessera_cold_{source}_loaded_from_cache": run["loaded_from_cache"],
        f"tessera_{source}_phases": run["phases"],
        f"tessera_{source}_stage_s": run["stage_s"],
        f"tessera_{source}_worker_load_s": run["worker_load_s"],
        f"tessera_{source}_tiers": run["tiers"],
        f"tessera_{source}_phase_trials_s": run["phase_trials"],
        f"tessera_{source}_stack_overhead_s": median(run["overhead_trials_s"]),
        f"tessera_{source}_stack_overhead_trials_s": run["overhead_trials_s"],
        f"tessera_{source}_engine_cold_total_trials_s": run["engine_total_trials_s"],
        f"tessera_{source}_evictions": evictions,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5, help="cold trials on Tessera (median; >= 5 advised)")
    ap.add_argument("--warm-runs", type=int, default=5, help="back-to-back warm requests on Tessera")
    ap.add_argument("--peer-runs", type=int, default=3, help="fresh-process runs of each peer")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    if args.trials < 1 or args.warm_runs < 1 or args.peer_runs < 1:
        ap.error("--trials, --warm-runs and --peer-runs must be at least 1")

    gguf = default_model_path()
    load_before = os.getloadavg()
    started = time.perf_counter()
    log(f"model {gguf}")

    tessera = bench_tessera(args.trials, args.warm_runs, args.peer_runs)
    llama = bench_peer("llamacpp", args.peer_runs, gguf)
    ov = bench_peer("openvino", args.peer_runs, gguf)

    t_cold = tessera["cold_ttft_s"]
    t_host = tessera["host"]["ttft_s"]
    t_disk = tessera["disk"]["ttft_s"]
    l_cold = median([r["cold_ttft_s"] for r in llama])
    o_cold = median([r["cold_ttft_s"] for r in ov])
    o_warm = median([r["warm_ttft_s"] for r in ov])
    o_decode = median([r["decode_tok_s"] for r in ov])
    result: dict[str, Any] = {
        "model": gguf.name,
        "tessera_cold_ttft_s": t_host,
        "tessera_cold_resident_ttft_s": t_cold,
        "tessera_cold_resident_ttft_trials_s": tessera["cold_ttft_trials_s"],
        "tessera_cold_resident_sources": tessera["cold_sources"],
        "tessera_cold_resident_loaded_from_cache": tessera["cold_loaded_from_cache"],
        "tessera_resident_phases": tessera["phases"],
        "tessera_resident_phase_trials_s": tessera["phase_trials"],
        "tessera_resident_stack_overhead_s": median(tessera["overhead_trials_s"]),
        "tessera_resident_stack_overhead_trials_s": tessera["overhead_trials_s"],
        "tessera_resident_engine_cold_total_trials_s": tessera["engine_total_trials_s"],
        **source_results("host", tessera["host"], tessera["host_evictions"]),
        **source_results("disk", tessera["disk"], tessera["disk_evictions"]),
        "tessera_first_start": tessera["first_start"],
        "burst": tessera["burst"],
        "tessera_warm_ttft_s": tessera["warm_ttft_s"],
        "tessera_warm_ttft_runs_s": tessera["warm_ttft_runs_s"],
        "tessera_cold_starts_during_warm": tessera["cold_starts_during_warm"],
        "tessera_decode_tok_s": tessera["decode_tok_s"],
        "tessera_decode_runs_tok_s": tessera["decode_runs_tok_s"],
        "tessera_decode_completion_tokens": tessera["decode_completion_tokens"],
        "tessera_decode_cpu_s_by_process": tessera["decode_cpu_s"],
        "tessera_decode_request_wall_s": tessera["decode_wall_s"],
        "tessera_waited_for_zero_s": tessera["waited_for_zero_s"],
        "tessera_registration": tessera["registration"],
        "llamacpp_cold_ttft_s": l_cold,
        "llamacpp_cold_ttft_runs_s": [r["cold_ttft_s"] for r in llama],
        "llamacpp_phases": median_phases(llama),
        "llamacpp_phase_runs": [r["phases"] for r in llama],
        "llamacpp_decode_tok_s": median([r["decode_tok_s"] for r in llama]),
        "llamacpp_decode_runs_tok_s": [r["decode_tok_s"] for r in llama],
        "openvino_naive_cold_ttft_s": o_cold,
        "openvino_naive_cold_ttft_runs_s": [r["cold_ttft_s"] for r in ov],
        "openvino_naive_phases": median_phases(ov),
        "openvino_naive_phase_runs": [r["phases"] for r in ov],
        "openvino_inproc_ttft_runs_s": [r["warm_ttft_s"] for r in ov],
        "openvino_inproc_ttft_s": o_warm,
        "openvino_inproc_decode_tok_s": o_decode,
        "openvino_inproc_decode_runs_tok_s": [r["decode_tok_s"] for r in ov],
        "cold_ttft_ratio_vs_llamacpp": t_host / l_cold,
        "naive_over_tessera_cold": o_cold / t_host,
        "resident_ratio_vs_llamacpp": t_cold / l_cold,
        "disk_ratio_vs_llamacpp": t_disk / l_cold,
        "warm_ttft_ratio_vs_inproc": tessera["side_by_side"]["warm_ttft_ratio"],
        "decode_ratio_vs_inproc": tessera["side_by_side"]["decode_ratio"],
        "sequential_warm_ttft_ratio_vs_inproc": tessera["warm_ttft_s"] / o_warm,
        "sequential_decode_ratio_vs_inproc": tessera["decode_tok_s"] / o_decode,
        "side_by_side": tessera["side_by_side"],
        "targets": targets(
            t_cold,
            t_host,
            t_disk,
            l_cold,
            o_cold,
            tessera["side_by_side"]["warm_ttft_ratio"],
            tessera["side_by_side"]["decode_ratio"],
            tessera["side_by_side"]["host_ratio_vs_llamacpp"],
            tessera["side_by_side"]["disk_ratio_vs_llamacpp"],
        ),
        "samples": {"tessera": tessera["sample"], "llamacpp": llama[0]["sample"], "openvino": ov[0]["sample"]},
        "versions": {"llama_cpp_python": llama[0]["version"], "openvino_genai": ov[0]["version"]},
        "threads": THREADS,
        "trials": args.trials,
        "peer_runs": args.peer_runs,
        "machine": machine_info(load_before),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "bench_wall_s": time.perf_counter() - started,
    }

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "coldstart.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, args.out / "coldstart.png")
    log(f"wrote {args.out / 'coldstart.json'} and {args.out / 'coldstart.png'}")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
