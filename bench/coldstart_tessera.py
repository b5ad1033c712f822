"""Tessera's part of `bench/coldstart.py`: the cluster's CPU time and quiet, cold trials from zero
(weights resident, host cache, disk), then the burst, warm TTFT, decode and the side-by-side rounds
with the peers (`bench_tessera`)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.coldstart_client import (
    BURST_SIZE,
    COLD_MAX_TOKENS,
    DECODE_TOKENS,
    KEEP_ALIVE_S,
    MODEL_NAME,
    Tessera,
    burst,
    log,
)
from bench.coldstart_peers import run_peer
from bench.common import PHASES, THREADS, median
from ops.localcluster import LocalCluster, default_model_path


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
