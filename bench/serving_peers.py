"""The peers Tessera is compared with in `bench/serving.py`: llama-server over its OpenAI API,
and OpenVINO GenAI's ContinuousBatchingPipeline driven in a fresh process (`pipeline_driver`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.llama_server import LLAMA_CPP_PYTHON_VERSION, LlamaServer
from bench.serving_http import bench_http
from bench.serving_memory import RssSampler
from bench.serving_runs import (
    CHILD_TIMEOUT_S,
    KV_BLOCK_TOKENS,
    KV_MARGIN,
    LLAMA_PARALLEL,
    LLAMA_SLOT_TOKENS,
    LONG_TOKENS,
    MAX_TOKENS,
    MIXED_SHORT_CLIENTS,
    PROMPTS,
    REPO_ROOT,
    THREADS,
    Measured,
    Outcome,
    Run,
    log,
    log_level,
    log_mixed,
    summarize,
    summarize_mixed,
    timed_outcome,
)
from bench.serving_tessera import warm

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


def bench_pipeline(ir: Path, levels: list[int], duration_s: float, mixed_run: bool = True) -> Measured:
    """A fresh process per run (each level, then with `mixed_run` the mixed run alone and with
    the long request)."""
    kv_clients = max([64, *levels])  # one KV size for every run, as one server would have
    out: dict[str, Any] = {}
    config: dict[str, Any] = {}
    for c in levels:
        run, config = run_pipeline(ir, c, duration_s, kv_clients)
        out[str(c)] = summarize(run, MAX_TOKENS)
        log_level("pipeline", c, out[str(c)])
    if not mixed_run:
        return out, {}, config
    alone, _ = run_pipeline(ir, MIXED_SHORT_CLIENTS, duration_s, kv_clients)
    mixed, _ = run_pipeline(ir, MIXED_SHORT_CLIENTS, duration_s, kv_clients, LONG_TOKENS)
    result = summarize_mixed(alone, mixed)
    log_mixed("pipeline", result)
    return out, result, config
