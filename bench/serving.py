"""Serving a crowd: Tessera, the engine library alone, and llama-server, under the same load.

    python -m bench.serving [--duration 20] [--concurrency 1,8,32,64] [--out bench/results]
        [--only tessera|pipeline|llama_server]

One run, same model (the default GGUF), same prompts, same machine, every system on 2
inference threads; Tessera and the pipeline level by level (each level's two runs back to
back, so that their ratio does not measure the host's drift), then llama-server:

- `tessera`: a `LocalCluster` in a temporary home, the model registered with a generous SLO
  (TTFT 10 s, TPOT 1 s) and a long keep-alive, warmed with one request, then driven through
  the gateway's OpenAI API.
- `pipeline`: OpenVINO GenAI's `ContinuousBatchingPipeline` on the IR Tessera converted at
  registration, in a fresh Python process (`pipeline_driver`), driven as a serving engine
  drives it: one thread adds arriving requests, steps, and reads each handle that has tokens.
  Its clients are simulated in that process, so it pays no HTTP: the ceiling.
- `llama_server`: llama.cpp's `llama-server --parallel 64 --cont-batching` on the GGUF
  (built by bench/llama_server.py), through its OpenAI API.

Load: for each concurrency N, N clients send back to back for `--duration` s (then the
requests in flight finish); each request is a streamed chat completion of one of `PROMPTS`
(client i's k-th request uses prompt i + k) with 64 greedy tokens and `ignore_eos`. Per
request: TTFT (sent -> first content), TPOT ((last - first content) / (tokens - 1)). Per run:
output tok/s (tokens of completed requests / wall time), TTFT and TPOT p50/p99, errors by
status, and the peak resident memory of the serving processes (sampled every 0.2 s). Then a
mixed run: one 2,048-token generation started first, and 31 clients sending 64-token requests
back to back while it runs (for `--duration` s at most), against the same 31 clients alone.

Writes `<out>/serving.json` (`<out>/serving-only.json` with `--only`) and a plot of tok/s
against concurrency, `<out>/serving.png`; prints the JSON on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/serving.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine_info
from bench.serving_peers import bench_llama_server, bench_pipeline, pipeline_driver
from bench.serving_report import plot, ratios, targets
from bench.serving_runs import (
    EXTRA_ENV,
    LONG_TOKENS,
    MAX_TOKENS,
    MIXED_SHORT_CLIENTS,
    MODEL_NAME,
    PROMPTS,
    REPO_ROOT,
    SYSTEMS,
    THREADS,
    Measured,
    log,
)
from bench.serving_tessera import bench_structured, bench_tessera, register
from ops.localcluster import LocalCluster, default_model_path

# --- the run -------------------------------------------------------------------------------------


def attempt(res: dict[str, Any], system: str, bench: Callable[[], Measured]) -> None:
    """Run one system's benchmark into `res`; a failure is recorded under `failed` (with an
    engine under rewrite, Tessera may fail) and the other systems still run."""
    try:
        res[system], res["mixed"][system], res["setup"][system] = bench()
    except Exception as e:
        log(f"{system} failed: {type(e).__name__}: {e}")
        res["failed"][system] = f"{type(e).__name__}: {e}"


def interleaved(
    cluster: LocalCluster, reg: dict[str, Any], ir: Path, levels: list[int], duration_s: float
) -> tuple[Measured, Measured]:
    """Tessera and the pipeline level by level, each level's two runs back to back, then their
    mixed runs: this host's speed drifts over a run of many minutes, and a ratio of two runs
    taken a quarter of an hour apart would measure the drift. The cluster stays up (idle, its
    model loaded) while the pipeline runs."""
    t_levels: dict[str, Any] = {}
    p_levels: dict[str, Any] = {}
    p_config: dict[str, Any] = {}
    for c in levels:
        t_levels.update(bench_tessera(cluster, reg, [c], duration_s, mixed_run=False)[0])
        found, _, p_config = bench_pipeline(ir, [c], duration_s, mixed_run=False)
        p_levels.update(found)
    _, t_mixed, t_setup = bench_tessera(cluster, reg, [], duration_s)
    _, p_mixed, _ = bench_pipeline(ir, [], duration_s)
    return (t_levels, t_mixed, t_setup), (p_levels, p_mixed, p_config)


def run_systems(systems: list[str], levels: list[int], duration_s: float, home: Path) -> dict[str, Any]:
    """Tessera and the pipeline (on the IR Tessera's registration converted) level by level
    (`interleaved`), then llama-server with the cluster stopped."""
    gguf = default_model_path()
    res: dict[str, Any] = {"mixed": {}, "setup": {}, "failed": {}}
    if "tessera" in systems or "pipeline" in systems:
        cluster = LocalCluster(
            home=home / "home", store=home / "store", env={"TESSERA_INFERENCE_THREADS": str(THREADS), **EXTRA_ENV}
        )
        try:
            cluster.start(timeout_s=120.0)
            reg = register(cluster, gguf)
            ir = Path(reg["artifact"]["path"])
            log(f"cluster up at {cluster.base_url}, {MODEL_NAME} registered; IR in {ir}")
            if "tessera" in systems and "pipeline" in systems:
                both: list[Measured] = []

                def pair() -> Measured:
                    t, p = interleaved(cluster, reg, ir, levels, duration_s)
                    both.append(p)
                    return t

                attempt(res, "tessera", pair)
                if both:
                    attempt(res, "pipeline", lambda: both[0])
            elif "tessera" in systems:
                attempt(res, "tessera", lambda: bench_tessera(cluster, reg, levels, duration_s))
            else:
                attempt(res, "pipeline", lambda: bench_pipeline(ir, levels, duration_s))
        except Exception as e:  # the cluster did not start, or registration failed
            log(f"cluster failed: {type(e).__name__}: {e}")
            res["failed"]["cluster"] = f"{type(e).__name__}: {e}"
        finally:
            cluster.stop()
    if "llama_server" in systems:
        attempt(res, "llama_server", lambda: bench_llama_server(gguf, levels, duration_s))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds each load runs (default 20)")
    ap.add_argument("--concurrency", default="1,8,32,64", help="client counts (default 1,8,32,64)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    ap.add_argument("--only", choices=SYSTEMS, help="run one system (writes serving-only.json)")
    ap.add_argument("--pipeline-driver", help=argparse.SUPPRESS)
    ap.add_argument(
        "--structured-only",
        action="store_true",
        help="run only the structured-output run; its result replaces `structured` in serving.json",
    )
    args = ap.parse_args(argv)
    if args.pipeline_driver:
        print(json.dumps(pipeline_driver(json.loads(args.pipeline_driver))), flush=True)
        return 0
    if args.structured_only:
        with tempfile.TemporaryDirectory(prefix="tessera-serving-") as home:
            structured = bench_structured(args.duration, Path(home))
        path = args.out / "serving.json"
        res = json.loads(path.read_text()) if path.exists() else {}
        res["structured"] = {
            **structured,
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "duration_s": args.duration,
        }
        path.write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps(res["structured"], indent=2))
        return 0
    levels = [int(c) for c in args.concurrency.split(",")]
    systems = [args.only] if args.only else list(SYSTEMS)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tessera-serving-") as home:
        res = run_systems(systems, levels, args.duration, Path(home))
    if "tessera" in systems:
        with tempfile.TemporaryDirectory(prefix="tessera-serving-") as home:
            res["structured"] = bench_structured(args.duration, Path(home))
    tessera_mixed = res["mixed"].get("tessera") or {}
    # The two mixed keys at the top are Tessera's; every system's are under its name.
    res["mixed"] = {
        "short_ttft_p99_s": tessera_mixed.get("short_ttft_p99_s"),
        "short_ttft_p99_alone_s": tessera_mixed.get("short_ttft_p99_alone_s"),
        **res["mixed"],
    }
    res["ratios"] = ratios(res)
    res["targets"] = targets(res, res["ratios"])
    res.update(
        {
            "concurrency": levels,
            "duration_s": args.duration,
            "max_tokens": MAX_TOKENS,
            "long_tokens": LONG_TOKENS,
            "mixed_short_clients": MIXED_SHORT_CLIENTS,
            "prompts": list(PROMPTS),
            "threads": THREADS,
            "machine": machine_info(load_before),
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        }
    )
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "serving-only" if args.only else "serving"
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, levels, args.out / f"{stem}.png")
    log(f"wrote {args.out / (stem + '.json')} and {args.out / (stem + '.png')}")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
