"""No-stall benchmark: model A's per-token time while model B cold-starts on the same node.

    python -m bench.nostall [--reps 3] [--shares 0.5,1.0] [--out bench/results]

For each `TESSERA_START_CPU_SHARE` (0.5: a start may use 1 of the 2 cores while another
instance generates; 1.0: no bound), a fresh `LocalCluster` in a temporary home (the model
store is shared between the clusters, so each GGUF is converted once) with
`TESSERA_STREAM_INTERVAL_S=0` (about one SSE chunk per token):

1. Register A (the default SmolLM2 GGUF, keep-alive 600 s, TPOT SLO 0.1 s) and B (a byte
   variant of the same GGUF: a different artifact, a stand-in for a fine-tune; keep-alive
   1 s). Warm A; start B once, let it scale to zero, evict B's caches (`tier=all`), so that
   B's next start reads its compiled model from disk.
2. Baseline: stream A alone (300 tokens, `ignore_eos`); the gaps between consecutive content
   chunks are A's per-token times.
3. Contended: stream A (600 tokens); after its 40th chunk, send B's first request (streamed,
   4 tokens) and time its TTFT. A's gaps whose chunk arrived in [B sent, B's first token]
   are "during B's start".

Steps 2-3 are repeated `--reps` times (B scaled to zero and evicted before each). Prints one
JSON object and writes `<out>/nostall.json` and `<out>/nostall.png`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/nostall.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.common import (
    PHASES,
    REQUEST_TIMEOUT_S,
    THREADS,
    TesseraClient,
    chat_body,
    machine_info,
    make_log,
    median,
    median_index,
    percentile,
    stream_chat,
)
from ops.localcluster import REPO_ROOT, LocalCluster, default_model_path

A_NAME = "nostall-a"
B_NAME = "nostall-b"
A_KEEP_ALIVE_S = 600.0
B_KEEP_ALIVE_S = 1.0
A_TPOT_SLO_S = 0.1
PROMPT = "Tell a long story about a lighthouse keeper and the ships she guides."
B_PROMPT = "Say hello."
BASELINE_TOKENS = 300
CONTENDED_TOKENS = 600
B_TOKENS = 4
TRIGGER_CHUNKS = 40
VARIANT_SUFFIX = b"tessera-variant"

CLUSTER_START_TIMEOUT_S = 120.0
REGISTER_TIMEOUT_S = 600.0
TRIGGER_TIMEOUT_S = 60.0
QUIET_TIMEOUT_S = 30.0
QUIET_BUSY = 0.15
"""The node counts as quiet when its CPUs are busy less than this share over 0.5 s."""


log = make_log("nostall")


def _cpu_times() -> tuple[float, float]:
    with open("/proc/stat") as f:
        fields = [float(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields), idle


def wait_quiet(timeout_s: float = QUIET_TIMEOUT_S) -> float:
    """Wait (bounded) until the machine is nearly idle: the engine's pool refill (a new worker
    imports the runtime) and the loader's host-cache fill after a start run in the background.
    Returns the busy share of the last 0.5 s window."""
    deadline = time.monotonic() + timeout_s
    busy = 1.0
    while time.monotonic() < deadline:
        t0, i0 = _cpu_times()
        time.sleep(0.5)
        t1, i1 = _cpu_times()
        busy = 1.0 - (i1 - i0) / max(t1 - t0, 1e-9)
        if busy < QUIET_BUSY:
            return busy
    log(f"WARNING: machine still {busy:.0%} busy after {timeout_s}s; going on")
    return busy


# --- client --------------------------------------------------------------------------------------


class Client(TesseraClient):
    """The client, with registration and the eviction of B's caches."""

    def register(self, name: str, source: Path, keep_alive_s: float) -> dict[str, Any]:
        r = self.http.post(
            "/admin/models",
            timeout=REGISTER_TIMEOUT_S,
            json={
                "name": name,
                "source": str(source),
                "keep_alive_s": keep_alive_s,
                "tpot_slo_s": A_TPOT_SLO_S,
            },
        )
        if r.status_code != 201:
            raise RuntimeError(f"registering {name}: HTTP {r.status_code}: {r.text[:500]}")
        return dict(r.json())

    def evict(self, artifact_id: str) -> dict[str, Any]:
        """`POST /admin/cache/evict?tier=all` for B's artifact until its resident copy is among
        those dropped (right after scale-to-zero the engine may still be releasing it)."""
        answers, evict_s = self.evict_until(artifact_id, {"tier": "all", "artifact_id": artifact_id})
        return {
            "calls": len(answers),
            "evict_s": evict_s,
            "freed_bytes": sum(int(e.get("freed_bytes", 0)) for e in answers[-1]),
        }


def stream(
    http: httpx.Client, model: str, prompt: str, max_tokens: int, ignore_eos: bool, on_chunk: Any = None
) -> dict[str, Any]:
    """One streamed chat request: perf_counter arrival time of every content chunk."""
    res = stream_chat(http, chat_body(model, prompt, max_tokens, ignore_eos), on_chunk, label=model)
    sent, arrivals = res["sent"], res["arrivals"]
    return {
        "sent": sent,
        "sent_wall": res["sent_wall"],
        "arrivals": arrivals,
        "ttft_s": arrivals[0] - sent,
        "completion_tokens": int((res["usage"] or {}).get("completion_tokens", 0)),
    }


def gap_stats(gaps: list[float], prefix: str) -> dict[str, Any]:
    if not gaps:
        return {f"{prefix}_p50_s": None, f"{prefix}_p99_s": None, f"{prefix}_max_s": None}
    return {
        f"{prefix}_p50_s": percentile(gaps, 50),
        f"{prefix}_p99_s": percentile(gaps, 99),
        f"{prefix}_max_s": max(gaps),
    }


# --- one repetition ------------------------------------------------------------------------------


def contended(client: Client) -> dict[str, Any]:
    """Stream A; after its TRIGGER_CHUNKS-th chunk, send B's first (cold) request."""
    triggered = threading.Event()
    out: dict[str, Any] = {}

    def on_chunk(n: int) -> None:
        if n >= TRIGGER_CHUNKS:
            triggered.set()

    def run_a() -> None:
        try:
            with httpx.Client(base_url=client.base_url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as http:
                out["a"] = stream(http, A_NAME, PROMPT, CONTENDED_TOKENS, True, on_chunk)
        except (httpx.HTTPError, RuntimeError, ValueError) as e:  # reported on the main thread
            out["error"] = e
        finally:
            triggered.set()

    thread = threading.Thread(target=run_a, name="stream-a", daemon=True)
    thread.start()
    if not triggered.wait(TRIGGER_TIMEOUT_S):
        raise TimeoutError(f"A produced fewer than {TRIGGER_CHUNKS} chunks in {TRIGGER_TIMEOUT_S}s")
    if "error" in out:
        raise RuntimeError(f"A's stream failed: {out['error']!r}")
    b = stream(client.http, B_NAME, B_PROMPT, B_TOKENS, False)
    thread.join(REQUEST_TIMEOUT_S)
    if thread.is_alive():
        raise TimeoutError(f"A's stream did not end within {REQUEST_TIMEOUT_S}s")
    if "a" not in out:
        raise RuntimeError(f"A's stream failed: {out.get('error')!r}")
    return {"a": out["a"], "b": b}


def repetition(client: Client, b_artifact: str) -> dict[str, Any]:
    waited = client.wait_scaled_to_zero(B_NAME)
    evicted = client.evict(b_artifact)
    quiet = wait_quiet()

    base = stream(client.http, A_NAME, PROMPT, BASELINE_TOKENS, True)
    t = base["arrivals"]
    base_gaps = [t[i] - t[i - 1] for i in range(1, len(t))]

    wait_quiet()
    run = contended(client)
    a, b = run["a"], run["b"]
    record = client.cold_start_after(B_NAME, b["sent_wall"])
    b_sent, b_first = b["sent"], b["arrivals"][0]
    t = a["arrivals"]
    during = [t[i] - t[i - 1] for i in range(1, len(t)) if b_sent <= t[i] <= b_first]
    before = [t[i] - t[i - 1] for i in range(1, len(t)) if t[i] < b_sent]
    after = [t[i] - t[i - 1] for i in range(1, len(t)) if t[i] > b_first]
    rep: dict[str, Any] = {
        **gap_stats(base_gaps, "a_tpot_baseline"),
        **gap_stats(during, "a_tpot_during_start"),
        **gap_stats(before, "a_tpot_before_start"),
        **gap_stats(after, "a_tpot_after_start"),
        "a_chunks_during_start": len(during),
        "a_gaps_over_slo_during_start": sum(g > A_TPOT_SLO_S for g in during),
        "a_gaps_over_slo_after_start": sum(g > A_TPOT_SLO_S for g in after),
        "a_outlived_start": t[-1] > b_first,
        "b_cold_ttft_s": b["ttft_s"],
        "b_start_interval_s": b_first - b_sent,
        "b_coldstart": {
            "source": record.get("source"),
            "total_s": record.get("total_s"),
            "loaded_from_cache": record.get("loaded_from_cache"),
            "stage_s": record.get("stage_s"),
            "worker_load_s": record.get("worker_load_s"),
            "phases": {p: record["phases"].get(f"{p}_s") for p in PHASES},
        },
        "baseline_chunks": len(base["arrivals"]),
        "baseline_completion_tokens": base["completion_tokens"],
        "contended_chunks": len(t),
        "contended_completion_tokens": a["completion_tokens"],
        "b_waited_for_zero_s": waited,
        "b_evicted": evicted,
        "busy_before": quiet,
        # For the plot: A's gaps on A's clock (0 = A's request sent), and B's start interval.
        "_series": {
            "t_s": [round(x - a["sent"], 5) for x in t[1:]],
            "gap_s": [round(t[i] - t[i - 1], 5) for i in range(1, len(t))],
            "b_start_s": round(b_sent - a["sent"], 5),
            "b_first_s": round(b_first - a["sent"], 5),
        },
    }
    p50b, p50d = rep["a_tpot_baseline_p50_s"], rep["a_tpot_during_start_p50_s"]
    rep["a_slowdown_p50"] = p50d / p50b if p50d is not None and p50b else None
    p99d = rep["a_tpot_during_start_p99_s"]
    rep["a_slo_met_during_start"] = p99d is not None and p99d <= A_TPOT_SLO_S
    if record.get("source") != "store":
        log(f"WARNING: B's start came from {record.get('source')!r}, not 'store'")
    if not rep["a_outlived_start"]:
        log("WARNING: A's stream ended before B's first token")
    return rep


# --- one cluster per share -----------------------------------------------------------------------


def bench_share(share: float, reps: int, store: Path, a_gguf: Path, b_gguf: Path) -> dict[str, Any]:
    env = {
        "TESSERA_INFERENCE_THREADS": str(THREADS),
        "TESSERA_START_CPU_SHARE": str(share),
        "TESSERA_STREAM_INTERVAL_S": "0",
    }
    with tempfile.TemporaryDirectory(prefix="tessera-nostall-") as home:
        cluster = LocalCluster(home=Path(home), env=env, store=store)
        client: Client | None = None
        try:
            t = time.perf_counter()
            cluster.start(timeout_s=CLUSTER_START_TIMEOUT_S)
            log(f"share {share}: cluster up in {time.perf_counter() - t:.1f}s at {cluster.base_url}")
            client = Client(cluster.base_url)
            t = time.perf_counter()
            reg_a = client.register(A_NAME, a_gguf, A_KEEP_ALIVE_S)
            reg_b = client.register(B_NAME, b_gguf, B_KEEP_ALIVE_S)
            b_artifact = str(reg_b["artifact"]["artifact_id"])
            if b_artifact == reg_a["artifact"]["artifact_id"]:
                raise RuntimeError("A and B share one artifact: B would not load anything")
            log(
                f"registered A and B in {time.perf_counter() - t:.1f}s (converted: "
                f"A {reg_a.get('converted')}, B {reg_b.get('converted')})"
            )
            stream(client.http, A_NAME, PROMPT, 8, False)  # A's first start: warm from here on
            stream(client.http, B_NAME, B_PROMPT, B_TOKENS, False)  # B's first start
            runs = []
            for i in range(reps):
                rep = repetition(client, b_artifact)
                runs.append(rep)
                log(
                    f"share {share} rep {i + 1}/{reps}: A tpot baseline p50 "
                    f"{rep['a_tpot_baseline_p50_s'] * 1e3:.1f} ms p99 {rep['a_tpot_baseline_p99_s'] * 1e3:.1f} ms;"
                    f" during B's start ({rep['a_chunks_during_start']} chunks) p50 "
                    f"{(rep['a_tpot_during_start_p50_s'] or 0) * 1e3:.1f} ms p99 "
                    f"{(rep['a_tpot_during_start_p99_s'] or 0) * 1e3:.1f} ms max "
                    f"{(rep['a_tpot_during_start_max_s'] or 0) * 1e3:.1f} ms; after max "
                    f"{(rep['a_tpot_after_start_max_s'] or 0) * 1e3:.1f} ms; B ttft "
                    f"{rep['b_cold_ttft_s']:.3f}s ({rep['b_coldstart']['source']}, phases "
                    + ", ".join(f"{p} {v:.3f}" for p, v in rep["b_coldstart"]["phases"].items())
                    + ")"
                )
        finally:
            if client is not None:
                client.close()
            cluster.stop()
    return {
        "share": share,
        "runs": runs,
        "registration": {
            "a_converted": reg_a.get("converted"),
            "b_converted": reg_b.get("converted"),
            "a_import_s": reg_a.get("import_s"),
            "b_import_s": reg_b.get("import_s"),
            "a_artifact_id": reg_a["artifact"]["artifact_id"],
            "b_artifact_id": b_artifact,
        },
    }


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    runs = res["runs"]

    def med(key: str) -> float | None:
        xs = [r[key] for r in runs if r[key] is not None]
        return median(xs) if xs else None

    keys = (
        "a_tpot_baseline_p50_s",
        "a_tpot_baseline_p99_s",
        "a_tpot_during_start_p50_s",
        "a_tpot_during_start_p99_s",
        "a_tpot_during_start_max_s",
        "a_slowdown_p50",
        "b_cold_ttft_s",
        "a_chunks_during_start",
        "a_tpot_before_start_p50_s",
        "a_tpot_after_start_p50_s",
        "a_tpot_after_start_p99_s",
        "a_tpot_after_start_max_s",
    )
    out: dict[str, Any] = {"start_cpu_share": res["share"]}
    out.update({k: med(k) for k in keys})
    p99 = out["a_tpot_during_start_p99_s"]
    out["a_tpot_slo_s"] = A_TPOT_SLO_S
    out["a_slo_met_during_start"] = p99 is not None and p99 <= A_TPOT_SLO_S
    out["a_slo_met_during_start_reps"] = [r["a_slo_met_during_start"] for r in runs]
    i = median_index([r["b_cold_ttft_s"] for r in runs])
    out["b_coldstart"] = runs[i]["b_coldstart"]  # the start with the median TTFT
    out["b_coldstart_phases_median"] = {p: median([r["b_coldstart"]["phases"][p] for r in runs]) for p in PHASES}
    out["b_coldstart_sources"] = [r["b_coldstart"]["source"] for r in runs]
    out["runs"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in runs]
    out["registration"] = res["registration"]
    return out


# --- plot ----------------------------------------------------------------------------------------


def plot(results: list[dict[str, Any]], path: Path) -> dict[str, Any]:
    """A's per-token gap over time, one contended run per share (the one at the median p99
    during B's start), B's start shaded, the SLO as a line. Returns the plotted series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 3.3 * len(results)), sharex=True, squeeze=False)
    plotted: dict[str, Any] = {}
    for ax, res in zip(axes[:, 0], results, strict=True):
        runs = res["runs"]
        i = median_index([r["a_tpot_during_start_p99_s"] or 0.0 for r in runs])
        s = runs[i]["_series"]
        plotted[str(res["share"])] = {"rep": i + 1, **s}
        ax.axvspan(
            s["b_start_s"],
            s["b_first_s"],
            color="#fdae6b",
            alpha=0.45,
            label=f"B's cold start (sent → first token, {s['b_first_s'] - s['b_start_s']:.2f} s)",
        )
        ax.plot(
            s["t_s"],
            [g * 1e3 for g in s["gap_s"]],
            ".-",
            lw=0.6,
            ms=2.5,
            color="#3182bd",
            label="A: gap between consecutive chunks",
        )
        ax.axhline(
            A_TPOT_SLO_S * 1e3, color="#de2d26", ls="--", lw=1.2, label=f"A's TPOT SLO ({A_TPOT_SLO_S * 1e3:.0f} ms)"
        )
        ax.set_yscale("log")
        ax.set_ylabel("A per-token gap (ms)")
        r = runs[i]
        p99 = r["a_tpot_during_start_p99_s"]
        ax.set_title(
            f"TESSERA_START_CPU_SHARE={res['share']:g} (rep {i + 1}): during B's start p50 "
            f"{(r['a_tpot_during_start_p50_s'] or 0) * 1e3:.1f} ms, p99 {(p99 or 0) * 1e3:.1f} ms; "
            f"baseline p50 {r['a_tpot_baseline_p50_s'] * 1e3:.1f} ms",
            fontsize=10,
        )
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("seconds since A's request was sent")
    fig.suptitle("Model A's decode while model B cold-starts from disk on the same node (2 cores)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return plotted


# --- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="baseline+contended repetitions per share")
    ap.add_argument("--shares", default="0.5,1.0", help="TESSERA_START_CPU_SHARE values, comma-separated")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = ap.parse_args(argv)
    shares = [float(s) for s in args.shares.split(",") if s.strip()]
    if args.reps < 1 or not shares:
        ap.error("--reps must be at least 1 and --shares non-empty")

    a_gguf = default_model_path()
    load_before = os.getloadavg()
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="tessera-nostall-shared-") as tmp:
        # B: the same weights with a few bytes appended, so a different artifact (names on one
        # GGUF share one worker, and B's start would load nothing).
        b_gguf = Path(tmp) / f"{a_gguf.stem}-variant.gguf"
        shutil.copyfile(a_gguf, b_gguf)
        with b_gguf.open("ab") as f:
            f.write(VARIANT_SUFFIX)
        store = Path(tmp) / "store"
        log(f"A {a_gguf}; B {b_gguf} (+{len(VARIANT_SUFFIX)} bytes)")
        for share in shares:
            results.append(bench_share(share, args.reps, store, a_gguf, b_gguf))

    args.out.mkdir(parents=True, exist_ok=True)
    plotted = plot(results, args.out / "nostall.png")
    summary = [summarize(r) for r in results]
    out: dict[str, Any] = {
        "model_a": a_gguf.name,
        "model_b": f"{a_gguf.name} + {VARIANT_SUFFIX!r} appended: a different artifact with the "
        "same weights, a stand-in for a fine-tune of A",
        "by_share": {str(s["start_cpu_share"]): s for s in summary},
        "plot_series": plotted,
        "settings": {
            "start_cpu_shares": shares,
            "reps": args.reps,
            "env": {
                "TESSERA_INFERENCE_THREADS": str(THREADS),
                "TESSERA_STREAM_INTERVAL_S": "0",
                "TESSERA_START_CPU_SHARE": "per share",
            },
            "a": {
                "keep_alive_s": A_KEEP_ALIVE_S,
                "tpot_slo_s": A_TPOT_SLO_S,
                "prompt": PROMPT,
                "baseline_max_tokens": BASELINE_TOKENS,
                "contended_max_tokens": CONTENDED_TOKENS,
                "ignore_eos": True,
                "temperature": 0,
            },
            "b": {
                "keep_alive_s": B_KEEP_ALIVE_S,
                "prompt": B_PROMPT,
                "max_tokens": B_TOKENS,
                "sent_after_a_chunks": TRIGGER_CHUNKS,
                "evict_before_each": "tier=all (B's artifact)",
            },
            "during_start": "A's gaps whose chunk arrived in [B request sent, B first content chunk]",
            "percentiles": "linear between closest ranks",
        },
        "machine": machine_info(load_before),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "bench_wall_s": time.perf_counter() - started,
    }
    (args.out / "nostall.json").write_text(json.dumps(out, indent=2) + "\n")
    log(f"wrote {args.out / 'nostall.json'} and {args.out / 'nostall.png'}")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
