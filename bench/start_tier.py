"""What the OpenVINO start tier costs and what it gains, at 135M (real) and 360M, 1.7B, 7-8B shapes.

A cold start on OpenVINO serves its first requests from the start tier (a stateful IR whose
4-bit weights are held one value per byte: `services/loader/start_ir.py`, served by
`services.engine.instance.LoadedModel` / `services.engine.batch.StartBatch`) while the continuous-batching core
(`services.engine.core.build_pipeline`, which cannot be materialized) builds; then the
worker swaps to the core. This measures, per size, each in a fresh process (a pre-warmed
worker: openvino, openvino_tokenizers and openvino_genai imported before the clock starts):

- `materialize`: the loader's own code (`services.loader.convert.materialize`) writing the
  store's tiers, timed per step (the start IR; each tier's compiled blob), the bytes each
  step adds to the store and the process's peak RSS;
- `start` / `steady`: `LoadedModel.load` of that tier + one greedy request stepped through a
  `StartBatch` on it: time to its first token, decode tok/s after it, RSS once loaded and at the end
  (`steady` is the stateful tier on the packed 4-bit weights: what a start loads with the
  start tier switched off, and what serves logit-reading requests);
- `core`: `build_pipeline` (no warm-up) + the detokenizer + a `CoreBatch` serving the same
  request from its first token;

and from those the break-even: the time (and answer length) after which serving from the
core from the first token has produced more tokens than the start tier would have (each path
alone, linear in tokens; in the worker the start path then still pays the core's build and
its cold first step, so a start with the start tier costs the CPU of both).

Other work may share the machine: every child records its CPU seconds beside its wall times,
and the summary restates each path from them as if it had its threads' cores alone.
The page cache is left as the previous step left it (the store's files just written or read:
the loader's host-cache case), nothing is dropped. A child is stopped if the machine runs
short of memory (`MEM_FLOOR_BYTES`), and asks the OOM killer to pick it first.

    python -m bench.start_tier [--sizes smollm2-135m smollm2-360m smollm2-1.7b llama3-8b]
        [--tokens 32] [--repeats 2] [--merge]

Writes `bench/results/start_tier.json` (and `.png` where matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import shaped_models

RESULTS = Path(__file__).parent / "results"
PROMPT = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle on a stormy "
    "night, and what the message says about the sea, the ships and the people who sail them."
)
PROMPT_TOKENS = 32
DEVICE = "CPU"
CHILD_TIMEOUT_S = 3600


def store_root() -> Path:
    return shaped_models.cache_dir() / "store"


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (symlinks not followed: the GGUF link)."""
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def proc_status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def rss_bytes() -> int:
    return proc_status_kb("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return proc_status_kb("VmHWM") * 1024


def cpu_info() -> dict[str, Any]:
    model = ""
    flags: set[str] = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and not model:
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
    return {
        "model_name": model,
        "flags": {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile")},
        "nproc": os.cpu_count(),
    }


def decode_rate(times: list[float]) -> float | None:
    """Tokens per second after the first, from each token's arrival time."""
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def cpu_figures(c0: float, cpu: list[float]) -> dict[str, float | None]:
    """CPU seconds (every thread of the process) to the first token and per token after it:
    what a path costs whatever else runs on the machine (wall times here share 2 cores with
    other work)."""
    return {
        "ttft_cpu_s": cpu[0] - c0,
        "decode_cpu_s_per_token": (cpu[-1] - cpu[0]) / (len(cpu) - 1) if len(cpu) > 1 else None,
    }


# --- the children: one measurement each, in a fresh process -----------------------------


def _prewarm() -> Any:
    """What a pre-warmed worker has imported and made before it is bound to a model."""
    import openvino as ov
    import openvino_genai  # noqa: F401
    import openvino_tokenizers  # noqa: F401

    import services.engine.core
    import services.engine.instance  # noqa: F401

    return ov.Core()


def child_convert(gguf_path: Path, dest: Path) -> dict[str, Any]:
    """GGUF → IR as the loader does it (`convert.convert`); the prompt's ids from its tokenizer."""
    import openvino_genai as ov_genai

    from services.loader.convert import convert

    t0 = time.monotonic()
    # Every size gets its start tier here (the loader's `start_tier_max_weight_bytes` keeps it
    # only for small models, from what this measured).
    artifact = convert(gguf_path, dest, "0" * 64, f"bench-{dest.name}", start_tier_max_weight_bytes=sys.maxsize)
    seconds = time.monotonic() - t0
    ids = ov_genai.Tokenizer(str(dest)).encode(PROMPT).input_ids.data[0].tolist()
    return {
        "convert_s": seconds,
        "ir_bytes": tree_bytes(dest),
        "weight_bytes": artifact.weight_bytes,
        "peak_rss_bytes": peak_rss_bytes(),
        "prompt_ids": ids[:PROMPT_TOKENS],
    }


def child_materialize(dest: Path, threads: int) -> dict[str, Any]:
    """`convert.materialize` (start IR, then each tier compiled and checked), its steps timed
    by wrapping the two functions it ends them with."""
    import services.loader.convert as convert
    import services.loader.hostcache as hostcache
    from services.loader.store import read_artifact
    from shared.artifact import START_DIR, compiled_cache_dir
    from shared.messages import Tier

    artifact = read_artifact(dest)
    assert artifact is not None
    marks: dict[str, float] = {}
    write_start_ir, write_manifest = convert.write_start_ir, hostcache.write_manifest

    def timed_start_ir(*args: Any) -> int:
        marks["start_ir_begin"] = time.monotonic()
        out = write_start_ir(*args)
        marks["start_ir_end"] = time.monotonic()
        return out

    def timed_manifest(artifact: Any, device: str, tier: Tier = Tier.STEADY) -> Any:
        out = write_manifest(artifact, device, tier)
        marks[f"compiled_{tier}"] = time.monotonic()
        return out

    convert.write_start_ir = timed_start_ir  # type: ignore[assignment]
    hostcache.write_manifest = timed_manifest  # type: ignore[assignment]
    t0 = time.monotonic()
    convert.materialize(artifact, DEVICE, threads)
    total = time.monotonic() - t0
    start_ir_end = marks.get("start_ir_end", t0)
    start_compiled = marks.get(f"compiled_{Tier.START}", start_ir_end)
    return {
        "materialize_s": total,
        "start_ir_s": start_ir_end - marks.get("start_ir_begin", t0),
        "start_compile_s": start_compiled - start_ir_end,
        "steady_compile_s": marks.get(f"compiled_{Tier.STEADY}", start_compiled) - start_compiled,
        "start_ir_bytes": tree_bytes(Path(artifact.path) / START_DIR),
        "start_blob_bytes": tree_bytes(compiled_cache_dir(artifact, DEVICE, Tier.START)),
        "steady_blob_bytes": tree_bytes(compiled_cache_dir(artifact, DEVICE, Tier.STEADY)),
        "store_bytes": tree_bytes(Path(artifact.path)),
        "peak_rss_bytes": peak_rss_bytes(),
    }


def step_out(batch: Any) -> tuple[list[float], list[float]]:
    """Step a `Batch` (`services.engine.batch_types`) holding one request until it is done:
    each token's arrival time and the process's CPU time then (tokens that came in one step
    share them: the rate counts steps' tokens over their span)."""
    times: list[float] = []
    cpu: list[float] = []
    while batch.active:
        for step in batch.steps(0.05):
            if step.error:
                raise RuntimeError(step.error)
            now, used = time.monotonic(), time.process_time()
            times += [now] * len(step.tokens)
            cpu += [used] * len(step.tokens)
    return times, cpu


def child_stateful(dest: Path, tier_name: str, prompt_ids: list[int], tokens: int, threads: int) -> dict[str, Any]:
    """A start on the stateful tier `tier_name`: load, then one greedy request."""
    core = _prewarm()
    from services.engine.batch import StartBatch
    from services.engine.instance import LoadedModel
    from services.loader.store import read_artifact
    from shared.messages import SamplingParams, Tier

    artifact = read_artifact(dest)
    assert artifact is not None
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    before = rss_bytes()
    load_avg = os.getloadavg()[0]
    t0, c0 = time.monotonic(), time.process_time()
    loaded = LoadedModel.load(core, artifact, DEVICE, threads, tier=Tier(tier_name))
    load_s = time.monotonic() - t0
    loaded_rss = rss_bytes()
    batch = StartBatch(loaded.compiled, loaded.eos_ids, artifact.context_length)
    batch.add("r", prompt_ids, params)
    steps, cpu = step_out(batch)  # once per token, as it is sampled
    batch.close()
    return {
        "loaded_from_cache": loaded.loaded_from_cache,
        "loadavg_1m": load_avg,
        "load_s": load_s,
        "ttft_s": steps[0] - t0,
        "decode_tok_s": decode_rate(steps),
        **cpu_figures(c0, cpu),
        "tokens": len(steps),
        "rss_before_bytes": before,
        "rss_loaded_bytes": loaded_rss,
        "rss_end_bytes": rss_bytes(),
        "peak_rss_bytes": peak_rss_bytes(),
    }


def child_core(dest: Path, prompt_ids: list[int], tokens: int, threads: int) -> dict[str, Any]:
    """A start on the continuous-batching core from the first token (no warm-up)."""
    core = _prewarm()
    from services.engine.core import CoreBatch, build_pipeline
    from services.engine.instance import Detokenizer
    from services.engine.tiered_batch import ir_vocab_size
    from services.loader.store import read_artifact
    from shared.messages import SamplingParams

    artifact = read_artifact(dest)
    assert artifact is not None
    vocab = ir_vocab_size(core, artifact)  # (the requests' check; the IR's weights only mapped)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    before = rss_bytes()
    load_avg = os.getloadavg()[0]
    t0, c0 = time.monotonic(), time.process_time()
    detokenizer = Detokenizer(str(dest))  # the worker's text needs it (the start tier's load includes it)
    pipeline = build_pipeline(str(dest), DEVICE, threads)
    build_s = time.monotonic() - t0
    built_rss = rss_bytes()
    batch = CoreBatch(pipeline, detokenizer.eos_token_id, vocab, artifact.context_length)
    batch.add("r", prompt_ids, params)
    times, cpu = step_out(batch)
    batch.close()
    return {
        "loadavg_1m": load_avg,
        "build_s": build_s,
        "ttft_s": times[0] - t0,
        "decode_tok_s": decode_rate(times),
        **cpu_figures(c0, cpu),
        "tokens": len(times),
        "rss_before_bytes": before,
        "rss_loaded_bytes": built_rss,
        "rss_end_bytes": rss_bytes(),
        "peak_rss_bytes": peak_rss_bytes(),
    }


def child_main(argv: list[str]) -> None:
    kind, dest, *rest = argv
    path = Path(dest)
    Path("/proc/self/oom_score_adj").write_text("1000")  # if memory runs out, this goes first
    if kind == "convert":
        out = child_convert(Path(rest[0]), path)
    elif kind == "materialize":
        out = child_materialize(path, int(rest[0]))
    elif kind in ("start", "steady"):
        out = child_stateful(path, kind, json.loads(rest[0]), int(rest[1]), int(rest[2]))
    else:
        out = child_core(path, json.loads(rest[0]), int(rest[1]), int(rest[2]))
    out["child_cpu_s"] = sum(getattr(resource.getrusage(resource.RUSAGE_SELF), f) for f in ("ru_utime", "ru_stime"))
    print("RESULT " + json.dumps(out), flush=True)


# --- the driver ----------------------------------------------------------------------------


MEM_FLOOR_BYTES = 1 << 30
"""A child is stopped when the machine's available memory falls below this: other work runs
here, and the OOM killer must not pick it (the children also ask to be picked first)."""


def mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def run_child(*args: str) -> dict[str, Any]:
    """One measurement in a fresh process: its figures, or {"error": why} if it failed."""
    cmd = [sys.executable, "-m", "bench.start_tier", "--child", *args]
    print(f"[start_tier] {' '.join(args[:2])} ...", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    least = mem_available_bytes()
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True)
        while proc.poll() is None:
            least = min(least, mem_available_bytes())
            if least < MEM_FLOOR_BYTES or time.monotonic() - t0 > CHILD_TIMEOUT_S:
                proc.kill()
                proc.wait()
                why = "memory" if least < MEM_FLOOR_BYTES else "time"
                out = {"error": f"stopped ({why}): {time.monotonic() - t0:.0f} s, {least / 2**30:.1f} GiB left"}
                print(f"[start_tier]   {out}", file=sys.stderr, flush=True)
                return out
            time.sleep(0.2)
        stdout.seek(0)
        stderr.seek(0)
        lines = [ln for ln in stdout.read().splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            out = {"error": f"exit {proc.returncode}: {stderr.read()[-1500:]}"}
            print(f"[start_tier]   {out}", file=sys.stderr, flush=True)
            return out
    out = json.loads(lines[-1][len("RESULT ") :])
    out["process_wall_s"] = time.monotonic() - t0
    out["least_mem_available_bytes"] = least
    print(f"[start_tier]   {json.dumps({k: v for k, v in out.items() if k != 'prompt_ids'})}", file=sys.stderr)
    return out


def break_even_s(start: dict[str, Any], core: dict[str, Any]) -> float | None:
    """Seconds from the start after which the core path has produced more tokens than the
    start-tier path: 0 when the core's first token comes first and it decodes no slower; None
    when the start tier is ahead for good (it decodes at least as fast and starts first)."""
    ts, tc = start["ttft_s"], core["ttft_s"]
    rs, rc = start["decode_tok_s"] or 0.0, core["decode_tok_s"] or 0.0
    if tc <= ts and rc >= rs:
        return 0.0
    if rc <= rs:
        return None
    # 1 + (t - tc) * rc = 1 + (t - ts) * rs
    return max(0.0, (tc * rc - ts * rs) / (rc - rs))


def tokens_by(run: dict[str, Any], t: float) -> float:
    """Tokens a path has produced `t` seconds after the start (linear model)."""
    if t < run["ttft_s"]:
        return 0.0
    return 1.0 + (t - run["ttft_s"]) * (run["decode_tok_s"] or 0.0)


def measure_size(name: str, tokens: int, threads: int, repeats: int) -> dict[str, Any]:
    gguf_path = shaped_models.ensure(name)
    dest = store_root() / name
    shutil.rmtree(dest, ignore_errors=True)  # a fresh store: every step below is measured
    out: dict[str, Any] = {
        "size": name,
        "params": shaped_models.params_of(name),
        "gguf_bytes": gguf_path.stat().st_size,
        "shaped": name != shaped_models.REAL,
        # Per size: a --merge run may measure another size with other settings.
        "max_tokens": tokens,
        "threads": threads,
        "repeats": repeats,
        "loadavg_before": list(os.getloadavg()),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    conv = run_child("convert", str(dest), str(gguf_path))
    out["convert"] = conv
    if "error" in conv:
        return out
    prompt_ids = conv.pop("prompt_ids")
    out["materialize"] = mat = run_child("materialize", str(dest), str(threads))
    if "error" in mat:
        return out
    mat["start_tier_bytes"] = mat["start_ir_bytes"] + mat["start_blob_bytes"]
    mat["start_tier_x_gguf"] = mat["start_tier_bytes"] / out["gguf_bytes"]
    mat["store_x_gguf"] = mat["store_bytes"] / out["gguf_bytes"]
    mat["start_tier_s"] = mat["start_ir_s"] + mat["start_compile_s"]
    args = (json.dumps(prompt_ids), str(tokens), str(threads))
    runs: dict[str, list[dict[str, Any]]] = {"start": [], "steady": [], "core": []}
    for _ in range(repeats):  # interleaved: a drift in the machine's load hits each path alike
        for kind in runs:
            runs[kind].append(run_child(kind, str(dest), *args))
    out["runs"] = runs
    out["summary"] = summarize(runs, mat, threads)
    out["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return out


def summarize(runs: dict[str, list[dict[str, Any]]], mat: dict[str, Any], threads: int) -> dict[str, Any]:
    """Best of the repeats, each figure on its own (other work shares this machine: the least
    disturbed run is the closest to the path's own cost), and the break-evens. The `*_cpu`
    figures restate each path from its CPU time as if it had its `threads` cores to itself
    (CPU seconds ÷ threads; an estimate that assumes the threads run in parallel)."""
    best: dict[str, dict[str, Any]] = {}
    for kind, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            continue
        b = best[kind] = {
            "ttft_s": min(r["ttft_s"] for r in ok),
            "decode_tok_s": max(r["decode_tok_s"] or 0.0 for r in ok),
            "ttft_cpu_s": min(r["ttft_cpu_s"] for r in ok),
            "decode_cpu_s_per_token": min(r["decode_cpu_s_per_token"] or 0.0 for r in ok),
            "rss_end_bytes": max(r["rss_end_bytes"] for r in ok),
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ok),
            "loadavg_1m": [r["loadavg_1m"] for r in ok],
        }
        b["load_s" if kind != "core" else "build_s"] = min(r["load_s" if kind != "core" else "build_s"] for r in ok)
    out: dict[str, Any] = {f"{kind}_{key}": value for kind, b in best.items() for key, value in b.items()}
    out["start_tier_bytes"] = mat["start_tier_bytes"]
    out["start_tier_materialize_s"] = mat["start_tier_s"]

    def by_cpu(b: dict[str, Any]) -> dict[str, Any]:
        per_token = b["decode_cpu_s_per_token"]
        return {"ttft_s": b["ttft_cpu_s"] / threads, "decode_tok_s": threads / per_token if per_token else None}

    for kind in ("start", "steady"):
        if kind not in best or "core" not in best:
            continue
        for suffix, ours, core in (("", best[kind], best["core"]), ("_cpu", by_cpu(best[kind]), by_cpu(best["core"]))):
            t = break_even_s(ours, core)
            out[f"break_even_{kind}_vs_core{suffix}_s"] = t
            # The answer length below which this tier's path finishes first.
            out[f"break_even_{kind}_vs_core{suffix}_tokens"] = None if t is None else tokens_by(core, t)
        out[f"{kind}_tokens_ahead_at_core_ttft"] = tokens_by(best[kind], best["core"]["ttft_s"])
    return out


def plot(result: dict[str, Any], path: Path) -> bool:
    """Tokens over time from a cold start, per size and path; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = [s for s in result["sizes"] if {"start_ttft_s", "core_ttft_s"} <= set(s.get("summary", {}))]
    if not sizes:
        return False
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        s = size["summary"]
        horizon = max(s["core_ttft_s"], s["start_ttft_s"]) * 2.5
        ts = [horizon * i / 200 for i in range(201)]
        for kind, label in (("start", "start tier"), ("steady", "stateful, packed"), ("core", "core")):
            if f"{kind}_ttft_s" not in s:
                continue
            run = {"ttft_s": s[f"{kind}_ttft_s"], "decode_tok_s": s[f"{kind}_decode_tok_s"]}
            ax.plot(ts, [tokens_by(run, t) for t in ts], label=label)
        ax.set_title(f"{size['size']} ({size['params'] / 1e9:.2f} B params)")
        ax.set_xlabel("seconds from the start")
        ax.set_ylabel("tokens out")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=[shaped_models.REAL, "smollm2-1.7b"])
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--keep-store", action="store_true", help="keep each size's materialized store")
    parser.add_argument("--merge", action="store_true", help="add these sizes to the existing result file")
    parser.add_argument("--out", type=Path, default=RESULTS / "start_tier.json")
    parser.add_argument("--summarize", action="store_true", help="recompute the summaries of --out from its runs")
    parser.add_argument("--child", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.child:
        child_main(args.child)
        return
    if args.summarize:
        stored = json.loads(args.out.read_text())
        stored["sizes"].sort(key=lambda s: s["params"])
        for size in stored["sizes"]:
            if "runs" in size:
                size["summary"] = summarize(size["runs"], size["materialize"], size["threads"])
        args.out.write_text(json.dumps(stored, indent=2) + "\n")
        return
    load_before = os.getloadavg()
    result: dict[str, Any] = json.loads(args.out.read_text()) if args.merge and args.out.is_file() else {}
    result.update(
        {
            "machine": {**cpu_info(), "loadavg_before": list(load_before)},
            "prompt_tokens": PROMPT_TOKENS,
        }
    )
    sizes = [s for s in result.get("sizes", []) if s["size"] not in args.sizes]
    for name in args.sizes:
        try:
            sizes.append(measure_size(name, args.tokens, args.threads, args.repeats))
        finally:
            if not args.keep_store:
                shutil.rmtree(store_root() / name, ignore_errors=True)
        result["sizes"] = sorted(sizes, key=lambda s: s["params"])
        result["machine"]["loadavg_after"] = list(os.getloadavg())
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")  # after each size: a stop keeps the rest
    result["plot"] = plot(result, args.out.with_suffix(".png"))
    if not result["plot"]:
        print("[start_tier] matplotlib is not installed: no plot", file=sys.stderr)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
