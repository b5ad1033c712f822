"""The models people bring, at the sizes they run: each form registered and served, and what
materialization costs against a bare llama.cpp start and the engine library in one process.

    python -m bench.models [--sizes smollm2-135m smollm2-1.7b llama3-8b] [--trials 2]
        [--duration 15] [--hf-sizes smollm2-135m smollm2-1.7b] [--out bench/results] [--merge]

Per size (the real SmolLM2-135M, and random-weight models of SmolLM2-1.7B's and Llama-3-8B's
shape with the real tokenizer: `bench/shaped_models.py`), one run, in this order:

1. **Tessera**, a `LocalCluster` with default settings (2 inference threads) in a temporary
   home: the GGUF registered through the admin API (`register_s`: the request's wall time;
   `store_bytes`: the artifact's directory in the store), served once, then
   - pinned warm (`POST /admin/models/{name}/pin`, unpinned after), c=1 decode and c=8
     throughput through the gateway (streamed, 64 greedy tokens, `ignore_eos`; decode tok/s =
     1 / median TPOT), the node's peak booked memory
     (`memory_used_bytes` of its heartbeat, once the node has trued the worker's reservation up
     to what it holds) and the peak RSS of the model's worker (`pool_rss`: the node's other
     engine processes, its pre-warmed worker bound to no model and the step gate's);
   - cold starts from each tier: the model scaled to zero (1 s keep-alive) and then nothing
     dropped (`resident`: is the model still resident on the node when idle?), the resident
     model dropped (`host`: the loader's host cache), every cache dropped (`disk`); each cold
     request streams `COLD_TOKENS` so that its decode after the start is measured too;
   - where asked (`--hf-sizes`), the Hugging Face form of the same weights (and at 135M the
     OpenVINO IR exported from it, as `optimum-cli export openvino` writes one) registered and
     served: its registration time, store size, and whether its greedy text equals the GGUF
     form's.
2. **llama.cpp**: a fresh `llama-server` on the same GGUF, cold start to first token (the file
   in the page cache, as the host tier's is), `--trials` times (`bench/peers.py`); then one
   server for the c=1 and c=8 loads.
3. **OpenVINO GenAI in one process**: its `ContinuousBatchingPipeline` on the IR Tessera
   converted, c=1 and c=8 (`bench/serving_peers.py`, a fresh process per load).

Writes `<out>/models.json` and `<out>/models.png`; prints the JSON, progress on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/models.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import shaped_models
from bench.coldstart_peers import run_peer
from bench.common import TesseraClient, chat_body, machine_info, median, stream_chat
from bench.llama_server import LlamaServer
from bench.serving_http import http_run
from bench.serving_memory import PeakSampler, RssSampler, descendants, rss_bytes
from bench.serving_peers import llama_server_args, run_pipeline
from bench.serving_report import ratio
from bench.serving_runs import MAX_TOKENS, REPO_ROOT, THREADS, log, summarize
from bench.serving_tessera import warm

SIZES = ("smollm2-135m", "smollm2-1.7b", "llama3-8b")
HF_SIZES = ("smollm2-135m", "smollm2-1.7b")
"""Sizes whose Hugging Face form is registered too. Not the 7.2B: its form is made by
transformers' GGUF reader (`shaped_models.hf_form`), which holds every tensor dequantized to f32
at once (29 GB), more than this kind of machine (24 GiB) has."""
LEVELS = (1, 8)
KEEP_ALIVE_S = 1.0
COLD_TOKENS = 32
PROMPT = "Write a short poem about the sea."
TIERS = {"resident": None, "host": "resident", "disk": "all"}
"""Cold-start tier -> what is dropped after the scale to zero (`POST /admin/cache/evict?tier=`)."""
REGISTER_TIMEOUT_S = 3600.0
BOOKED_SAMPLE_S = 0.5
TRUE_UP_SETTLE_S = 5.0


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Client(TesseraClient):
    def register(self, name: str, source: Path) -> tuple[dict[str, Any], float]:
        t0 = time.perf_counter()
        r = self.http.post(
            "/admin/models",
            json={"name": name, "source": str(source), "keep_alive_s": KEEP_ALIVE_S},
            timeout=REGISTER_TIMEOUT_S,
        )
        r.raise_for_status()
        return dict(r.json()), time.perf_counter() - t0

    def node(self) -> dict[str, Any]:
        return dict(self.http.get("/admin/instances", timeout=10).raise_for_status().json()["nodes"][0])

    def greedy(self, model: str, tokens: int) -> dict[str, Any]:
        """One streamed greedy request: TTFT, decode tok/s after the first token, the text.
        Counted in tokens (the usage's), not chunks: a lone stream gets a chunk per stream
        interval (`services/engine/text.py`), so a model faster than that sends several tokens
        a chunk; the first chunk goes at once with the first token, the last with the last."""
        res = stream_chat(self.http, chat_body(model, PROMPT, tokens, ignore_eos=True))
        sent, arrivals = res["sent"], res["arrivals"]
        generated = (res["usage"] or {}).get("completion_tokens", 0)
        decode = (generated - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 and generated > 1 else None
        return {
            "sent_wall": res["sent_wall"],
            "ttft_s": arrivals[0] - sent,
            "decode_tok_s": decode,
            "text": "".join(res["chunks"]),
        }


def loads(
    base_url: str, model: str, duration_s: float, pids: Any, booked: Callable[[], int] | None = None
) -> dict[str, Any]:
    """c=1 and c=8 back-to-back clients (the serving bench's load), the peak RSS of `pids` and,
    where `booked` reads it, the node's peak booked memory."""
    out = {}
    for c in LEVELS:
        with RssSampler(pids) as rss, PeakSampler(booked or (lambda: 0), BOOKED_SAMPLE_S) as peak:
            run = asyncio.run(http_run(base_url, model, c, duration_s))
        run.peak_rss_bytes = rss.peak
        out[str(c)] = {**summarize(run, MAX_TOKENS), **({"peak_booked_bytes": peak.peak} if booked else {})}
        log(f"{model} c={c}: {out[str(c)]['tok_s']:.1f} tok/s, tpot p50 {out[str(c)]['tpot_p50_s']}")
    return out


def model_workers(client: Client) -> Callable[[], list[int]]:
    """The worker pids of the node's instances, read at every call; the last ones seen while
    none runs (between two requests the instance may have scaled to zero, its worker kept)."""
    seen: list[int] = []

    def pids() -> list[int]:
        now = [int(i["worker_pid"]) for i in client.node()["instances"] if i.get("worker_pid")]
        if now:
            seen[:] = now
        return list(seen)

    return pids


def decode_tok_s(level: dict[str, Any]) -> float | None:
    return 1.0 / level["tpot_p50_s"] if level.get("tpot_p50_s") else None


def cold_trials(client: Client, model: str, artifact_id: str, trials: int) -> dict[str, Any]:
    out: dict[str, Any] = {"resident_when_idle": []}
    for tier, drop in TIERS.items():
        runs = []
        for _ in range(trials):
            client.wait_scaled_to_zero(model)
            if tier == "resident":
                out["resident_when_idle"].append(artifact_id in client.node().get("resident", ()))
            if drop and artifact_id in client.node().get("resident", ()):
                client.evict_until(artifact_id, {"tier": drop})
            elif drop:  # not kept resident (a model the node could not hold idle): the caches below
                client.http.post("/admin/cache/evict", params={"tier": drop}, timeout=30).raise_for_status()
            res = client.greedy(model, COLD_TOKENS)
            record = client.cold_start_after(model, res["sent_wall"])
            runs.append({"ttft_s": res["ttft_s"], "decode_tok_s": res["decode_tok_s"], "source": record.get("source")})
            log(
                f"{model} cold from {tier}: ttft {res['ttft_s']:.2f}s, source {record.get('source')}, "
                f"decode after it {res['decode_tok_s']}"
            )
        out[tier] = runs
    return out


def tessera(size: str, gguf: Path, home: Path, args: argparse.Namespace) -> dict[str, Any]:
    from ops.localcluster import LocalCluster

    cluster = LocalCluster(home=home / "home", store=home / "store", env={"TESSERA_INFERENCE_THREADS": str(THREADS)})
    cluster.start(timeout_s=120.0)
    client = Client(cluster.base_url)
    client.http.headers.update(cluster.admin_headers)
    try:
        name = f"{size}-gguf"
        reg, register_s = client.register(name, gguf)
        artifact = reg["artifact"]
        log(f"{name} registered in {register_s:.1f}s")
        first = client.greedy(name, COLD_TOKENS)
        # Kept warm through the loads, as an operator would a model in use: with its 1 s
        # keep-alive (for the cold trials) it scaled to zero in the settling below, and each
        # level opened on a cold start (at 1.7B, c=8's TTFT was 2.4 s against the pipeline's 0.6).
        client.http.post(f"/admin/models/{name}/pin", json={}, timeout=30).raise_for_status()
        engine_pid = cluster.procs["engine@node-0"].pid
        while client.node()["instances"] and client.node()["instances"][0].get("tier") != "steady":
            time.sleep(0.2)  # sync-ok: the steady state is what the loads compare
        # The node trues a worker's reservation up to what it holds every 2 s: the loads'
        # booking is then the settled one, not the start's first guess.
        time.sleep(TRUE_UP_SETTLE_S)  # sync-ok: a measurement's settling time, not a sync
        # The model's memory is its worker's: the pool's pre-warmed worker (bound to no model,
        # there for the next start) and the step gate's process are the node's, apart.
        workers = model_workers(client)
        levels = loads(cluster.base_url, name, args.duration, workers, lambda: int(client.node()["memory_used_bytes"]))
        held = set(workers())  # one read of the instances, not one a process
        pool_rss = sum(rss_bytes(p) for p in descendants(engine_pid) if p not in held)
        booked = max(level["peak_booked_bytes"] for level in levels.values())
        client.http.post(f"/admin/models/{name}/unpin", timeout=30).raise_for_status()
        cold = cold_trials(client, name, artifact["artifact_id"], args.trials)
        forms = {
            "gguf": {"register_s": register_s, "store_bytes": dir_bytes(Path(artifact["path"])), "text": first["text"]}
        }
        if size in args.hf_sizes:
            forms.update(other_forms(client, size, first["text"], home))
        return {
            "artifact": artifact,
            "register_s": register_s,
            "first": first,
            "booked_bytes": booked,
            "pool_rss_bytes": pool_rss,
            "levels": levels,
            "cold": cold,
            "forms": forms,
        }
    finally:
        client.close()
        cluster.stop()


def other_forms(client: Client, size: str, gguf_text: str, home: Path) -> dict[str, Any]:
    """The Hugging Face form (and at 135M the IR exported from it) registered and served."""
    hf = shaped_models.hf_form(size)
    sources = {"hf": hf}
    if size == shaped_models.REAL:
        ir = home / "ir"
        subprocess.run(
            [sys.executable, "-m", "services.loader.hf_export", str(hf), str(ir), "int8"],
            check=True,
            timeout=REGISTER_TIMEOUT_S,
            cwd=REPO_ROOT,
            capture_output=True,
        )
        sources["openvino"] = ir
    out = {}
    for form, source in sources.items():
        name = f"{size}-{form}"
        reg, register_s = client.register(name, source)
        text = client.greedy(name, COLD_TOKENS)["text"]
        out[form] = {
            "register_s": register_s,
            "store_bytes": dir_bytes(Path(reg["artifact"]["path"])),
            "source_bytes": dir_bytes(source),
            "weight_format": reg["artifact"].get("weight_format"),
            "text": text,
            "same_text_as_gguf": text == gguf_text,
        }
        log(f"{name}: registered in {register_s:.1f}s, same text as the GGUF form: {text == gguf_text}")
    return out


def llamacpp(gguf: Path, args: argparse.Namespace) -> dict[str, Any]:
    cold = [run_peer("llamacpp", gguf)["cold_ttft_s"] for _ in range(args.trials)]
    log(f"llama.cpp cold {cold}")
    parallel, ctx, extra = llama_server_args(list(LEVELS))
    with LlamaServer(gguf, threads=THREADS, ctx=ctx, parallel=parallel, extra=extra) as server:
        warm(server.base_url, "gguf", "llama_server")
        levels = loads(server.base_url, "gguf", args.duration, lambda: [server.pid])
    return {"cold_ttft_trials_s": cold, "levels": levels}


def pipeline(ir: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for c in LEVELS:
        run, _ = run_pipeline(ir, c, args.duration, max(LEVELS))
        out[str(c)] = summarize(run, MAX_TOKENS)
        log(f"pipeline c={c}: {out[str(c)]['tok_s']:.1f} tok/s")
    return {"levels": out}


def size_result(size: str, gguf: Path, t: dict[str, Any], ll: dict[str, Any], pl: dict[str, Any]) -> dict[str, Any]:
    """The issue's fields for one size, and the ratios its targets are stated in."""
    cold = {tier: median([r["ttft_s"] for r in t["cold"][tier]]) for tier in TIERS}
    after_start = [r["decode_tok_s"] for tier in TIERS for r in t["cold"][tier] if r["decode_tok_s"]]
    llama_cold = median(ll["cold_ttft_trials_s"])
    rss = t["levels"]["8"]["peak_rss_bytes"]
    weights = t["artifact"]["weight_bytes"]
    pipe_c1 = decode_tok_s(pl["levels"]["1"])
    res = {
        "params": shaped_models.params_of(size),
        "source_bytes": gguf.stat().st_size,
        "store_bytes": t["forms"]["gguf"]["store_bytes"],
        "weights_bytes": weights,
        "node_memory_bytes": {"booked": t["booked_bytes"], "rss_peak": rss, "pool_rss": t["pool_rss_bytes"]},
        "register_s": t["register_s"],
        "cold_resident_ttft_s": cold["resident"],
        "cold_host_ttft_s": cold["host"],
        "cold_disk_ttft_s": cold["disk"],
        "llamacpp_cold_ttft_s": llama_cold,
        "decode_c1_tok_s": decode_tok_s(t["levels"]["1"]),
        "decode_after_start_tok_s": median(after_start) if after_start else None,
        "pipeline_decode_c1_tok_s": pipe_c1,
        "llamacpp_decode_c1_tok_s": decode_tok_s(ll["levels"]["1"]),
        "throughput_c8_tok_s": {
            "tessera": t["levels"]["8"]["tok_s"],
            "pipeline": pl["levels"]["8"]["tok_s"],
            "llamacpp": ll["levels"]["8"]["tok_s"],
        },
        # Kept resident when idle: its starts after a scale to zero found its weights loaded
        # (the heartbeat's resident list may trail the scale to zero: the record is direct).
        "resident_when_idle": all(r["source"] == "resident" for r in t["cold"]["resident"]),
        "start_tier": t["artifact"].get("start_tier"),
        "weight_format": t["artifact"].get("weight_format"),
        "forms": {f: {k: v for k, v in d.items() if k != "text"} for f, d in t["forms"].items()},
        "trials": {"tessera_cold": t["cold"], "llamacpp_cold_ttft_s": ll["cold_ttft_trials_s"]},
        "levels": {"tessera": t["levels"], "pipeline": pl["levels"], "llamacpp": ll["levels"]},
    }
    res["ratios"] = {
        "cold_host_vs_llamacpp": cold["host"] / llama_cold,
        "cold_disk_vs_llamacpp": cold["disk"] / llama_cold,
        "cold_resident_vs_llamacpp": cold["resident"] / llama_cold,
        "decode_c1_vs_pipeline": ratio(res["decode_c1_tok_s"], pipe_c1),
        "decode_after_start_vs_pipeline": ratio(res["decode_after_start_tok_s"], pipe_c1),
        "c8_vs_pipeline": ratio(t["levels"]["8"]["tok_s"], pl["levels"]["8"]["tok_s"]),
        "c8_vs_llamacpp": ratio(t["levels"]["8"]["tok_s"], ll["levels"]["8"]["tok_s"]),
        "node_memory_vs_weights": max(t["booked_bytes"], rss) / weights,
        "store_vs_source": res["store_bytes"] / res["source_bytes"],
    }
    return res


def targets(sizes: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, each with the figure it was judged on."""
    out: dict[str, Any] = {}
    mid = sizes.get("smollm2-1.7b")
    if mid:
        r = mid["ratios"]
        out["1.7b"] = {
            "cold_host_at_most_0.5x_llamacpp": r["cold_host_vs_llamacpp"] <= 0.5,
            "cold_disk_at_most_1.0x_llamacpp": r["cold_disk_vs_llamacpp"] <= 1.0,
            "decode_c1_at_least_0.95x_pipeline": (r["decode_c1_vs_pipeline"] or 0) >= 0.95,
            "decode_after_start_at_least_0.95x_pipeline": (r["decode_after_start_vs_pipeline"] or 0) >= 0.95,
            "node_memory_at_most_2x_weights": r["node_memory_vs_weights"] <= 2.0,
            "store_at_most_3x_source": r["store_vs_source"] <= 3.0,
        }
    big = sizes.get("llama3-8b")
    if big:
        r = big["ratios"]
        out["8b"] = {
            "resident_when_idle": big["resident_when_idle"],
            "every_cold_start_at_most_1.0x_llamacpp": max(
                r["cold_host_vs_llamacpp"], r["cold_disk_vs_llamacpp"], r["cold_resident_vs_llamacpp"]
            )
            <= 1.0,
        }
    return out


def plot(res: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(res["sizes"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    keys = ("cold_resident_ttft_s", "cold_host_ttft_s", "cold_disk_ttft_s", "llamacpp_cold_ttft_s")
    width = 0.2
    for i, k in enumerate(keys):
        ax1.bar(
            [x + i * width for x in range(len(names))],
            [res["sizes"][n][k] for n in names],
            width,
            label=k.removesuffix("_ttft_s"),
        )
    ax1.set_xticks([x + 1.5 * width for x in range(len(names))], names)
    ax1.set_yscale("log")
    ax1.set_ylabel("cold TTFT (s)")
    ax1.legend(fontsize=8)
    keys = ("decode_c1_tok_s", "decode_after_start_tok_s", "pipeline_decode_c1_tok_s", "llamacpp_decode_c1_tok_s")
    for i, k in enumerate(keys):
        ax2.bar(
            [x + i * width for x in range(len(names))],
            [res["sizes"][n][k] or 0 for n in names],
            width,
            label=k.removesuffix("_tok_s"),
        )
    ax2.set_xticks([x + 1.5 * width for x in range(len(names))], names)
    ax2.set_ylabel("decode, one stream (tok/s)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"bench/models.py, {res['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=SIZES)
    ap.add_argument("--hf-sizes", nargs="*", default=list(HF_SIZES), choices=SIZES)
    ap.add_argument("--trials", type=int, default=2, help="cold starts per tier, and llama.cpp starts")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds each c=1 / c=8 load runs")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    ap.add_argument("--merge", action="store_true", help="add this run's sizes to the existing models.json")
    args = ap.parse_args(argv)
    if args.hf_sizes and importlib.util.find_spec("transformers") is None:
        log("transformers is not installed (`pip install -e '.[hf]'`): the GGUF form only")
        args.hf_sizes = []
    load_before = os.getloadavg()
    started = time.perf_counter()
    sizes: dict[str, Any] = {}
    served: set[str] = set()
    failed: dict[str, str] = {}
    for size in args.sizes:
        gguf = shaped_models.ensure(size)
        try:
            with tempfile.TemporaryDirectory(prefix="tessera-models-") as home:
                t = tessera(size, gguf, Path(home), args)
                ll = llamacpp(gguf, args)
                pl = pipeline(Path(t["artifact"]["path"]), args)
        except Exception as e:  # one size failing leaves the others' results
            log(f"{size} failed: {type(e).__name__}: {e}")
            failed[size] = f"{type(e).__name__}: {e}"
            continue
        sizes[size] = {
            **size_result(size, gguf, t, ll, pl),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
        served |= set(t["forms"])
        log(f"{size}: {json.dumps(sizes[size]['ratios'])}")
    out_json = args.out / "models.json"
    if args.merge and out_json.exists():  # the sizes of an earlier run, this run's replacing theirs
        earlier = json.loads(out_json.read_text())
        sizes = {**earlier.get("sizes", {}), **sizes}
        served |= set(earlier.get("formats_served", ()))
        failed = {k: v for k, v in {**earlier.get("failed", {}), **failed}.items() if k not in sizes}
    res = {
        "formats_served": sorted(served),
        "sizes": sizes,
        "targets": targets(sizes),
        "failed": failed,
        "threads": THREADS,
        "trials": args.trials,
        "duration_s": args.duration,
        "machine": machine_info(load_before),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "bench_wall_s": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(res, indent=2) + "\n")
    plot(res, args.out / "models.png")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
