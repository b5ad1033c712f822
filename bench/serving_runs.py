"""The settings of `bench/serving.py`, one request as its client saw it, and the figures a run of
them is summarized into (tok/s, TTFT and TPOT percentiles, errors by status)."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import make_log, percentile

log = make_log("serving")
REPO_ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("tessera", "pipeline", "llama_server")
MODEL_NAME = "bench-serving"
THREADS = 2
EXTRA_ENV = {k: v for k, v in os.environ.items() if k.startswith("TESSERA_") and k != "TESSERA_INFERENCE_THREADS"}
"""TESSERA_* settings of the calling environment go to the cluster (to compare settings)."""
MAX_TOKENS = 64
LONG_TOKENS = 2048
MIXED_SHORT_CLIENTS = 31
PROMPTS = (
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give three tips for learning a new language.",
    "Describe a busy market early in the morning.",
)
# Generous, so that admission never refuses what the engine could serve: the benchmark
# measures throughput, not SLO attainment.
TESSERA_REGISTRATION = {"ttft_slo_s": 10.0, "tpot_slo_s": 1.0, "keep_alive_s": 3600.0}
KV_BLOCK_TOKENS = 32  # the CPU plugin's KV-cache block
KV_MARGIN = 1.25
LLAMA_PARALLEL = 64
LLAMA_SLOT_TOKENS = 256  # per slot: a prompt (~50 tokens with the template) + 64, with room
REQUEST_TIMEOUT_S = 600.0
CHILD_TIMEOUT_S = 900.0


# --- one request, and what a run of them measured ------------------------------------------------


Measured = tuple[dict[str, Any], dict[str, Any], dict[str, Any]]
"""What one system's benchmark returns: per concurrency level, the mixed run, how it ran."""


@dataclasses.dataclass
class Outcome:
    """One request as its client saw it. `status` is "ok" or why it failed: the HTTP status
    ("429"), "stream_error", "timeout", "transport", or the pipeline's handle status."""

    status: str
    tokens: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    retry_after_s: float = 0.0
    arrivals: list[float] = dataclasses.field(default_factory=list)
    """When its tokens came (perf_counter; relative to its run's start where it ran elsewhere)."""


@dataclasses.dataclass
class Run:
    """The short requests of one run, its wall time (start -> last short request over), and,
    in a mixed run, the long request (its tokens so far if it was still running)."""

    outcomes: list[Outcome]
    wall_s: float
    long: Outcome | None = None
    peak_rss_bytes: int | None = None
    t0: float = 0.0
    window_s: float = 0.0
    """The load's window: clients send from `t0` for `window_s` (the requests then in flight
    finish after it)."""


def timed_outcome(sent: float, arrivals: list[float], tokens: int) -> Outcome:
    """TTFT and TPOT from the send time and the content arrivals of a completed request."""
    first, last = arrivals[0], arrivals[-1]
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Outcome("ok", tokens, first - sent, tpot, arrivals=list(arrivals))


def window_tokens(run: Run) -> float:
    """Tokens the completed requests received within the run's window (a request's tokens are
    spread evenly over its content arrivals).

    Throughput as tokens delivered while the load lasts, not completed requests over the time
    the last one took: with 64-token requests a wave of 32 or 64 clients takes 6-10 s, so
    counting whole requests made the figure jump by a wave (a quarter of a 20 s run) with
    whether the last wave began just before or just after the deadline."""
    end = run.t0 + run.window_s
    total = 0.0
    for o in run.outcomes:
        if o.status == "ok" and o.arrivals:
            total += o.tokens * sum(1 for t in o.arrivals if t <= end) / len(o.arrivals)
    return total


def summarize(run: Run, expected_tokens: int) -> dict[str, Any]:
    """The figures the result keeps for one run: tok/s, TTFT/TPOT p50/p99, errors by status."""
    ok = [o for o in run.outcomes if o.status == "ok"]
    tokens = sum(o.tokens for o in ok)
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    tpot = [o.tpot_s for o in ok if o.tpot_s is not None]

    def pct(xs: list[float], q: float) -> float | None:
        return percentile(xs, q) if xs else None

    return {
        "tok_s": window_tokens(run) / run.window_s if run.window_s > 0 else None,
        "tok_s_completed": tokens / run.wall_s if run.wall_s > 0 else None,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "tpot_p50_s": pct(tpot, 50),
        "tpot_p99_s": pct(tpot, 99),
        "errors": dict(Counter(o.status for o in run.outcomes if o.status != "ok")),
        "requests": len(run.outcomes),
        "completed": len(ok),
        "tokens": tokens,
        # ignore_eos honoured: every completed request must carry exactly max_tokens tokens.
        "outputs_not_full": sum(1 for o in ok if o.tokens != expected_tokens),
        "wall_s": run.wall_s,
        "peak_rss_bytes": run.peak_rss_bytes,
    }


def summarize_mixed(alone: Run, mixed: Run) -> dict[str, Any]:
    """The mixed run's figures: the short requests' TTFT p99 with and without the long one."""
    with_long, without = summarize(mixed, MAX_TOKENS), summarize(alone, MAX_TOKENS)
    p99, p99_alone = with_long["ttft_p99_s"], without["ttft_p99_s"]
    return {
        "short_ttft_p99_s": p99,
        "short_ttft_p99_alone_s": p99_alone,
        "ratio": p99 / p99_alone if p99 and p99_alone else None,
        "short": with_long,
        "short_alone": without,
        "long": dataclasses.asdict(dataclasses.replace(mixed.long, arrivals=[])) if mixed.long else None,
    }


def log_level(label: str, clients: int, s: dict[str, Any]) -> None:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f}ms"

    log(
        f"{label} c={clients}: {s['tok_s'] or 0:.0f} tok/s, {s['completed']}/{s['requests']} ok, "
        f"ttft p50 {ms(s['ttft_p50_s'])} p99 {ms(s['ttft_p99_s'])}, tpot p50 {ms(s['tpot_p50_s'])} "
        f"p99 {ms(s['tpot_p99_s'])}, errors {s['errors']}, not {MAX_TOKENS} tokens: "
        f"{s['outputs_not_full']}, peak rss {(s['peak_rss_bytes'] or 0) / 2**20:.0f} MiB"
    )


def log_mixed(label: str, m: dict[str, Any]) -> None:
    log(
        f"{label} mixed: short ttft p99 {m['short_ttft_p99_s']} s with the long one, "
        f"{m['short_ttft_p99_alone_s']} s alone; long {m['long']}"
    )
