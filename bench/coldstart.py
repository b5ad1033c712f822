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
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/coldstart.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.coldstart_client import log
from bench.coldstart_peers import bench_peer, median_phases
from bench.coldstart_report import plot, targets
from bench.coldstart_tessera import bench_tessera
from bench.common import THREADS, machine_info, median
from ops.localcluster import REPO_ROOT, default_model_path

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
