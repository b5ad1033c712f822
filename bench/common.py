"""Pieces shared by the benchmarks that drive a local Tessera cluster (`bench/coldstart.py`,
`bench/nostall.py`): constants, logging, percentiles, the HTTP client helpers (a streamed
chat request timed chunk by chunk, waiting for scale-to-zero, `/admin/coldstarts`,
`/admin/cache/evict`) and the machine description written into each result."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

THREADS = 2
PHASES = ("init", "load", "profile", "prefill")

REQUEST_TIMEOUT_S = 300.0
UNLOAD_TIMEOUT_S = 60.0
EVICT_TIMEOUT_S = 30.0
COLDSTART_LOG_TIMEOUT_S = 15.0


def make_log(prefix: str) -> Callable[[str], None]:
    """A `log(msg)` that writes `[prefix] msg` to stderr."""

    def log(msg: str) -> None:
        print(f"[{prefix}] {msg}", file=sys.stderr, flush=True)

    return log


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the closest ranks (numpy's default)."""
    ys = sorted(xs)
    k = (len(ys) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(ys) - 1)
    return float(ys[lo] + (ys[hi] - ys[lo]) * (k - lo))


def median_index(xs: list[float]) -> int:
    """Index of the run at the median (the lower middle one for an even count)."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    return order[(len(xs) - 1) // 2]


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
"""The instruction sets the engines' kernels pick from: results are compared only between runs
on the same set."""


def cpu_description() -> dict[str, Any]:
    """The CPU's model name and which of `ISA_FLAGS` it has, from /proc/cpuinfo."""
    model, flags = "", set[str]()
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu_model": model, "isa": [f for f in ISA_FLAGS if f in flags]}


def machine_info(load_before: tuple[float, float, float]) -> dict[str, Any]:
    """CPU count, model and instruction sets, platform, Python, and the load average before
    (given) and now."""
    return {
        "cpu_count": os.cpu_count(),
        **cpu_description(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "loadavg_before": list(load_before),
        "loadavg_after": list(os.getloadavg()),
    }


# --- streamed chat requests ----------------------------------------------------------------------


def chat_body(model: str, prompt: str, max_tokens: int, ignore_eos: bool = False) -> dict[str, Any]:
    """A greedy, streamed chat request with the usage in its last chunk."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    return body


class ChatStream:
    """The state of one streamed chat response, fed its SSE lines as they arrive: the
    perf_counter arrival time and content of every content chunk, the usage, whether `[DONE]`
    came, and the error a chunk carried. `on_chunk(n)` is called after the n-th content chunk."""

    def __init__(self, on_chunk: Callable[[int], Any] | None = None) -> None:
        self.on_chunk = on_chunk
        self.arrivals: list[float] = []
        self.chunks: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.error: str | None = None

    def feed(self, line: str) -> bool:
        """Take one line; False once the stream is over (`[DONE]`, or a chunk with an error)."""
        if not line.startswith("data:"):
            return True
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return False
        obj = json.loads(payload)
        if "error" in obj:
            self.error = f"stream error: {obj['error']}"
            return False
        if obj.get("usage"):
            self.usage = obj["usage"]
        for choice in obj.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                self.arrivals.append(time.perf_counter())
                self.chunks.append(content)
                if self.on_chunk is not None:
                    self.on_chunk(len(self.arrivals))
        return True

    def problem(self) -> str | None:
        """Why the stream failed (checked once it is over), or None."""
        if self.error is not None:
            return self.error
        if not self.arrivals:
            return "the stream carried no content"
        if not self.done:
            return "the stream ended without [DONE]"
        return None


def stream_chat(
    http: httpx.Client, body: dict[str, Any], on_chunk: Callable[[int], Any] | None = None, label: str | None = None
) -> dict[str, Any]:
    """One streamed chat request, timed from just before sending it: `sent_wall` (time.time),
    `sent` and `arrivals` (perf_counter: when it was sent, when each content chunk arrived),
    `chunks` (each chunk's content) and `usage` (None if no chunk carried one). `on_chunk(n)`
    is called after the n-th content chunk; `label` prefixes the error messages."""
    err = f"{label}: " if label else ""
    sent_wall = time.time()
    sent = time.perf_counter()
    chat = ChatStream(on_chunk)
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{err}HTTP {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not chat.feed(line):
                break
    problem = chat.problem()
    if problem is not None:
        raise RuntimeError(f"{err}{problem}")
    return {"sent_wall": sent_wall, "sent": sent, "arrivals": chat.arrivals, "chunks": chat.chunks, "usage": chat.usage}


# --- the admin API -------------------------------------------------------------------------------


def resident_ids(answer: list[dict[str, Any]]) -> list[str]:
    """The artifact ids of the resident models an `/admin/cache/evict` answer dropped."""
    return [a for e in answer if e.get("tier") == "resident" for a in e.get("artifact_ids", ())]


class TesseraClient:
    """A synchronous client of the gateway's OpenAI and admin endpoints."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.http = httpx.Client(base_url=base_url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S))

    def close(self) -> None:
        self.http.close()

    def loaded(self, model: str) -> bool:
        """Whether an instance of `model` is loaded (or starting) anywhere."""
        status = self.http.get("/admin/instances", timeout=10).raise_for_status().json()
        if model in status.get("starting", ()):
            return True
        for node in status.get("nodes", []):
            if model in node.get("starting", ()):
                return True
            if any(i.get("model") == model for i in node.get("instances", [])):
                return True
        return False

    def wait_scaled_to_zero(self, model: str, timeout_s: float = UNLOAD_TIMEOUT_S, note: str = "") -> float:
        """Poll until no instance of `model` is loaded or starting; the seconds it took.
        `note` is appended to the timeout's message."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while time.monotonic() < deadline:
            if not self.loaded(model):
                return time.monotonic() - t0
            time.sleep(0.1)
        raise TimeoutError(f"{model} still loaded after {timeout_s}s{note}")

    def cold_starts(self) -> list[dict[str, Any]]:
        """The latest cold-start records (`GET /admin/coldstarts`), newest first."""
        return list(self.http.get("/admin/coldstarts", params={"limit": 200}, timeout=10).raise_for_status().json())

    def cold_starts_since(self, model: str, sent_wall: float) -> list[dict[str, Any]]:
        """The cold-start records of `model` that began after `sent_wall`, newest first."""
        return [e for e in self.cold_starts() if e.get("model") == model and e.get("started_at", 0) >= sent_wall - 0.05]

    def cold_start_after(
        self, model: str, sent_wall: float, timeout_s: float = COLDSTART_LOG_TIMEOUT_S
    ) -> dict[str, Any]:
        """The newest cold-start record of `model` that began after `sent_wall` (it is written
        once the first token is out, so it may trail the stream a little)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            starts = self.cold_starts_since(model, sent_wall)
            if starts:
                return dict(starts[0])
            time.sleep(0.1)
        raise TimeoutError(f"no cold-start record for {model} after {sent_wall} within {timeout_s}s")

    def evict_until(
        self, artifact_id: str, params: dict[str, str], timeout_s: float = EVICT_TIMEOUT_S
    ) -> tuple[list[list[dict[str, Any]]], float]:
        """`POST /admin/cache/evict` with `params` until `artifact_id` is among the resident
        models dropped (the entries with `"tier": "resident"`). Returns every answer, one per
        call, and the seconds it took.

        Right after the scheduler stops seeing the instance, the engine may still be releasing
        it (the resident is not idle yet, so it is not evicted): then ask again (with `all`,
        each call also drops the host and page caches again, which is harmless)."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        answers: list[list[dict[str, Any]]] = []
        while True:
            answer = list(self.http.post("/admin/cache/evict", params=params, timeout=30).raise_for_status().json())
            answers.append(answer)
            if artifact_id in resident_ids(answer):
                return answers, time.monotonic() - t0
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"artifact {artifact_id} not evicted within {timeout_s}s "
                    f"({len(answers)} calls, last answer {answer})"
                )
            time.sleep(0.1)
