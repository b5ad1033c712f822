"""The client side of `bench/serverless.py`: the trace replayed open-loop against the gateway,
every request timed line by line, and the figures a run reports.

Each request is a streamed chat completion sent at its arrival time (whatever is still in
flight). Per request it records when each SSE line arrived, data lines and comment lines
apart (`: tessera loading ...` progress comments, issue 35 part 4), so that both client
timeouts can be judged from one replay:

- without progress comments, a client's read timeout runs from the request's sending to its
  first data line, and from each data line to the next: `max_data_gap_s`;
- with them, every line resets it, comments included: `max_line_gap_s`.

A request over 30 s in the first is one a 30 s client timeout would have lost (`timeouts_30s`);
in the second, one it would have lost with progress comments on.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.common import percentile

CLIENT_TIMEOUT_S = 30.0
PROMPT = "Write a short poem about the sea."
REQUEST_CAP_S = 300.0
"""The replay's own bound on one request (the 30 s timeout is judged from the times, not
enforced: a request is let run to its answer so its TTFT is known)."""
PCT = re.compile(r"\b(\d{1,3})%")


@dataclass
class Timed:
    """One request of the replay and what came back."""

    rank: int
    requested: str
    at_s: float
    """Its arrival time in the trace."""
    sent: float = 0.0
    status: str = ""
    """"200", another HTTP status, "timeout", "transport" or "stream_error"."""
    served_by: str | None = None
    first_content: float | None = None
    cold_header: str | None = None
    error: str = ""
    """The error's message (an HTTP error's body, a stream's error event, the exception)."""
    comments: int = 0
    progress_pct: list[int] = field(default_factory=list)
    max_data_gap_s: float = 0.0
    max_line_gap_s: float = 0.0
    done: float = 0.0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_content is None else self.first_content - self.sent


class Lines:
    """The gaps between a stream's lines, as a client's read timeout sees them."""

    def __init__(self, rec: Timed) -> None:
        self.rec = rec
        self.last_data = self.last_line = rec.sent

    def feed(self, line: str, now: float) -> bool:
        """Take one line; False once the stream is over."""
        rec = self.rec
        if not line:
            return True  # the blank line between events is part of the event before
        rec.max_line_gap_s = max(rec.max_line_gap_s, now - self.last_line)
        self.last_line = now
        if line.startswith(":"):
            rec.comments += 1
            if m := PCT.search(line):
                rec.progress_pct.append(int(m.group(1)))
            return True
        if not line.startswith("data:"):
            return True
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.data(now)
            return False
        obj = json.loads(payload)
        if "error" in obj:
            self.data(now)
            rec.status, rec.error = "stream_error", json.dumps(obj["error"])[:300]
            return False
        rec.served_by = rec.served_by or obj.get("model")
        choices = obj.get("choices") or []
        # The role-only first chunk does not count: the gateway sends it as its stream begins,
        # which without progress comments is once the model is ready, not while it starts.
        if any((c.get("delta") or {}).get("content") or c.get("finish_reason") for c in choices):
            self.data(now)
            if rec.first_content is None and any((c.get("delta") or {}).get("content") for c in choices):
                rec.first_content = now
        return True

    def data(self, now: float) -> None:
        """A line a client without progress comments would have seen: its read timeout resets."""
        self.rec.max_data_gap_s = max(self.rec.max_data_gap_s, now - self.last_data)
        self.last_data = now


async def send(http: httpx.AsyncClient, rec: Timed, max_tokens: int) -> None:
    body = {
        "model": rec.requested,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    rec.sent = time.perf_counter()
    lines = Lines(rec)
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            rec.cold_header = r.headers.get("x-tessera-cold-start")
            if r.status_code != 200:
                await r.aread()
                rec.status, rec.error = str(r.status_code), r.text[:300]
                return
            rec.status = "200"
            async for line in r.aiter_lines():
                if not lines.feed(line, time.perf_counter()):
                    break
    except httpx.TimeoutException as e:
        rec.status, rec.error = "timeout", repr(e)[:300]
    except httpx.HTTPError as e:
        rec.status, rec.error = "transport", repr(e)[:300]
    finally:
        rec.done = time.perf_counter()
        if rec.status == "200" and rec.first_content is None:
            rec.status = "stream_error"
        if rec.status != "200":  # its client waited from its last line to the failure too
            rec.max_data_gap_s = max(rec.max_data_gap_s, rec.done - lines.last_data)
            rec.max_line_gap_s = max(rec.max_line_gap_s, rec.done - lines.last_line)


async def replay(
    base_url: str, schedule: list[tuple[float, int, str]], max_tokens: int
) -> tuple[list[Timed], float, float]:
    """Send each (at_s, rank, requested name) at its time from now; every request's record,
    the perf_counter time the replay began, and its wall time (to the last answer)."""
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    timeout = httpx.Timeout(REQUEST_CAP_S, connect=30.0)
    records = [Timed(rank, name, at) for at, rank, name in schedule]
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as http:
        t0 = time.perf_counter()
        tasks = []
        for rec in records:
            delay = t0 + rec.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(http, rec, max_tokens)))
        await asyncio.gather(*tasks)
    return records, t0, time.perf_counter() - t0


def monotonic(xs: list[int]) -> bool:
    return all(a <= b for a, b in itertools.pairwise(xs))


def summarize(records: list[Timed], trace_s: float, wall_s: float, cold_starts: int) -> dict[str, Any]:
    """A run's figures: the issue's four, and what they were read from. Starts per hour are
    counted over the trace's span (`trace_s`, the same in every run, so runs compare by their
    counts), not over the replay's wall time, which a slow run stretches."""
    ok = [r for r in records if r.status == "200"]
    ttfts = [t for r in ok if (t := r.ttft_s) is not None]
    served: dict[str, Counter[str]] = {}
    for r in ok:
        served.setdefault(r.requested, Counter())[r.served_by or "?"] += 1
    return {
        "cold_starts_per_hour": cold_starts / trace_s * 3600.0,
        "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
        # What a 30 s read timeout loses without progress comments: no data line for 30 s
        # (from the sending to the first, or between two, or to a failure).
        "timeouts_30s": sum(1 for r in records if r.max_data_gap_s > CLIENT_TIMEOUT_S),
        "timeouts_30s_with_progress": sum(1 for r in records if r.max_line_gap_s > CLIENT_TIMEOUT_S),
        "cold_starts": cold_starts,
        "wall_s": wall_s,
        "requests": len(records),
        "completed": len(ok),
        "errors": dict(Counter(r.status for r in records if r.status != "200")),
        "error_samples": error_samples(records),
        "ttft_max_s": max(ttfts) if ttfts else None,
        "requests_waiting_on_a_start": sum(1 for r in records if r.cold_header),
        "progress_comments": sum(r.comments for r in records),
        "requests_with_progress": sum(1 for r in records if r.comments),
        "progress_monotonic": all(monotonic(r.progress_pct) for r in records),
        "served_by": {k: dict(v) for k, v in sorted(served.items())},
        "max_data_gap_s": max((r.max_data_gap_s for r in records), default=None),
        "max_line_gap_s": max((r.max_line_gap_s for r in records), default=None),
    }


def rows(records: list[Timed]) -> list[dict[str, Any]]:
    """Every request, compactly: when, what it asked and got, and its gaps."""
    return [
        {
            "at_s": round(r.at_s, 3),
            "requested": r.requested,
            "served_by": r.served_by,
            "status": r.status,
            "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 3),
            "max_data_gap_s": round(r.max_data_gap_s, 3),
            "max_line_gap_s": round(r.max_line_gap_s, 3),
            "comments": r.comments,
            "cold_header": r.cold_header,
        }
        for r in records
    ]


def error_samples(records: list[Timed]) -> dict[str, list[str]]:
    """Up to three distinct messages per error status."""
    out: dict[str, list[str]] = {}
    for r in records:
        if r.status != "200" and r.error not in (seen := out.setdefault(r.status, [])) and len(seen) < 3:
            seen.append(r.error)
    return out


def per_model(records: list[Timed]) -> dict[str, dict[str, Any]]:
    """Requests, TTFT p50 and waits on a start per requested name."""
    out: dict[str, dict[str, Any]] = {}
    for name in sorted({r.requested for r in records}):
        mine = [r for r in records if r.requested == name]
        ttfts = [t for r in mine if r.status == "200" and (t := r.ttft_s) is not None]
        out[name] = {
            "rank": mine[0].rank,
            "requests": len(mine),
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
            "ttft_max_s": max(ttfts) if ttfts else None,
            "waited_on_a_start": sum(1 for r in mine if r.cold_header),
            "errors": sum(1 for r in mine if r.status != "200"),
        }
    return out
