"""Serving a crowd: Tessera, the engine library alone, and llama-server, under the same load.

    python -m bench.serving [--duration 20] [--concurrency 1,8,32,64] [--out bench/results]
        [--only tessera|pipeline|llama_server]

One run, one system after the other, same model (the default GGUF), same prompts, same
machine, every system on 2 inference threads:

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
import asyncio
import dataclasses
import datetime as dt
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python bench/serving.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.common import ChatStream, chat_body, machine_info, make_log, percentile
from bench.llama_server import LLAMA_CPP_PYTHON_VERSION, LlamaServer
from ops.localcluster import LocalCluster, default_model_path

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
RSS_SAMPLE_S = 0.2
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


# --- resident memory -----------------------------------------------------------------------------


def rss_bytes(pid: int) -> int:
    """Resident bytes of one process now (0 if it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def descendants(root: int) -> list[int]:
    """Every live descendant of `root`, from /proc (an engine's worker processes)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out.append(child)
            todo.append(child)
    return out


class RssSampler:
    """The peak of the summed resident memory of the serving processes, sampled every 0.2 s in
    a thread. `pids` is asked at every sample: an engine may spawn workers meanwhile."""

    def __init__(self, pids: Callable[[], Iterable[int]]) -> None:
        self.pids = pids
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)

    def _loop(self) -> None:
        while True:
            self.peak = max(self.peak, sum(rss_bytes(p) for p in self.pids()))
            if self._stop.wait(RSS_SAMPLE_S):
                return

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# --- clients over HTTP (Tessera's gateway, llama-server) -----------------------------------------


async def stream_request(http: httpx.AsyncClient, body: dict[str, Any], chat: ChatStream | None = None) -> Outcome:
    """One streamed chat completion, timed from just before it is sent. `chat` (given by the
    caller) lets a caller that cancels it see the tokens so far."""
    chat = chat or ChatStream()
    sent = time.perf_counter()
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                retry_after = float(r.headers.get("retry-after", "0") or 0)
                return Outcome(str(r.status_code), retry_after_s=retry_after)
            async for line in r.aiter_lines():
                if not chat.feed(line):
                    break
    except httpx.TimeoutException:
        return Outcome("timeout")
    except httpx.HTTPError:
        return Outcome("transport")
    if chat.problem() is not None:
        return Outcome("stream_error", len(chat.arrivals))
    tokens = int((chat.usage or {}).get("completion_tokens", len(chat.arrivals)))
    return timed_outcome(sent, chat.arrivals, tokens)


async def client_loop(
    http: httpx.AsyncClient, model: str, index: int, more: Callable[[], bool], out: list[Outcome]
) -> None:
    """One client: requests back to back while `more()`; after a 429/503 it waits the
    `Retry-After` it was given, as a polite client does."""
    k = 0
    while more():
        body = chat_body(model, PROMPTS[(index + k) % len(PROMPTS)], MAX_TOKENS, ignore_eos=True)
        outcome = await stream_request(http, body)
        out.append(outcome)
        k += 1
        wake = time.perf_counter() + outcome.retry_after_s
        while more() and time.perf_counter() < wake:  # noqa: ASYNC110 (no wait past the run's end)
            await asyncio.sleep(0.05)


async def http_run(base_url: str, model: str, clients: int, duration_s: float, long_tokens: int = 0) -> Run:
    """`clients` clients back to back for `duration_s`; with `long_tokens`, one long request is
    started first (the clock starts at its first token) and the clients stop when it ends.
    A long request still running when the clients stop is cancelled (its stream closed)."""
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as http:
        long_task: asyncio.Task[Outcome] | None = None
        long_chat = ChatStream()
        if long_tokens:
            started = asyncio.Event()
            long_chat.on_chunk = lambda n: started.set()
            long_task = asyncio.create_task(
                stream_request(http, chat_body(model, PROMPTS[0], long_tokens, ignore_eos=True), long_chat)
            )
            waiter = asyncio.create_task(started.wait())
            await asyncio.wait({long_task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        t0 = time.perf_counter()
        deadline = t0 + duration_s

        def more() -> bool:
            return time.perf_counter() < deadline and not (long_task is not None and long_task.done())

        outcomes: list[Outcome] = []
        await asyncio.gather(*(client_loop(http, model, i, more, outcomes) for i in range(clients)))
        wall = time.perf_counter() - t0
        long = await finish_long(long_task, long_chat)
    return Run(outcomes, wall, long, t0=t0, window_s=duration_s)


async def finish_long(task: asyncio.Task[Outcome] | None, chat: ChatStream) -> Outcome | None:
    """The long request's outcome; still running, it is cancelled and reported as "running"
    with the tokens it had streamed."""
    if task is None:
        return None
    if task.done():
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return Outcome("running", len(chat.arrivals))


def bench_http(
    base_url: str, model: str, levels: list[int], duration_s: float, pids: Callable[[], Iterable[int]], label: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every concurrency level, then the mixed run (alone, then with the long request)."""
    out: dict[str, Any] = {}
    for c in levels:
        with RssSampler(pids) as rss:
            run = asyncio.run(http_run(base_url, model, c, duration_s))
        run.peak_rss_bytes = rss.peak
        out[str(c)] = summarize(run, MAX_TOKENS)
        log_level(label, c, out[str(c)])
    alone = asyncio.run(http_run(base_url, model, MIXED_SHORT_CLIENTS, duration_s))
    mixed = asyncio.run(http_run(base_url, model, MIXED_SHORT_CLIENTS, duration_s, LONG_TOKENS))
    result = summarize_mixed(alone, mixed)
    log_mixed(label, result)
    return out, result


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


# --- Tessera -------------------------------------------------------------------------------------


def register(cluster: LocalCluster, gguf: Path) -> dict[str, Any]:
    """Register the model (this converts the GGUF into the store; not measured)."""
    r = httpx.post(
        f"{cluster.base_url}/admin/models",
        headers=cluster.admin_headers,
        timeout=900,
        json={"name": MODEL_NAME, "source": str(gguf), **TESSERA_REGISTRATION},
    )
    r.raise_for_status()
    return dict(r.json())


async def one_request(base_url: str, model: str) -> Outcome:
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as http:
        return await stream_request(http, chat_body(model, PROMPTS[0], MAX_TOKENS, ignore_eos=True))


def warm(base_url: str, model: str, label: str) -> None:
    """One request, not measured (it starts Tessera's instance); fail loudly if it fails, and
    say so if `ignore_eos` was not honoured."""
    o = asyncio.run(one_request(base_url, model))
    if o.status != "ok":
        raise RuntimeError(f"{label}'s warm-up request failed: {o}")
    if o.tokens != MAX_TOKENS:
        log(f"WARNING: {label} answered {o.tokens} tokens, not {MAX_TOKENS}: ignore_eos not honoured")


def _on_core(cluster: LocalCluster) -> bool:
    status = httpx.get(f"{cluster.base_url}/admin/instances", headers=cluster.admin_headers, timeout=10).json()
    return any(i["tier"] == "steady" for n in status["nodes"] for i in n["instances"])


def bench_tessera(cluster: LocalCluster, reg: dict[str, Any], levels: list[int], duration_s: float) -> Measured:
    """Through the gateway; memory = the engine service's worker processes."""
    warm(cluster.base_url, MODEL_NAME, "tessera")
    # Steady state is what is compared: a start serves its first requests on the start tier
    # while the continuous-batching core builds (≈ 2.5 s); wait for the hand-over.
    deadline = time.monotonic() + 120
    while not _on_core(cluster) and time.monotonic() < deadline:
        time.sleep(0.2)  # sync-ok: polling a condition with a deadline
    engine_pid = cluster.procs["engine@node-0"].pid
    by_level, mixed = bench_http(
        cluster.base_url, MODEL_NAME, levels, duration_s, lambda: descendants(engine_pid), "tessera"
    )
    return by_level, mixed, {"registration": {k: reg.get(k) for k in ("name", *TESSERA_REGISTRATION)}}


# --- llama-server --------------------------------------------------------------------------------


def llama_server_args(levels: list[int]) -> tuple[int, int, list[str]]:
    """(parallel, context, extra flags): one slot per client up to 64, each slot
    LLAMA_SLOT_TOKENS, in one unified KV cache so that the mixed run's long request may grow
    past its slot's share; the GGUF's own chat template (--jinja), as the others apply it."""
    parallel = max(LLAMA_PARALLEL, *levels)
    return parallel, parallel * LLAMA_SLOT_TOKENS, ["--cont-batching", "--kv-unified", "--jinja"]


def bench_llama_server(gguf: Path, levels: list[int], duration_s: float) -> Measured:
    """llama-server started once for every run (its slots and KV cache are fixed at start, as a
    deployment's are); memory = its process."""
    parallel, ctx, extra = llama_server_args(levels)
    with LlamaServer(gguf, threads=THREADS, ctx=ctx, parallel=parallel, extra=extra) as server:
        log(f"llama-server up: {' '.join(server.cmd)}")
        warm(server.base_url, "gguf", "llama_server")
        by_level, mixed = bench_http(server.base_url, "gguf", levels, duration_s, lambda: [server.pid], "llama_server")
    return by_level, mixed, {"cmd": server.cmd, "version": LLAMA_CPP_PYTHON_VERSION}


# --- ContinuousBatchingPipeline in one process ---------------------------------------------------


def kv_blocks(prompt_tokens: int, clients: int) -> int:
    """KV blocks for `clients` sequences of prompt + MAX_TOKENS, or for the mixed run (one
    prompt + LONG_TOKENS beside 31 short ones), whichever is more, with a margin."""

    def blocks(tokens: int) -> int:
        return math.ceil(tokens / KV_BLOCK_TOKENS)

    short = blocks(prompt_tokens + MAX_TOKENS)
    need = max(clients * short, blocks(prompt_tokens + LONG_TOKENS) + MIXED_SHORT_CLIENTS * short)
    return math.ceil(need * KV_MARGIN)


@dataclasses.dataclass(eq=False)  # compared by identity: "is this the long request?"
class Live:
    """A request in the pipeline: which client sent it, its handle, and what it produced."""

    client: int
    handle: Any
    sent: float
    first: float | None = None
    last: float = 0.0
    tokens: int = 0
    arrivals: list[float] = dataclasses.field(default_factory=list)


def read_ready(req: Live, now: float, running: Any) -> bool:
    """Read what the handle has ready (only when `can_read()`: `read()` would block holding the
    GIL); True once the request is over and nothing is left to read."""
    h = req.handle
    if h.can_read():
        n = sum(len(out.generated_ids) for out in h.read().values())
        if n:
            req.first = req.first if req.first is not None else now
            req.last = now
            req.tokens += n
            req.arrivals.extend([now] * n)
    return h.get_status() != running and not h.can_read()


def outcome_of(req: Live) -> Outcome:
    """A request the pipeline is done with, as its client saw it."""
    status = req.handle.get_status()
    if status.name == "FINISHED" and req.first is not None:
        return timed_outcome(req.sent, req.arrivals, req.tokens)
    return Outcome(status.name.lower(), req.tokens)


class PipelineLoop:
    """The pipeline on the IR, driven as a serving engine drives it: one thread adds the
    requests that arrive, steps, and reads the handles with tokens ready. The clients are
    simulated in the same thread: a finished request's client sends its next one at once."""

    def __init__(self, ir: str, kv_clients: int) -> None:
        import openvino_genai as ov_genai

        self.ov_genai = ov_genai
        tok = ov_genai.Tokenizer(ir)
        chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
        self.prompts = [tok.encode(c).input_ids for c in chats]  # as Tessera's gateway encodes
        self.sched = ov_genai.SchedulerConfig()
        self.sched.enable_prefix_caching = True
        self.sched.cache_size = 0
        self.sched.num_kv_blocks = kv_blocks(max(int(p.shape[1]) for p in self.prompts), kv_clients)
        self.pipe = ov_genai.ContinuousBatchingPipeline(ir, self.sched, "CPU", {"INFERENCE_NUM_THREADS": THREADS})
        self.running = ov_genai.py_openvino_genai.GenerationStatus.RUNNING
        self.short_cfg = self.config(MAX_TOKENS)
        self.live: dict[int, Live] = {}
        self.next_id = 0
        self.sent_by: Counter[int] = Counter()

    def config(self, tokens: int) -> Any:
        cfg = self.ov_genai.GenerationConfig()
        cfg.max_new_tokens = tokens
        cfg.ignore_eos = True
        cfg.do_sample = False
        return cfg

    def submit(self, client: int, prompt: Any, cfg: Any) -> Live:
        rid, self.next_id = self.next_id, self.next_id + 1
        self.live[rid] = Live(client, self.pipe.add_request(rid, prompt, cfg), time.perf_counter())
        return self.live[rid]

    def submit_short(self, client: int) -> None:
        """Client i's k-th request uses prompt i + k, as over HTTP."""
        self.submit(client, self.prompts[(client + self.sent_by[client]) % len(self.prompts)], self.short_cfg)
        self.sent_by[client] += 1

    def step(self) -> list[Live]:
        """One engine step, then every handle with tokens read; the requests now over."""
        self.pipe.step()
        now = time.perf_counter()
        over = [rid for rid, req in self.live.items() if read_ready(req, now, self.running)]
        return [self.live.pop(rid) for rid in over]

    def warm_up(self) -> None:
        """One request to the end, not measured: the first inference of a model is slower."""
        warm = self.submit(0, self.prompts[0], self.short_cfg)
        while warm not in self.step():
            pass

    def start_long(self, tokens: int) -> Live:
        """The mixed run's long request, stepped until it streams (or is over)."""
        long = self.submit(-1, self.prompts[0], self.config(tokens))
        while long.first is None and long not in self.step():
            pass
        return long

    def serve(self, clients: int, duration_s: float, long_tokens: int) -> dict[str, Any]:
        """`clients` back to back for `duration_s` (with a long request first, until it ends);
        then the requests in flight finish. A long request still running is cancelled."""
        long = self.start_long(long_tokens) if long_tokens else None
        long_outcome = None if long is None or long in self.live.values() else outcome_of(long)
        t0 = end = time.perf_counter()
        deadline = t0 + duration_s
        for c in range(clients):
            self.submit_short(c)
        outcomes: list[Outcome] = []
        while any(r.client >= 0 for r in self.live.values()):
            for req in self.step():
                if req is long:
                    long_outcome = outcome_of(req)
                    continue
                outcomes.append(outcome_of(req))
                end = time.perf_counter()
                if end < deadline and long_outcome is None:
                    self.submit_short(req.client)
        if long is not None and long_outcome is None:
            long_outcome = Outcome("running", long.tokens)
            long.handle.cancel()
            while self.pipe.has_non_finished_requests():  # its blocks are freed at a step
                self.pipe.step()
        for o in outcomes:  # perf_counter of this process: relative to the run's start
            o.arrivals = [t - t0 for t in o.arrivals]
        return {
            "outcomes": [dataclasses.asdict(o) for o in outcomes],
            "wall_s": end - t0,
            "window_s": duration_s,
            "long": dataclasses.asdict(dataclasses.replace(long_outcome, arrivals=[])) if long_outcome else None,
            "scheduler": self.sched.to_string(),
            "kv_blocks": self.sched.num_kv_blocks,
        }


def pipeline_driver(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: load, warm up, print READY (the parent then samples its memory),
    serve the run `spec` describes, and return what it measured."""
    loop = PipelineLoop(spec["ir"], spec["kv_clients"])
    loop.warm_up()
    print("READY", flush=True)
    return loop.serve(spec["clients"], spec["duration_s"], spec["long_tokens"])


def run_pipeline(
    ir: Path, clients: int, duration_s: float, kv_clients: int, long_tokens: int = 0
) -> tuple[Run, dict[str, Any]]:
    """One run in a fresh process; its memory is sampled from READY (after load and warm-up,
    as the other systems' are) to its exit."""
    spec = {
        "ir": str(ir),
        "clients": clients,
        "duration_s": duration_s,
        "kv_clients": kv_clients,
        "long_tokens": long_tokens,
    }
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.serving", "--pipeline-driver", json.dumps(spec)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"pipeline driver did not start (exit {proc.wait(30)}): {line[:500]}")
        with RssSampler(lambda: [proc.pid]) as rss:
            rest = proc.stdout.read()
            code = proc.wait(CHILD_TIMEOUT_S)
        if code != 0:
            raise RuntimeError(f"pipeline driver exited with {code}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    answer = json.loads(rest.strip().splitlines()[-1])
    long = Outcome(**answer["long"]) if answer["long"] else None
    run = Run(
        [Outcome(**o) for o in answer["outcomes"]],
        answer["wall_s"],
        long,
        rss.peak,
        t0=0.0,
        window_s=answer["window_s"],
    )
    return run, {"scheduler": answer["scheduler"], "kv_blocks": answer["kv_blocks"]}


def bench_pipeline(ir: Path, levels: list[int], duration_s: float) -> Measured:
    """A fresh process per run (each level, the mixed run alone and with the long request)."""
    kv_clients = max(64, *levels)  # one KV size for every run, as one server would have
    out: dict[str, Any] = {}
    config: dict[str, Any] = {}
    for c in levels:
        run, config = run_pipeline(ir, c, duration_s, kv_clients)
        out[str(c)] = summarize(run, MAX_TOKENS)
        log_level("pipeline", c, out[str(c)])
    alone, _ = run_pipeline(ir, MIXED_SHORT_CLIENTS, duration_s, kv_clients)
    mixed, _ = run_pipeline(ir, MIXED_SHORT_CLIENTS, duration_s, kv_clients, LONG_TOKENS)
    result = summarize_mixed(alone, mixed)
    log_mixed("pipeline", result)
    return out, result, config


# --- the run -------------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def ratios(res: dict[str, Any]) -> dict[str, float | None]:
    """The issue's comparisons (None where a side was not run)."""

    def get(system: str, c: int, key: str) -> float | None:
        value = (res.get(system) or {}).get(str(c), {}).get(key)
        return None if value is None else float(value)

    return {
        "tessera_over_pipeline_tok_s_c32": ratio(get("tessera", 32, "tok_s"), get("pipeline", 32, "tok_s")),
        "tessera_over_pipeline_tok_s_c64": ratio(get("tessera", 64, "tok_s"), get("pipeline", 64, "tok_s")),
        "tessera_over_llama_server_tok_s_c32": ratio(get("tessera", 32, "tok_s"), get("llama_server", 32, "tok_s")),
        "tessera_over_pipeline_tpot_p50_c1": ratio(get("tessera", 1, "tpot_p50_s"), get("pipeline", 1, "tpot_p50_s")),
    }


def targets(res: dict[str, Any], r: dict[str, float | None]) -> dict[str, Any]:
    """The issue's targets, pass/fail (None where the figures are missing)."""

    def at_least(v: float | None, bound: float) -> dict[str, Any]:
        return {"value": v, "target": f">= {bound}", "pass": None if v is None else v >= bound}

    mixed = (res.get("mixed") or {}).get("tessera") or {}
    refused = None
    if res.get("tessera"):
        # Every run at c <= 64: the levels and the mixed run's (31 or 32 requests at once).
        runs = [*res["tessera"].values(), *(mixed[k] for k in ("short", "short_alone") if k in mixed)]
        statuses = [s for run in runs for s, n in run["errors"].items() for _ in range(n)]
        statuses += [mixed["long"]["status"]] if mixed.get("long") else []
        refused = sum(1 for s in statuses if s == "429" or s.startswith("5"))
    tpot = r["tessera_over_pipeline_tpot_p50_c1"]
    return {
        "tessera_over_pipeline_c32": at_least(r["tessera_over_pipeline_tok_s_c32"], 0.9),
        "tessera_over_pipeline_c64": at_least(r["tessera_over_pipeline_tok_s_c64"], 0.9),
        "tessera_over_llama_server_c32": at_least(r["tessera_over_llama_server_tok_s_c32"], 3.0),
        "tessera_429_5xx": {"value": refused, "target": "== 0", "pass": None if refused is None else refused == 0},
        "mixed_short_ttft_p99_ratio": {
            "value": mixed.get("ratio"),
            "target": "<= 2",
            "pass": None if mixed.get("ratio") is None else mixed["ratio"] <= 2,
        },
        "tpot_c1_within_10pct": {"value": tpot, "target": "<= 1.1", "pass": None if tpot is None else tpot <= 1.1},
    }


def plot(res: dict[str, Any], levels: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "tessera": "Tessera (gateway)",
        "pipeline": "ContinuousBatchingPipeline (one process)",
        "llama_server": f"llama-server --parallel {LLAMA_PARALLEL}",
    }
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for system in SYSTEMS:
        by_c = res.get(system) or {}
        pts = [(c, by_c[str(c)]["tok_s"]) for c in levels if str(c) in by_c and by_c[str(c)]["tok_s"]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=labels[system])
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent clients (back to back)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Serving SmolLM2-135M on {os.cpu_count()} cores: {MAX_TOKENS}-token greedy streams")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def attempt(res: dict[str, Any], system: str, bench: Callable[[], Measured]) -> None:
    """Run one system's benchmark into `res`; a failure is recorded under `failed` (with an
    engine under rewrite, Tessera may fail) and the other systems still run."""
    try:
        res[system], res["mixed"][system], res["setup"][system] = bench()
    except Exception as e:
        log(f"{system} failed: {type(e).__name__}: {e}")
        res["failed"][system] = f"{type(e).__name__}: {e}"


def run_systems(systems: list[str], levels: list[int], duration_s: float, home: Path) -> dict[str, Any]:
    """Tessera first (its registration converts the IR the pipeline then loads; the cluster is
    stopped before the others run), the pipeline, llama-server."""
    gguf = default_model_path()
    res: dict[str, Any] = {"mixed": {}, "setup": {}, "failed": {}}
    ir: Path | None = None
    if "tessera" in systems or "pipeline" in systems:
        cluster = LocalCluster(
            home=home / "home", store=home / "store", env={"TESSERA_INFERENCE_THREADS": str(THREADS), **EXTRA_ENV}
        )
        try:
            cluster.start(timeout_s=120.0)
            reg = register(cluster, gguf)
            ir = Path(reg["artifact"]["path"])
            log(f"cluster up at {cluster.base_url}, {MODEL_NAME} registered; IR in {ir}")
            if "tessera" in systems:
                attempt(res, "tessera", lambda: bench_tessera(cluster, reg, levels, duration_s))
        except Exception as e:  # the cluster did not start, or registration failed
            log(f"cluster failed: {type(e).__name__}: {e}")
            res["failed"]["cluster"] = f"{type(e).__name__}: {e}"
        finally:
            cluster.stop()
    if "pipeline" in systems and ir is not None:
        attempt(res, "pipeline", lambda: bench_pipeline(ir, levels, duration_s))
    if "llama_server" in systems:
        attempt(res, "llama_server", lambda: bench_llama_server(gguf, levels, duration_s))
    return res


# --- structured output (issue 18): json_schema against plain generation, same run ---------------

STRUCTURED_CLIENTS = 8
STRUCTURED_MAX_TOKENS = 160
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 80},
        "mood": {"type": "string", "enum": ["calm", "busy", "sad", "happy"]},
        "lines": {"type": "integer"},
    },
    "required": ["title", "mood", "lines"],
    "additionalProperties": False,
}


async def structured_load(
    base_url: str, model: str, duration_s: float, schema: dict[str, Any] | None, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """STRUCTURED_CLIENTS clients back to back (non-streamed, greedy, same prompts), with the
    JSON schema enforced or not: completion tokens per second of the run, and the share of
    answers that parse and validate against the schema."""
    import jsonschema_rs

    body_format = (
        {}
        if schema is None
        else {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "poem", "schema": schema, "strict": True},
            }
        }
    )
    done: list[tuple[int, bool]] = []
    errors: Counter[str] = Counter()

    async def client(http: httpx.AsyncClient, index: int, deadline: float) -> None:
        k = 0
        while time.perf_counter() < deadline:
            prompt = (
                PROMPTS[(index + k) % len(PROMPTS)] + " Answer as JSON with a title, a mood and the number of lines."
            )
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "temperature": 0,
                "max_tokens": STRUCTURED_MAX_TOKENS,
                **body_format,
                **(extra or {}),
            }
            k += 1
            r = await http.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                errors[str(r.status_code)] += 1
                continue
            answer = r.json()
            text = answer["choices"][0]["message"]["content"] or ""
            try:
                jsonschema_rs.validate(schema or {}, json.loads(text))
                valid = True
            except ValueError:
                valid = False
            done.append((int(answer["usage"]["completion_tokens"]), valid))

    async with httpx.AsyncClient(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http, i, t0 + duration_s) for i in range(STRUCTURED_CLIENTS)))
        wall = time.perf_counter() - t0
    return {
        "tok_s": round(sum(n for n, _ in done) / wall, 1),
        "requests": len(done),
        "tokens": sum(n for n, _ in done),
        "valid_share": round(sum(v for _, v in done) / len(done), 3) if done else None,
        "errors": dict(errors),
        "wall_s": round(wall, 2),
    }


def bench_structured(duration_s: float, home: Path) -> dict[str, Any]:
    """Tessera at c=STRUCTURED_CLIENTS: json_schema, plain answers of the same length, json_schema
    again (`tok_s` is the mean of the two), then what logprobs cost: the chosen token's, and
    with 5 alternatives."""
    cluster = LocalCluster(
        home=home / "home", store=home / "store", env={"TESSERA_INFERENCE_THREADS": str(THREADS), **EXTRA_ENV}
    )
    try:
        cluster.start(timeout_s=120.0)
        register(cluster, default_model_path())
        warm(cluster.base_url, MODEL_NAME, "tessera")
        deadline = time.monotonic() + 120
        while not _on_core(cluster) and time.monotonic() < deadline:
            time.sleep(0.2)  # sync-ok: polling a condition with a deadline
        # The JSON answers end when their object closes (≈ 30 tokens): the plain run's answers
        # are made as long (ignore_eos, max_tokens = their mean), so that the two differ in the
        # grammar alone, not in how much prefill each token carries. Structured runs bracket
        # the plain one against drift.
        first = asyncio.run(structured_load(cluster.base_url, MODEL_NAME, duration_s, STRUCTURED_SCHEMA))
        mean = max(1, round(first["tokens"] / max(first["requests"], 1)))
        plain_run = asyncio.run(
            structured_load(cluster.base_url, MODEL_NAME, duration_s, None, {"max_tokens": mean, "ignore_eos": True})
        )
        second = asyncio.run(structured_load(cluster.base_url, MODEL_NAME, duration_s, STRUCTURED_SCHEMA))
        # What logprobs cost, same load: the chosen token's (the library's, on the core), and
        # 5 alternatives (read from the logits on the stateful tier).
        # What logprobs cost, at the plain run's shape: the chosen token's (the library's, on
        # the core), and 5 alternatives (read from the logits on the stateful tier).
        shape = {"max_tokens": mean, "ignore_eos": True}
        chosen = asyncio.run(
            structured_load(cluster.base_url, MODEL_NAME, duration_s, None, {**shape, "logprobs": True})
        )
        top5 = asyncio.run(
            structured_load(
                cluster.base_url, MODEL_NAME, duration_s, None, {**shape, "logprobs": True, "top_logprobs": 5}
            )
        )
    finally:
        cluster.stop()
    structured = (first["tok_s"] + second["tok_s"]) / 2
    plain = plain_run["tok_s"]
    valid = min(first["valid_share"] or 0.0, second["valid_share"] or 0.0)
    ratio = round(structured / plain, 3) if plain else None
    out = {
        "tok_s": round(structured, 1),
        "plain_tok_s": plain,
        "valid_share": valid,
        "ratio": ratio,
        "clients": STRUCTURED_CLIENTS,
        "max_tokens": STRUCTURED_MAX_TOKENS,
        "plain_max_tokens": mean,
        "schema": STRUCTURED_SCHEMA,
        "runs": {"structured_before": first, "plain": plain_run, "structured_after": second},
        "targets": {"valid_share": {"value": valid, "target": "== 1.0"}, "ratio": {"value": ratio, "target": ">= 0.8"}},
    }
    out["logprobs"] = {
        "chosen_tok_s": chosen["tok_s"],
        "top5_tok_s": top5["tok_s"],
        "plain_tok_s": plain,
        "chosen_ratio": round(chosen["tok_s"] / plain, 3) if plain else None,
        "top5_ratio": round(top5["tok_s"] / plain, 3) if plain else None,
        "runs": {"chosen": chosen, "top5": top5},
    }
    log(
        f"structured: {out['tok_s']} tok/s against plain {out['plain_tok_s']} ({out['ratio']}x), "
        f"valid {out['valid_share']}; logprobs: chosen {out['logprobs']['chosen_ratio']}x, "
        f"top 5 {out['logprobs']['top5_ratio']}x plain"
    )
    return out


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
